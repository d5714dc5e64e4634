#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include <pulseloco/base/bf16.h>
#include "bench_inputs_cuda.h"

namespace pulseloco::bench {
namespace {

__device__ std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Uniform in [-1, 1) from element i and a stream number.
__device__ float uniform(std::uint64_t i, std::uint64_t stream) {
  const std::uint64_t bits = mix(i * 0x9E3779B97F4A7C15ull + stream * 0xD1B54A32D192ED03ull);
  return static_cast<float>(static_cast<std::int64_t>(bits >> 40) - (1 << 23)) * 0x1p-23f;
}

__device__ float normal(std::uint64_t i, std::uint64_t stream) {
  return (uniform(i, 4 * stream) + uniform(i, 4 * stream + 1) + uniform(i, 4 * stream + 2) +
          uniform(i, 4 * stream + 3)) *
         0.8660254f;
}

__global__ void fill_kernel(float* global, float* local_f32, std::uint16_t* local_bf16,
                            float* momentum, std::uint64_t count, std::uint64_t seed) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < count; i += stride) {
    const float theta = round_to_bf16(0.02f * normal(i, 0));
    const float direction = 0.08f * normal(i, 1 + 16 * seed);
    float value = theta;
    for (int step = 0; step < 8; ++step) {
      const float noise = uniform(i, 100 + 16 * seed + static_cast<std::uint64_t>(step));
      value = value - 3e-6f * (direction + 0.3f * 0.08f * noise + 0.1f * value);
    }
    global[i] = theta;
    local_f32[i] = value;
    local_bf16[i] = float_to_bf16_bits(value);
    momentum[i] = 1e-5f * normal(i, 2);
  }
}

}  // namespace

void fill_window_inputs(float* global, float* local_f32, std::uint16_t* local_bf16, float* momentum,
                        std::uint64_t count, std::uint64_t seed, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  fill_kernel<<<4096, 256, 0, s>>>(global, local_f32, local_bf16, momentum, count, seed);
  cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) status = cudaStreamSynchronize(s);
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("fill_window_inputs: ") + cudaGetErrorString(status));
}

}  // namespace pulseloco::bench
