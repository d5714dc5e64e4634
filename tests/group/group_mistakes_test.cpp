// First-day mistakes in forming a group. A master port that another program holds (torchrun's
// store listens on MASTER_PORT): rank 0's rendezvous server cannot listen and rank 1 meets a
// listener that never answers; both errors name the port, the variable it came from and
// PULSELOCO_MASTER_PORT. A group without a secret whose every rank is on loopback forms without
// a warning about authentication (nothing beyond this host can reach it).
#include <gtest/gtest.h>

#include <spdlog/sinks/ostream_sink.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/unique_fd.h>
#include <pulseloco/group/rendezvous.h>
#include "transport/loopback_group.h"

namespace pulseloco::group {
namespace {

using namespace std::chrono_literals;

// A listening socket on 127.0.0.1 that accepts nothing (the kernel still completes connections
// into its backlog, as a busy foreign server would).
struct ForeignListener {
  UniqueFd fd{::socket(AF_INET, SOCK_STREAM, 0)};
  std::uint16_t port = 0;

  ForeignListener() {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof address;
    if (fd.get() < 0 ||
        ::bind(fd.get(), reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
        ::listen(fd.get(), 16) != 0 ||
        ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&address), &length) != 0)
      throw std::runtime_error("cannot listen on 127.0.0.1");
    port = ntohs(address.sin_port);
  }
};

TransportOptions options_for(int rank, std::uint16_t port) {
  TransportOptions options = transport::testing::loopback_options({}, rank, 2, port);
  options.external_rendezvous_server = false;
  options.connect_timeout = 1s;
  return options;
}

struct MasterPortFromEnvironment : ::testing::Test {
  ForeignListener foreign;
  void SetUp() override {
    ::setenv("MASTER_PORT", std::to_string(foreign.port).c_str(), 1);
    ::unsetenv("PULSELOCO_MASTER_PORT");
  }
  void TearDown() override { ::unsetenv("MASTER_PORT"); }
};

TEST_F(MasterPortFromEnvironment, RankZeroNamesThePortItsVariableAndPulselocoMasterPort) {
  try {
    (void)environment_rendezvous(options_for(0, foreign.port), 0);
    FAIL() << "rank 0 listened on a port another socket holds";
  } catch (const IoError& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("port " + std::to_string(foreign.port) + " comes from MASTER_PORT"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("PULSELOCO_MASTER_PORT"), std::string::npos) << what;
  }
}

TEST_F(MasterPortFromEnvironment, OtherRanksSayTheServerDidNotAnswerInsteadOfWaitingForRanks) {
  try {
    (void)environment_rendezvous(options_for(1, foreign.port), 0);
    FAIL() << "rank 1 formed a group with a listener that never answers";
  } catch (const TimeoutError& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("did not answer the handshake"), std::string::npos) << what;
    EXPECT_NE(what.find("comes from MASTER_PORT"), std::string::npos) << what;
    EXPECT_NE(what.find("PULSELOCO_MASTER_PORT"), std::string::npos) << what;
  }
}

TEST(LoopbackGroup, WithoutASecretFormsWithoutAWarningAboutAuthentication) {
  std::ostringstream lines;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(lines);
  sink->set_level(spdlog::level::warn);
  logger().sinks().push_back(sink);
  TransportOptions base;
  base.connect_timeout = 30s;
  const auto group = transport::testing::make_loopback_group(2, base);
  logger().sinks().pop_back();
  ASSERT_EQ(group.size(), 2U);
  EXPECT_EQ(lines.str().find("not authenticated"), std::string::npos) << lines.str();
}

}  // namespace
}  // namespace pulseloco::group
