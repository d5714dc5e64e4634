// Linking pulseloco_transport_mpi / _nccl is all a program does to get those backends: their
// registration objects are kept by the libraries' link options although nothing here refers to
// them.
#include <gtest/gtest.h>

#include <pulseloco/build_config.h>
#include <pulseloco/transport/backend_registry.h>

namespace pulseloco::transport {
namespace {

TEST(BackendRegistry, EveryBackendBuiltIsAvailableToAProgramThatLinksIt) {
  EXPECT_TRUE(backend_available(Backend::tcp));
  EXPECT_EQ(backend_available(Backend::mpi), PULSELOCO_HAS_MPI == 1);
  EXPECT_EQ(backend_available(Backend::nccl), PULSELOCO_HAS_NCCL == 1);
}

}  // namespace
}  // namespace pulseloco::transport
