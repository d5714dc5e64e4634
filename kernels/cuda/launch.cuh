// Internal: how the CUDA kernels are launched (grid-stride loops over enough blocks to fill the
// device) and how their CUDA errors become exceptions. Included by the .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <pulseloco/kernels/cuda/cuda_internal.h>

#define PULSELOCO_CUDA_CHECK(call) \
  ::pulseloco::kernels::cuda::detail::check(static_cast<int>(call), #call)

namespace pulseloco::kernels::cuda::detail {

inline constexpr int kThreads = 256;

__device__ __forceinline__ std::uint64_t first_index() {
  return static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ std::uint64_t grid_stride() {
  return static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
}

// Enough blocks to fill the device (grid-stride loops cover the rest).
inline unsigned blocks_for(std::uint64_t count) {
  int device = 0, multiprocessors = 0;
  PULSELOCO_CUDA_CHECK(cudaGetDevice(&device));
  PULSELOCO_CUDA_CHECK(
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  const std::uint64_t needed = (count + kThreads - 1) / kThreads;
  const std::uint64_t cap = static_cast<std::uint64_t>(std::max(multiprocessors, 1)) * 8;
  return static_cast<unsigned>(std::max<std::uint64_t>(1, std::min(needed, cap)));
}

template <typename Kernel, typename... Args>
void launch(const char* name, Kernel kernel, std::uint64_t count, cudaStream_t stream,
            Args... args) {
  if (count == 0) return;
  kernel<<<blocks_for(count), kThreads, 0, stream>>>(args...);
  check(static_cast<int>(cudaGetLastError()), name);
}

inline cudaStream_t as_stream(void* stream) {
  return static_cast<cudaStream_t>(stream);
}

}  // namespace pulseloco::kernels::cuda::detail
