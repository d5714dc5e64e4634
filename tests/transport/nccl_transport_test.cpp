// The NCCL transport. Needs a CUDA device; without one every test but the first skips.
// With one GPU NCCL allows a communicator of one rank (it cannot give one device two ranks), so
// the single-GPU tests send to the rank itself; the two-rank test needs two devices.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/group/make_transport.h>
#include "gpu/gpu_test_util.h"
#include "transport/device_buffer.h"
#include "transport/loopback_group.h"

namespace pulseloco::transport {
namespace {

using namespace std::chrono_literals;
using testing::DeviceBuffer;
constexpr auto kTimeout = 60s;

group::TransportOptions single_rank() {
  group::TransportOptions options;
  options.backend = Backend::nccl;
  options.world_size = 1;
  options.nccl_bootstrap = group::NcclBootstrap::tcp;
  return options;
}

TEST(NcclTransport, WithoutADeviceCreationFailsClearly) {
  if (kernels::cuda_device_count() > 0) GTEST_SKIP() << "a CUDA device is visible";
  try {
    (void)group::make_transport(single_rank());
    FAIL() << "an NCCL transport cannot exist without a GPU";
  } catch (const IoError& error) {
    EXPECT_NE(std::string(error.what()).find("no CUDA device"), std::string::npos) << error.what();
  }
}

TEST(NcclTransport, SendsToItselfMessagesOfEverySize) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  auto transport = group::make_transport(single_rank());
  EXPECT_EQ(transport->backend(), "nccl");
  EXPECT_TRUE(transport->buffer_device().is_cuda());
  std::uint64_t total = 0;
  for (const std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4093},
                                  std::size_t{1'000'003}, std::size_t{64} << 20}) {
    const auto message = testing::payload(bytes, bytes);
    DeviceBuffer out(bytes);
    DeviceBuffer in(bytes);
    out.upload(message);
    auto recv = transport->irecv(0, 1, in.span());
    auto send = transport->isend(0, 1, out.span());
    send->wait(deadline_after(kTimeout));
    recv->wait(deadline_after(kTimeout));
    EXPECT_EQ(in.download(), message) << bytes << " bytes";
    total += bytes;
  }
  const auto stats = transport->stats();
  EXPECT_EQ(stats.payload_bytes_sent, total);
  EXPECT_EQ(stats.payload_bytes_received, total);
  EXPECT_EQ(stats.messages_sent, 6U);
}

TEST(NcclTransport, StagesHostBuffersThroughTheDevice) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  auto transport = group::make_transport(single_rank());
  EXPECT_TRUE(transport->matches_by_order());
  for (const std::size_t bytes : {std::size_t{1}, std::size_t{4093}, std::size_t{3} << 20}) {
    const auto message = testing::payload(bytes + 1, bytes);
    // Host to host, then host to device and device to host.
    std::vector<std::byte> host_in(bytes);
    auto recv = transport->irecv(0, 1, host_in);
    auto send = transport->isend(0, 1, message);
    send->wait(deadline_after(kTimeout));
    recv->wait(deadline_after(kTimeout));
    EXPECT_EQ(host_in, message) << bytes << " bytes, host to host";
    DeviceBuffer device_in(bytes);
    std::vector<std::byte> back(bytes);
    auto to_device = transport->irecv(0, 2, device_in.span());
    auto from_host = transport->isend(0, 2, message);
    to_device->wait(deadline_after(kTimeout));
    from_host->wait(deadline_after(kTimeout));
    EXPECT_EQ(device_in.download(), message) << bytes << " bytes, host to device";
    auto to_host = transport->irecv(0, 3, back);
    auto from_device = transport->isend(0, 3, device_in.span());
    to_host->wait(deadline_after(kTimeout));
    from_device->wait(deadline_after(kTimeout));
    EXPECT_EQ(back, message) << bytes << " bytes, device to host";
  }
}

// With one rank a receive can only name the rank itself. NCCL versions differ on a receive from
// itself without a send in the same group: older ones leave it pending (the deadline ends the
// wait: TimeoutError), NCCL 2.28 reports it asynchronously as invalid usage, which fails the
// communicator (PeerLostError). Either way the wait ends with an error, and once the transport is
// aborted every operation fails.
TEST(NcclTransport, AnUnmatchedReceiveEndsWithAnErrorAndAbortEndsEveryOperation) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  auto transport = group::make_transport(single_rank());
  DeviceBuffer buffer(1024);
  auto recv = transport->irecv(0, 1, buffer.span());
  try {
    recv->wait(deadline_after(300ms));
    FAIL() << "a receive without a send must not complete";
  } catch (const TimeoutError&) {
  } catch (const PeerLostError& error) {
    EXPECT_EQ(error.kind(), ErrorKind::peer_lost) << error.what();
  }
  transport->abort("the test gave up");
  EXPECT_THROW((void)recv->test(), PeerLostError);
  EXPECT_THROW(transport->isend(0, 1, buffer.span())->wait(deadline_after(kTimeout)),
               PeerLostError);
}

TEST(NcclTransport, TwoRanksOnTwoDevicesExchange) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  if (kernels::cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  group::RendezvousServer server("127.0.0.1", 0, 2, transport::TcpOptions{},
                                 deadline_after(kTimeout));
  testing::run_parallel(2, [&](int rank) {
    auto options = testing::loopback_options(single_rank(), rank, 2, server.port());
    options.backend = Backend::nccl;
    options.nccl.cuda_device = rank;
    auto transport = group::make_transport(options);
    ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
    const std::size_t bytes = (std::size_t{16} << 20) + 3 + static_cast<std::size_t>(rank);
    const std::size_t theirs = (std::size_t{16} << 20) + 3 + static_cast<std::size_t>(1 - rank);
    DeviceBuffer out(bytes);
    DeviceBuffer in(theirs);
    out.upload(testing::payload(static_cast<std::uint64_t>(rank), bytes));
    auto recv = transport->irecv(1 - rank, 1, in.span());
    auto send = transport->isend(1 - rank, 1, out.span());
    send->wait(deadline_after(kTimeout));
    recv->wait(deadline_after(kTimeout));
    EXPECT_EQ(in.download(), testing::payload(static_cast<std::uint64_t>(1 - rank), theirs));
  });
}

}  // namespace
}  // namespace pulseloco::transport
