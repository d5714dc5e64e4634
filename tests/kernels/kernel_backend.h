// One interface over the implementations of the window kernels, on host buffers, so that the
// same comparison (tests/kernels/backend_comparison.h) can run CPU portable vs CPU AVX2 here and
// CPU vs CUDA on a GPU machine (tests/gpu/cuda_backend.h uploads, runs, downloads).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::testing {

class KernelBackend {
 public:
  virtual ~KernelBackend() = default;
  [[nodiscard]] virtual std::string name() const = 0;

  // Every pointer is a host pointer; outputs are written back to host memory before returning.
  // gate() returns the entries in `offsets` / `values`, sized to the fired count.
  virtual kernels::GateResult gate(const kernels::GateChunk& chunk,
                                   std::vector<std::uint32_t>& offsets,
                                   std::vector<float>& values) = 0;
  virtual void commit_residual(const kernels::GateChunk& chunk, float* residual_out) = 0;
  virtual void aggregate(std::span<const kernels::SparseEntries> ranks_in_order, float* g,
                         std::uint64_t count) = 0;
  virtual void outer_step(float* global, float* momentum, const float* g, void* local,
                          DType local_dtype, std::uint64_t count,
                          const kernels::OuterStepParams& params) = 0;
  virtual void commit_and_outer_step(const kernels::WindowChunk& chunk, const float* g,
                                     const kernels::OuterStepParams& params) = 0;
  virtual void reset_local(const float* global, void* local, DType local_dtype,
                           std::uint64_t count) = 0;
  virtual void pseudo_gradient(const float* global, const void* local, DType local_dtype,
                               kernels::Bf16Delta bf16_delta, float* delta,
                               std::uint64_t count) = 0;
  virtual void divide(float* values, std::uint64_t count, float divisor) = 0;
  [[nodiscard]] virtual Digest state_digest(std::span<const float> global,
                                            std::span<const float> momentum) = 0;
};

// pulseloco's CPU kernels with a fixed ISA.
class CpuBackend final : public KernelBackend {
 public:
  explicit CpuBackend(CpuIsa isa) : isa_(isa) {}

  std::string name() const override { return "cpu-" + std::string(cpu_isa_name(isa_)); }

  kernels::GateResult gate(const kernels::GateChunk& chunk, std::vector<std::uint32_t>& offsets,
                           std::vector<float>& values) override {
    std::vector<std::uint32_t> all_offsets(chunk.count);
    std::vector<float> all_values(chunk.count);
    const kernels::GateResult result =
        kernels::gate(chunk, all_offsets.data(), all_values.data(), isa_);
    const auto fired = static_cast<std::ptrdiff_t>(result.fired);
    offsets.assign(all_offsets.begin(), all_offsets.begin() + fired);
    values.assign(all_values.begin(), all_values.begin() + fired);
    return result;
  }
  void commit_residual(const kernels::GateChunk& chunk, float* residual_out) override {
    kernels::commit_residual(chunk, residual_out, isa_);
  }
  void aggregate(std::span<const kernels::SparseEntries> ranks_in_order, float* g,
                 std::uint64_t count) override {
    kernels::aggregate(ranks_in_order, g, count, isa_);
  }
  void outer_step(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                  std::uint64_t count, const kernels::OuterStepParams& params) override {
    kernels::outer_step(global, momentum, g, local, local_dtype, count, params, isa_);
  }
  void commit_and_outer_step(const kernels::WindowChunk& chunk, const float* g,
                             const kernels::OuterStepParams& params) override {
    kernels::commit_and_outer_step(chunk, g, params, isa_);
  }
  void reset_local(const float* global, void* local, DType local_dtype,
                   std::uint64_t count) override {
    kernels::reset_local(global, local, local_dtype, count, isa_);
  }
  void pseudo_gradient(const float* global, const void* local, DType local_dtype,
                       kernels::Bf16Delta bf16_delta, float* delta, std::uint64_t count) override {
    kernels::pseudo_gradient(global, local, local_dtype, bf16_delta, delta, count, isa_);
  }
  void divide(float* values, std::uint64_t count, float divisor) override {
    kernels::divide(values, count, divisor, isa_);
  }
  Digest state_digest(std::span<const float> global, std::span<const float> momentum) override {
    return kernels::state_digest(global, momentum);
  }

 private:
  CpuIsa isa_;
};

}  // namespace pulseloco::testing
