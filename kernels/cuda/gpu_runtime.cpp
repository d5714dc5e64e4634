// CUDA build of kernels/gpu_runtime.h.
#include <pulseloco/kernels/gpu_runtime.h>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

namespace pulseloco::kernels {

int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device / no driver" error
    return 0;
  }
  return count;
}

std::string cuda_device_description(int ordinal) {
  cudaDeviceProp prop{};
  const cudaError_t status = cudaGetDeviceProperties(&prop, ordinal);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("no CUDA device {} ({})", ordinal, cudaGetErrorString(status));
  }
  return fmt::format("{} (sm_{}{}, {:.1f} GiB)", prop.name, prop.major, prop.minor,
                     static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
}

std::string cuda_runtime_version() {
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) return "unknown";
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

}  // namespace pulseloco::kernels
