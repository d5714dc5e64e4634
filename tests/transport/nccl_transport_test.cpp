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
#include "transport/loopback_group.h"

namespace pulseloco::transport {
namespace {

using namespace std::chrono_literals;
constexpr auto kTimeout = 60s;

// A device buffer that frees itself.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0 && cudaMalloc(&data_, bytes_) != cudaSuccess)
      throw std::runtime_error("cudaMalloc failed");
  }
  ~DeviceBuffer() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  std::span<std::byte> span() { return {static_cast<std::byte*>(data_), bytes_}; }
  void upload(const std::vector<std::byte>& host) {
    if (bytes_ > 0) {
      ASSERT_EQ(cudaMemcpy(data_, host.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  std::vector<std::byte> download() const {
    std::vector<std::byte> host(bytes_);
    if (bytes_ > 0) {
      EXPECT_EQ(cudaMemcpy(host.data(), data_, bytes_, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return host;
  }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

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

TEST(NcclTransport, RefusesHostBuffers) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  auto transport = group::make_transport(single_rank());
  std::vector<std::byte> host(64);
  EXPECT_THROW((void)transport->isend(0, 1, host), InvalidArgument);
}

TEST(NcclTransport, AReceiveThatNeverMatchesTimesOutAndAbortEndsIt) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  auto transport = group::make_transport(single_rank());
  DeviceBuffer buffer(1024);
  auto recv = transport->irecv(0, 1, buffer.span());
  EXPECT_THROW(recv->wait(deadline_after(300ms)), TimeoutError);
  transport->abort("the test gave up");
  try {
    (void)recv->test();
    FAIL() << "an aborted receive must fail";
  } catch (const PeerLostError& error) {
    EXPECT_NE(std::string(error.what()).find("aborted: the test gave up"), std::string::npos);
  }
  EXPECT_THROW(transport->isend(0, 1, buffer.span())->wait(deadline_after(kTimeout)),
               PeerLostError);
}

TEST(NcclTransport, TwoRanksOnTwoDevicesExchange) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  if (kernels::cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  group::RendezvousServer server("127.0.0.1", 0, 2, "", deadline_after(kTimeout));
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
