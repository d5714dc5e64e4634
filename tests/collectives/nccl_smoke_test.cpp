// The collectives over a one-rank NCCL transport, with the caller's buffers in device memory
// and in host memory, checked byte for byte. Needs a CUDA device (skips without one). NCCL
// cannot give two ranks of one communicator the same GPU, so more ranks need more GPUs: the
// multi-rank logic is proved over the order-matching double (ordered_transport_test.cpp).
#include <pulseloco/collectives/collectives.h>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include <pulseloco/group/make_transport.h>
#include <pulseloco/transport/native_collectives.h>
#include "gpu/gpu_test_util.h"
#include "rank_harness.h"
#include "transport/device_buffer.h"

namespace pulseloco::collectives {
namespace {

using pulseloco::testing::pattern_bytes;
using transport::testing::DeviceBuffer;

std::unique_ptr<transport::Transport> one_rank_nccl() {
  group::TransportOptions options;
  options.backend = transport::Backend::nccl;
  options.world_size = 1;
  options.nccl_bootstrap = group::NcclBootstrap::tcp;
  return group::make_transport(options);
}

const CollectiveOptions kOptions{.timeout = std::chrono::seconds(60)};

TEST(NcclSmoke, SparseAllGatherWithDeviceAndHostBuffers) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  auto nccl = one_rank_nccl();
  for (const std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{1'000'003}}) {
    const auto message = pattern_bytes(bytes, 0, 5);
    // Device: the message and the slot stay on the device; the callback sees the slot.
    DeviceBuffer mine(bytes);
    mine.upload(message);
    DeviceBuffer slot(bytes);
    int callbacks = 0;
    sparse_allgather_into(
        *nccl, mine.span(),
        [&](int rank, std::size_t size) {
          EXPECT_EQ(rank, 0);
          EXPECT_EQ(size, bytes);
          return slot.span();
        },
        kOptions,
        [&](int rank, std::span<const std::byte> received) {
          ++callbacks;
          EXPECT_EQ(rank, 0);
          EXPECT_EQ(received.data(), slot.span().data());
        });
    EXPECT_EQ(callbacks, 1);
    EXPECT_EQ(slot.download(), message) << bytes << " bytes in device memory";
    // Host.
    const auto gathered = sparse_allgather(*nccl, message, kOptions);
    ASSERT_EQ(gathered.size(), 1U);
    EXPECT_EQ(gathered[0], message) << bytes << " bytes in host memory";
  }
}

TEST(NcclSmoke, AllReduceWithDeviceAndHostBuffers) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  auto nccl = one_rank_nccl();
  for (const std::size_t count : {std::size_t{1}, std::size_t{1000}, (std::size_t{1} << 20) + 3}) {
    std::vector<float> input(count);
    for (std::size_t e = 0; e < count; ++e)
      input[e] = static_cast<float>(e) * 0.37F - 11.0F;
    const auto input_bytes = std::as_bytes(std::span(input));
    // Device.
    DeviceBuffer in(input_bytes.size());
    in.upload(input_bytes);
    DeviceBuffer out(input_bytes.size());
    const auto as_floats = [](DeviceBuffer& buffer) {
      return std::span(reinterpret_cast<float*>(buffer.span().data()),
                       buffer.span().size() / sizeof(float));
    };
    allreduce_sum(*nccl, as_floats(in), as_floats(out), kOptions);
    const auto summed = out.download();
    EXPECT_EQ(std::memcmp(summed.data(), input.data(), input_bytes.size()), 0)
        << count << " floats in device memory";
    // Host.
    std::vector<float> output(count, -1.0F);
    allreduce_sum(*nccl, input, output, kOptions);
    EXPECT_EQ(std::memcmp(output.data(), input.data(), input_bytes.size()), 0)
        << count << " floats in host memory";
  }
}

TEST(NcclSmoke, BroadcastBarrierAndAllGatherU64) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  auto nccl = one_rank_nccl();
  const auto bytes = pattern_bytes(300'001, 0, 9);
  DeviceBuffer device(bytes.size());
  device.upload(bytes);
  broadcast(*nccl, 0, device.span(), kOptions);
  EXPECT_EQ(device.download(), bytes);
  std::vector<std::byte> host = bytes;
  broadcast(*nccl, 0, host, kOptions);
  EXPECT_EQ(host, bytes);
  barrier(*nccl, kOptions);
  EXPECT_EQ(allgather_u64(*nccl, 42, kOptions), std::vector<std::uint64_t>{42});
  // Straight to the transport's native collectives too (the collectives skip them for one
  // rank where nothing moves).
  auto* native = transport::native_collectives(*nccl);
  ASSERT_NE(native, nullptr);
  native->broadcast(0, device.span(), transport::deadline_after(std::chrono::seconds(60)));
  native->barrier(transport::deadline_after(std::chrono::seconds(60)));
  EXPECT_EQ(device.download(), bytes);
}

}  // namespace
}  // namespace pulseloco::collectives
