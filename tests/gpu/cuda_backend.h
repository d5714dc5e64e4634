// The CUDA window kernels behind the KernelBackend interface (tests/kernels/kernel_backend.h):
// every call uploads its inputs to device buffers, runs the kernel on the backend's own
// (non-default) stream and downloads the outputs. Needs a CUDA device.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <pulseloco/kernels/cuda/window_kernels_cuda.h>
#include "kernels/kernel_backend.h"

namespace pulseloco::testing {

inline void cuda_or_throw(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// An owned device allocation of `bytes` bytes.
class DeviceBytes {
 public:
  DeviceBytes() = default;
  explicit DeviceBytes(std::size_t bytes) : bytes_(bytes) {
    if (bytes > 0) cuda_or_throw(cudaMalloc(&data_, bytes), "cudaMalloc");
  }
  ~DeviceBytes() { cudaFree(data_); }
  DeviceBytes(DeviceBytes&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceBytes& operator=(DeviceBytes&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;

  // A device copy of `bytes` host bytes.
  static DeviceBytes from_host(const void* host, std::size_t bytes, cudaStream_t stream) {
    DeviceBytes out(bytes);
    if (bytes > 0)
      cuda_or_throw(cudaMemcpyAsync(out.data_, host, bytes, cudaMemcpyHostToDevice, stream),
                    "cudaMemcpyAsync H2D");
    return out;
  }
  void to_host(void* host, std::size_t bytes, cudaStream_t stream) const {
    if (bytes > 0)
      cuda_or_throw(cudaMemcpyAsync(host, data_, bytes, cudaMemcpyDeviceToHost, stream),
                    "cudaMemcpyAsync D2H");
    cuda_or_throw(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

  template <typename T = void>
  [[nodiscard]] T* get() const {
    return static_cast<T*>(data_);
  }
  [[nodiscard]] std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// A stream of its own, so that nothing relies on the legacy default stream's implicit syncs.
class CudaStream {
 public:
  CudaStream() {
    cuda_or_throw(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~CudaStream() { cudaStreamDestroy(stream_); }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  [[nodiscard]] cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

class CudaBackend final : public KernelBackend {
 public:
  CudaBackend() : workspace_(1u << 16) {}

  std::string name() const override { return "cuda"; }
  [[nodiscard]] cudaStream_t stream() const { return stream_.get(); }
  [[nodiscard]] kernels::cuda::DeviceWorkspace& workspace() { return workspace_; }

  kernels::GateResult gate(const kernels::GateChunk& chunk, std::vector<std::uint32_t>& offsets,
                           std::vector<float>& values) override {
    const std::size_t local_size = dtype_size(chunk.local_dtype);
    const DeviceBytes global = upload(chunk.global, chunk.count * 4);
    const DeviceBytes local = upload(chunk.local, chunk.count * local_size);
    const DeviceBytes residual = upload(chunk.residual, chunk.count * 4);
    const DeviceBytes out_offsets(chunk.count * 4), out_values(chunk.count * 4);
    const kernels::GateResult result = kernels::cuda::gate(
        kernels::GateChunk{.global = global.get<float>(),
                           .local = local.get(),
                           .local_dtype = chunk.local_dtype,
                           .residual = residual.get<float>(),
                           .count = chunk.count,
                           .bf16_delta = chunk.bf16_delta},
        out_offsets.get<std::uint32_t>(), out_values.get<float>(), workspace_, stream());
    offsets.assign(result.fired, 0);
    values.assign(result.fired, 0.0f);
    out_offsets.to_host(offsets.data(), result.fired * 4, stream());
    out_values.to_host(values.data(), result.fired * 4, stream());
    return result;
  }

  void commit_residual(const kernels::GateChunk& chunk, float* residual_out) override {
    const std::size_t local_size = dtype_size(chunk.local_dtype);
    const DeviceBytes global = upload(chunk.global, chunk.count * 4);
    const DeviceBytes local = upload(chunk.local, chunk.count * local_size);
    const DeviceBytes residual = upload(chunk.residual, chunk.count * 4);
    // In place on the device when the caller commits in place.
    DeviceBytes separate_out;
    if (residual_out != chunk.residual) separate_out = DeviceBytes(chunk.count * 4);
    const DeviceBytes& out = residual_out == chunk.residual ? residual : separate_out;
    kernels::cuda::commit_residual(kernels::GateChunk{.global = global.get<float>(),
                                                      .local = local.get(),
                                                      .local_dtype = chunk.local_dtype,
                                                      .residual = residual.get<float>(),
                                                      .count = chunk.count,
                                                      .bf16_delta = chunk.bf16_delta},
                                   out.get<float>(), stream());
    out.to_host(residual_out, chunk.count * 4, stream());
  }

  void aggregate(std::span<const kernels::SparseEntries> ranks_in_order, float* g,
                 std::uint64_t count) override {
    std::vector<DeviceBytes> buffers;
    std::vector<kernels::SparseEntries> device_ranks;
    for (const kernels::SparseEntries& entries : ranks_in_order) {
      buffers.push_back(upload(entries.offsets.data(), entries.offsets.size_bytes()));
      const std::uint32_t* offsets = buffers.back().get<std::uint32_t>();
      buffers.push_back(upload(entries.values.data(), entries.values.size_bytes()));
      const float* values = buffers.back().get<float>();
      device_ranks.push_back({{offsets, entries.offsets.size()}, {values, entries.values.size()}});
    }
    const DeviceBytes device_g = upload(g, count * 4);  // so that a rejected call can be checked
    kernels::cuda::aggregate(device_ranks, device_g.get<float>(), count, workspace_, stream());
    device_g.to_host(g, count * 4, stream());
  }

  void outer_step(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                  std::uint64_t count, const kernels::OuterStepParams& params) override {
    const DeviceBytes d_global = upload(global, count * 4);
    const DeviceBytes d_momentum = upload(momentum, count * 4);
    const DeviceBytes d_g = upload(g, count * 4);
    const DeviceBytes d_local = upload(local, count * dtype_size(local_dtype));
    kernels::cuda::outer_step(d_global.get<float>(), d_momentum.get<float>(), d_g.get<float>(),
                              d_local.get(), local_dtype, count, params, stream());
    d_global.to_host(global, count * 4, stream());
    d_momentum.to_host(momentum, count * 4, stream());
    d_local.to_host(local, count * dtype_size(local_dtype), stream());
  }

  void commit_and_outer_step(const kernels::WindowChunk& chunk, const float* g,
                             const kernels::OuterStepParams& params) override {
    const std::size_t local_bytes = chunk.count * dtype_size(chunk.local_dtype);
    const DeviceBytes d_global = upload(chunk.global, chunk.count * 4);
    const DeviceBytes d_momentum = upload(chunk.momentum, chunk.count * 4);
    const DeviceBytes d_residual = upload(chunk.residual, chunk.count * 4);
    const DeviceBytes d_local = upload(chunk.local, local_bytes);
    const DeviceBytes d_g = upload(g, chunk.count * 4);
    kernels::cuda::commit_and_outer_step(kernels::WindowChunk{.global = d_global.get<float>(),
                                                              .momentum = d_momentum.get<float>(),
                                                              .residual = d_residual.get<float>(),
                                                              .local = d_local.get(),
                                                              .local_dtype = chunk.local_dtype,
                                                              .count = chunk.count,
                                                              .bf16_delta = chunk.bf16_delta},
                                         d_g.get<float>(), params, stream());
    d_global.to_host(chunk.global, chunk.count * 4, stream());
    d_momentum.to_host(chunk.momentum, chunk.count * 4, stream());
    d_residual.to_host(chunk.residual, chunk.count * 4, stream());
    d_local.to_host(chunk.local, local_bytes, stream());
  }

  void reset_local(const float* global, void* local, DType local_dtype,
                   std::uint64_t count) override {
    const DeviceBytes d_global = upload(global, count * 4);
    const DeviceBytes d_local(count * dtype_size(local_dtype));
    kernels::cuda::reset_local(d_global.get<float>(), d_local.get(), local_dtype, count, stream());
    d_local.to_host(local, count * dtype_size(local_dtype), stream());
  }

  void pseudo_gradient(const float* global, const void* local, DType local_dtype,
                       kernels::Bf16Delta bf16_delta, float* delta, std::uint64_t count) override {
    const DeviceBytes d_global = upload(global, count * 4);
    const DeviceBytes d_local = upload(local, count * dtype_size(local_dtype));
    const DeviceBytes d_delta(count * 4);
    kernels::cuda::pseudo_gradient(d_global.get<float>(), d_local.get(), local_dtype, bf16_delta,
                                   d_delta.get<float>(), count, stream());
    d_delta.to_host(delta, count * 4, stream());
  }

  void divide(float* values, std::uint64_t count, float divisor) override {
    const DeviceBytes d_values = upload(values, count * 4);
    kernels::cuda::divide(d_values.get<float>(), count, divisor, stream());
    d_values.to_host(values, count * 4, stream());
  }

  Digest state_digest(std::span<const float> global, std::span<const float> momentum) override {
    const DeviceBytes d_global = upload(global.data(), global.size_bytes());
    const DeviceBytes d_momentum = upload(momentum.data(), momentum.size_bytes());
    return kernels::cuda::state_digest({d_global.get<float>(), global.size()},
                                       {d_momentum.get<float>(), momentum.size()}, workspace_,
                                       stream());
  }

 private:
  DeviceBytes upload(const void* host, std::size_t bytes) {
    return DeviceBytes::from_host(host, bytes, stream());
  }

  CudaStream stream_;
  kernels::cuda::DeviceWorkspace workspace_;
};

}  // namespace pulseloco::testing
