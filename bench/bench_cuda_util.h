// Internal: device buffers and CUDA status checks shared by the CUDA benchmarks.
#pragma once

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cstddef>
#include <stdexcept>

namespace pulseloco::bench {

inline void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(status)));
}

// cudaMalloc'd memory (or pinned host memory with cudaMallocHost), freed on destruction.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t bytes, bool pinned_host = false) : pinned_host_(pinned_host) {
    check(pinned_host ? cudaMallocHost(&data, bytes) : cudaMalloc(&data, bytes),
          pinned_host ? "cudaMallocHost" : "cudaMalloc");
  }
  ~DeviceBuffer() {
    if (pinned_host_) {
      cudaFreeHost(data);
    } else {
      cudaFree(data);
    }
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  void* data = nullptr;

 private:
  bool pinned_host_ = false;
};

}  // namespace pulseloco::bench
