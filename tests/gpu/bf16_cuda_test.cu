// The device-side bf16 conversion must give the host's bits for every fp32 bit pattern.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include <pulseloco/base/bf16.h>
#include "gpu/gpu_test_util.h"

namespace pulseloco {
namespace {

__global__ void convert_range(std::uint32_t base, std::uint32_t count, std::uint16_t* out) {
  const std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) out[i] = float_to_bf16_bits(bits_to_float(base + i));
}

__global__ void widen_all(float* out) {
  const std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= 0xFFFFu) out[i] = bf16_bits_to_float(static_cast<std::uint16_t>(i));
}

TEST(GpuBf16, EveryFp32PatternMatchesTheHost) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  constexpr std::uint32_t kChunk = 1u << 26;
  std::uint16_t* device_out = nullptr;
  PULSELOCO_CUDA_ASSERT(cudaMalloc(&device_out, kChunk * sizeof(std::uint16_t)));
  std::vector<std::uint16_t> host_out(kChunk);
  std::uint64_t mismatches = 0;
  for (std::uint64_t base = 0; base < (std::uint64_t{1} << 32); base += kChunk) {
    convert_range<<<kChunk / 256, 256>>>(static_cast<std::uint32_t>(base), kChunk, device_out);
    PULSELOCO_CUDA_ASSERT(cudaGetLastError());
    PULSELOCO_CUDA_ASSERT(cudaMemcpy(host_out.data(), device_out, kChunk * sizeof(std::uint16_t),
                                     cudaMemcpyDeviceToHost));
    for (std::uint32_t i = 0; i < kChunk; ++i) {
      const auto input = static_cast<std::uint32_t>(base + i);
      if (host_out[i] != float_to_bf16_bits(bits_to_float(input))) {
        if (mismatches++ == 0) ADD_FAILURE() << "first mismatch at input 0x" << std::hex << input;
      }
    }
  }
  PULSELOCO_CUDA_ASSERT(cudaFree(device_out));
  EXPECT_EQ(mismatches, 0u);
}

TEST(GpuBf16, WideningMatchesTheHost) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  float* device_out = nullptr;
  PULSELOCO_CUDA_ASSERT(cudaMalloc(&device_out, 65536 * sizeof(float)));
  widen_all<<<256, 256>>>(device_out);
  PULSELOCO_CUDA_ASSERT(cudaGetLastError());
  std::vector<float> host(65536);
  PULSELOCO_CUDA_ASSERT(
      cudaMemcpy(host.data(), device_out, host.size() * sizeof(float), cudaMemcpyDeviceToHost));
  PULSELOCO_CUDA_ASSERT(cudaFree(device_out));
  for (std::uint32_t i = 0; i <= 0xFFFFu; ++i) {
    ASSERT_EQ(float_to_bits(host[i]), i << 16) << i;
  }
}

}  // namespace
}  // namespace pulseloco
