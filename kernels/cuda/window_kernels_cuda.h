// The window kernels on CUDA: the contract of kernels/window_kernels.h for device buffers, with
// the same bits as the CPU kernels (tests/gpu/window_kernels_cuda_test.cu compares them).
//
// Include without CUDA headers: streams are passed as `void* stream` (a cudaStream_t; nullptr is
// the legacy default stream). Every pointer in the arguments (chunks, outputs, SparseEntries
// spans) is device memory of the current device; the std::span objects themselves live on the
// host and are only used for their sizes and addresses. Kernels are enqueued on `stream` and
// run asynchronously, except where a result must reach the host (gate's count, aggregate's
// validation, digests): those functions synchronise `stream` before returning.
//
// Arithmetic uses explicitly rounded intrinsics (__fadd_rn, __fsub_rn, __fmul_rn, __fdiv_rn,
// __fmaf_rn, the last only for the two fused steps of step 8) and base/bf16.h's rounding, so a
// GPU replica and a CPU replica produce identical bits. Nothing depends on scheduling: the gate
// compacts with a stable CUB DeviceSelect, the aggregate adds one rank per launch in rank order
// (offsets are unique within a rank), and the only atomic (atomicMin of the first non-finite
// offset) has an order-independent result.
//
// Every CUDA failure becomes a pulseloco::IoError naming the call and the CUDA error; invalid
// arguments are InvalidArgument, as on the CPU. Only built when PULSELOCO_HAS_CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include <pulseloco/base/digest.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::kernels::cuda {

// Scratch for the CUDA kernels on one device, to be used by one stream at a time: CUB temporary
// storage for the gate (grown on demand), device counters with their pinned host mirror, and
// the scratch of buffer digests (bounded, grown on demand). Created on the current device; every
// call that takes it must run with that device current.
class DeviceWorkspace {
 public:
  // Reserves CUB storage for chunks of up to `expected_chunk_elements` (more is allocated when a
  // larger chunk comes; reserving avoids a cudaMalloc in the first window).
  explicit DeviceWorkspace(std::uint64_t expected_chunk_elements = 0);
  ~DeviceWorkspace();
  DeviceWorkspace(DeviceWorkspace&&) noexcept;
  DeviceWorkspace& operator=(DeviceWorkspace&&) noexcept;
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;

  [[nodiscard]] int device() const noexcept;

  struct Impl;
  [[nodiscard]] Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Steps 1-5 for one chunk (see kernels::gate): writes the fired (offset, s) entries, offsets
// ascending, into device buffers with room for chunk.count entries, and returns the count (or
// the lowest non-finite offset, with fired = 0). Synchronises `stream`.
[[nodiscard]] GateResult gate(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values,
                              DeviceWorkspace& workspace, void* stream);

// e = fire ? 0 : s, recomputed as gate() computes them (see kernels::commit_residual).
void commit_residual(const GateChunk& chunk, float* residual_out, void* stream);

// Step 7 (see kernels::aggregate). Validates every rank's offsets on the device (strictly
// ascending, below `count`) and synchronises `stream` before writing `g`; throws
// InvalidArgument naming the rank (peer) and entry index when they are not.
void aggregate(std::span<const SparseEntries> ranks_in_order, float* g, std::uint64_t count,
               DeviceWorkspace& workspace, void* stream);

// Steps 8 and 9 (see kernels::outer_step).
void outer_step(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                std::uint64_t count, const OuterStepParams& params, void* stream);

// commit_residual then outer_step in one pass (see kernels::commit_and_outer_step).
void commit_and_outer_step(const WindowChunk& chunk, const float* g, const OuterStepParams& params,
                           void* stream);

// θ_l = cast_local(θ_g).
void reset_local(const float* global, void* local, DType local_dtype, std::uint64_t count,
                 void* stream);

// Δ of step 1 as `bf16_delta` defines it (see kernels::pseudo_gradient).
void pseudo_gradient(const float* global, const void* local, DType local_dtype,
                     Bf16Delta bf16_delta, float* delta, std::uint64_t count, void* stream);

// values[i] = values[i] / divisor (a true division).
void divide(float* values, std::uint64_t count, float divisor, void* stream);

// The lowest index of a non-finite value among `count` device floats (nullopt when all are
// finite), after the work already enqueued on `stream`. Synchronises `stream`.
[[nodiscard]] std::optional<std::uint64_t> first_non_finite(const float* values,
                                                            std::uint64_t count,
                                                            DeviceWorkspace& workspace,
                                                            void* stream);

// buffer_digest (base/digest.h) of `bytes` bytes of device memory: the same value as the CPU's
// for the same bytes. The pieces are hashed on the device; only their digests (8 bytes per
// 4 MiB) cross to the host, where they are combined. Synchronises `stream` (after the work
// already enqueued on it).
[[nodiscard]] Digest buffer_digest(const void* device_bytes, std::size_t bytes,
                                   DeviceWorkspace& workspace, void* stream);

// kernels::state_digest of device buffers: the same value as the CPU's for the same bytes.
[[nodiscard]] Digest state_digest(std::span<const float> global, std::span<const float> momentum,
                                  DeviceWorkspace& workspace, void* stream);

}  // namespace pulseloco::kernels::cuda
