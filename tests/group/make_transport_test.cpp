// make_transport(): backends that are not linked into the program, the automatic rendezvous
// without the MPI backend, and the rank tag of the log lines once a group has formed. This
// binary links the group layer without pulseloco_transport_mpi and _nccl.
#include <gtest/gtest.h>

#include <spdlog/sinks/ostream_sink.h>

#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/build_config.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/rendezvous.h>

namespace pulseloco::group {
namespace {

using transport::Backend;

std::string what_make_transport_says(const TransportOptions& options) {
  try {
    (void)make_transport(options);
  } catch (const InvalidArgument& error) {
    return error.what();
  }
  return "no error";
}

TEST(MakeTransport, ABackendNotLinkedIntoTheProgramIsNamedWithWhatToLink) {
  EXPECT_TRUE(transport::backend_available(Backend::tcp));
  EXPECT_FALSE(transport::backend_available(Backend::mpi));
  EXPECT_FALSE(transport::backend_available(Backend::nccl));
  TransportOptions options;
  options.backend = Backend::mpi;
  const std::string mpi = what_make_transport_says(options);
  options.backend = Backend::nccl;
  const std::string nccl = what_make_transport_says(options);
  if (PULSELOCO_HAS_MPI) {
    EXPECT_NE(mpi.find("backend mpi is not linked into this program: link "
                       "pulseloco::transport_mpi"),
              std::string::npos)
        << mpi;
  } else {
    EXPECT_NE(mpi.find("-DPULSELOCO_WITH_MPI=ON"), std::string::npos) << mpi;
  }
  if (PULSELOCO_HAS_NCCL) {
    EXPECT_NE(nccl.find("backend nccl is not linked into this program: link "
                        "pulseloco::transport_nccl"),
              std::string::npos)
        << nccl;
  } else {
    EXPECT_NE(nccl.find("-DPULSELOCO_WITH_NCCL=ON"), std::string::npos) << nccl;
  }
}

TEST(MakeTransport, UnderMpirunWithoutTheMpiBackendTheAutomaticRendezvousIsNotMpi) {
  ::setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  ASSERT_TRUE(launched_by_mpi());
  TransportOptions options;
  EXPECT_EQ(resolve_rendezvous(options), RendezvousMethod::automatic);  // a group of one
  options.master_addr = "127.0.0.1";
  EXPECT_EQ(resolve_rendezvous(options), RendezvousMethod::environment);
  options.rendezvous = RendezvousMethod::mpi;
  try {
    (void)mpi_rendezvous(options, 1234);
    FAIL() << "the MPI rendezvous needs the MPI backend";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("MPI rendezvous"), std::string::npos) << error.what();
  }
  ::unsetenv("OMPI_COMM_WORLD_RANK");
}

// One test (one process under ctest): the tag is process-wide.
TEST(LogRank, TheLogLinesNameTheRankOnceAGroupFormedUnlessTheProgramChoseATag) {
  std::ostringstream lines;
  logger().sinks().push_back(std::make_shared<spdlog::sinks::ostream_sink_mt>(lines));
  EXPECT_FALSE(log_rank().has_value());

  TransportOptions one;
  one.world_size = 1;
  (void)make_transport(one);
  EXPECT_EQ(log_rank(), 0);
  logger().info("after the group formed");
  EXPECT_NE(lines.str().find("[rank 0]"), std::string::npos) << lines.str();

  set_log_rank(7);
  (void)make_transport(one);
  EXPECT_EQ(log_rank(), 7);
  lines.str("");
  logger().info("the program's tag stays");
  EXPECT_NE(lines.str().find("[rank 7]"), std::string::npos) << lines.str();
  logger().sinks().pop_back();
}

}  // namespace
}  // namespace pulseloco::group
