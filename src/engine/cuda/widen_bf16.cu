// θ_g = float(θ_l) for bf16 θ_l on the device: exact (a bf16 is the high half of a float).
#include <cuda_runtime.h>

#include <pulseloco/engine/cuda/cuda_state_memory.h>
#include <pulseloco/kernels/cuda/cuda_internal.h>

namespace pulseloco::engine_detail {
namespace {

__global__ void widen_bf16_kernel(const std::uint16_t* local, float* global,
                                  unsigned long long count) {
  for (unsigned long long i =
           blockIdx.x * static_cast<unsigned long long>(blockDim.x) + threadIdx.x;
       i < count; i += static_cast<unsigned long long>(gridDim.x) * blockDim.x) {
    global[i] = __uint_as_float(static_cast<unsigned int>(local[i]) << 16);
  }
}

}  // namespace

void widen_bf16(const std::uint16_t* local, float* global, std::uint64_t count, void* stream) {
  if (count == 0) return;
  constexpr unsigned int kThreads = 256;
  const unsigned long long blocks = (count + kThreads - 1) / kThreads;
  const unsigned int grid = static_cast<unsigned int>(blocks < 65535ull ? blocks : 65535ull);
  widen_bf16_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(local, global, count);
  kernels::cuda::detail::check(cudaGetLastError(), "widen_bf16 launch");
}

}  // namespace pulseloco::engine_detail
