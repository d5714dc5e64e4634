// Test helper: a copy of a test model's tensors (engine/engine_test_util.h) in CUDA device memory,
// for engines whose state lives on the device. Local training stays on the host: the test
// uploads θ_l before a window and downloads the engine's reset θ_l after it.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>
#include <vector>

#include <pulseloco/engine/engine.h>
#include "engine/engine_test_util.h"

namespace pulseloco::testing {

inline void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

class DeviceModel {
 public:
  explicit DeviceModel(const LocalModel& model, int device = 0) : device_(device) {
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    for (const LocalTensor& tensor : model) {
      void* buffer = nullptr;
      cuda_check(cudaMalloc(&buffer, bytes_of(tensor) == 0 ? 1 : bytes_of(tensor)), "cudaMalloc");
      buffers_.push_back(buffer);
    }
    upload(model);
  }
  ~DeviceModel() {
    for (void* buffer : buffers_)
      cudaFree(buffer);
  }
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  void upload(const LocalModel& model) {
    for (std::size_t t = 0; t < model.size(); ++t) {
      cuda_check(
          cudaMemcpy(buffers_[t], host_data(model[t]), bytes_of(model[t]), cudaMemcpyHostToDevice),
          "cudaMemcpy (upload)");
    }
  }
  // Waits for the legacy default stream, which the engine's window is ordered before.
  void download(LocalModel& model) const {
    for (std::size_t t = 0; t < model.size(); ++t) {
      cuda_check(cudaMemcpy(const_cast<void*>(host_data(model[t])), buffers_[t], bytes_of(model[t]),
                            cudaMemcpyDeviceToHost),
                 "cudaMemcpy (download)");
    }
  }
  [[nodiscard]] std::vector<NamedTensor> views(const LocalModel& model) const {
    std::vector<NamedTensor> views;
    for (std::size_t t = 0; t < model.size(); ++t) {
      views.push_back({model[t].name,
                       TensorView{buffers_[t], model[t].numel(), model[t].dtype,
                                  Device{DeviceKind::cuda, device_}},
                       {}});
    }
    return views;
  }

 private:
  static std::size_t bytes_of(const LocalTensor& tensor) {
    return tensor.numel() * dtype_size(tensor.dtype);
  }
  static const void* host_data(const LocalTensor& tensor) {
    return tensor.dtype == DType::float32 ? static_cast<const void*>(tensor.f32.data())
                                          : static_cast<const void*>(tensor.bf16.data());
  }

  int device_;
  std::vector<void*> buffers_;
};

// One rank of a test group whose state lives on the device or in host memory: the same calls
// for both, so a test runs a group of either or a mixed one.
class TestRank {
 public:
  TestRank(LocalModel model, bool on_device) : model_(std::move(model)) {
    if (on_device) device_ = std::make_unique<DeviceModel>(model_);
  }
  [[nodiscard]] std::vector<NamedTensor> views() {
    return device_ ? device_->views(model_) : views_of(model_);
  }
  // Local training on the host, then θ_l where the engine reads it.
  void train(float lr, int steps, std::uint32_t seed) {
    local_training(model_, lr, steps, seed);
    if (device_) device_->upload(model_);
  }
  // θ_l back from where the engine reset it.
  void after_window() {
    if (device_) device_->download(model_);
  }
  [[nodiscard]] LocalModel& model() { return model_; }

 private:
  LocalModel model_;
  std::unique_ptr<DeviceModel> device_;
};

}  // namespace pulseloco::testing
