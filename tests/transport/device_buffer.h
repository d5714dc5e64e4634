// A buffer in CUDA device memory for tests: upload, download, frees itself.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <span>
#include <stdexcept>
#include <vector>

namespace pulseloco::transport::testing {

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

  [[nodiscard]] std::span<std::byte> span() { return {static_cast<std::byte*>(data_), bytes_}; }
  void upload(std::span<const std::byte> host) {
    ASSERT_EQ(host.size(), bytes_);
    if (bytes_ > 0) {
      ASSERT_EQ(cudaMemcpy(data_, host.data(), bytes_, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  [[nodiscard]] std::vector<std::byte> download() const {
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

}  // namespace pulseloco::transport::testing
