// The window kernels on the CPU: pure functions over raw buffers for one chunk of one tensor.
//
// Semantics: docs/algorithm.md steps 1-9 (the gate, the residual commit, the aggregate, the
// Nesterov outer step and the reset). All arithmetic is fp32 with round-to-nearest-even; the only
// fused operations are the two std::fma of step 8. Every function here is deterministic: the
// same inputs give the same bits on every machine, with either CPU ISA, and on CUDA
// (kernels/cuda/window_kernels_cuda.h implements the same contract for device buffers). This
// holds for every input of gate() and commit_residual() (a non-finite s always fires and is
// reported); elsewhere the payload of a NaN result is not specified (x86 propagates an input's
// payload, GPUs return the canonical NaN), which a valid window never computes.
//
// Threading: each call handles one chunk on the calling thread. Callers parallelise across
// chunks (the engine does, with base/thread_pool.h); the chunk size bounds all temporary memory.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

#include <pulseloco/base/cpu_features.h>
#include <pulseloco/base/digest.h>
#include <pulseloco/base/tensor_view.h>

namespace pulseloco::kernels {

// Offsets inside a chunk are uint32, so a chunk holds at most 2^31 elements.
inline constexpr std::uint64_t kMaxChunkElements = std::uint64_t{1} << 31;

// Step 1 for bf16 local weights (docs/algorithm.md). With fp32 local weights both choices are
// the same arithmetic, Δ = θ_g − θ_l.
enum class Bf16Delta : std::uint8_t {
  // Δ = float(bf16(θ_g)) − float(θ_l): an element the local steps did not touch carries nothing,
  // and Δ is what a reader of θ_g in bf16 sees change.
  exact,
  // Δ = θ_g − float(θ_l), as the PULSE authors' code computes it: every element also carries its
  // cast residue θ_g − bf16(θ_g) into s each window; reproduces the authors' trajectories.
  authors,
};

[[nodiscard]] std::string_view bf16_delta_name(Bf16Delta delta) noexcept;
[[nodiscard]] Bf16Delta parse_bf16_delta(std::string_view name);  // throws InvalidArgument

// The state of one chunk as the gate and the residual commit read it.
struct GateChunk {
  const float* global = nullptr;  // θ_g, fp32
  const void* local = nullptr;    // θ_l, fp32 or bf16 (local_dtype)
  DType local_dtype = DType::float32;
  const float* residual = nullptr;          // e, fp32
  std::uint64_t count = 0;                  // elements; at most kMaxChunkElements
  Bf16Delta bf16_delta = Bf16Delta::exact;  // step 1 for bf16 local weights
};

struct GateResult {
  std::uint64_t fired = 0;  // entries written to the output
  // Lowest offset whose s = e + Δ is NaN or infinite. When set, the run has diverged: `fired`
  // is 0 and the output holds nothing valid. The caller reports tensor, index and rank.
  std::optional<std::uint64_t> non_finite_offset;
};

// Steps 1-5 for one chunk. Writes every fired element as (offset, s), offsets ascending, into
// `out_offsets` / `out_values` (each with room for `chunk.count` entries). Mutates no state.
[[nodiscard]] GateResult gate(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values,
                              CpuIsa isa = active_cpu_isa());

// Turns a gate result that reports a non-finite s into a NonFiniteError naming the tensor, the
// element index within the tensor (chunk_begin + offset) and the rank; returns otherwise.
void check_finite(const GateResult& result, std::string_view tensor, std::uint64_t chunk_begin,
                  std::optional<int> rank = std::nullopt);

// Step 5's state change, once the exchange has succeeded: e = fire ? 0 : s, where s and fire
// are recomputed exactly as gate() computed them (θ_l must not have been reset yet).
// `residual_out` may be chunk.residual (in place).
void commit_residual(const GateChunk& chunk, float* residual_out, CpuIsa isa = active_cpu_isa());

// One rank's entries for one chunk (offsets strictly ascending, each < chunk count).
struct SparseEntries {
  std::span<const std::uint32_t> offsets;
  std::span<const float> values;
};

// Step 7 for one chunk: g = +0 everywhere; for each rank in order, g[offset] += value; then
// g = g / R (a true division) with R = ranks_in_order.size(). `g` has `count` elements.
void aggregate(std::span<const SparseEntries> ranks_in_order, float* g, std::uint64_t count,
               CpuIsa isa = active_cpu_isa());

// Step 7's sum without the division, as sparse entries: for every element that some rank sent
// (ascending), +0 plus each rank's value in rank order, exactly the fp32 additions of
// aggregate(), whose result is these sums divided by R. An owner of a range of the model reduces
// the ranks' entries with it, so that every rank can aggregate its sums as one rank's entries
// (with R - 1 empty ones: +0 + sum is the sum, which is never -0) and obtain aggregate()'s bits.
// `sum` (`count` floats) and `seen` (`count` bytes, all 0, and left so) are scratch;
// out_offsets / out_values need room for the union. Returns how many entries it wrote.
[[nodiscard]] std::uint64_t sparse_sum(std::span<const SparseEntries> ranks_in_order,
                                       std::uint64_t count, float* sum, std::uint8_t* seen,
                                       std::uint32_t* out_offsets, float* out_values);

struct OuterStepParams {
  float lr = 0.7f;          // η
  float momentum = 0.9f;    // μ
  bool first_step = false;  // m = g on the first outer step, m = μ·m + g afterwards
};

// Steps 8 and 9 for one chunk: updates m and θ_g from g (PyTorch SGD Nesterov roundings),
// then writes θ_l = cast_local(θ_g).
void outer_step(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                std::uint64_t count, const OuterStepParams& params, CpuIsa isa = active_cpu_isa());

// The end of a window for one chunk in one pass: commit_residual, then outer_step (steps 5, 8
// and 9), with exactly their results, reading θ_g and θ_l once instead of twice.
struct WindowChunk {
  float* global = nullptr;    // θ_g, updated
  float* momentum = nullptr;  // m, updated (not read on the first outer step)
  float* residual = nullptr;  // e, committed
  void* local = nullptr;      // θ_l, read for the commit, then reset
  DType local_dtype = DType::float32;
  std::uint64_t count = 0;                  // at most kMaxChunkElements
  Bf16Delta bf16_delta = Bf16Delta::exact;  // step 1 for bf16 local weights
};
void commit_and_outer_step(const WindowChunk& chunk, const float* g, const OuterStepParams& params,
                           CpuIsa isa = active_cpu_isa());

// Step 9 alone: θ_l = cast_local(θ_g) (start-up, resume, DDP broadcast).
void reset_local(const float* global, void* local, DType local_dtype, std::uint64_t count,
                 CpuIsa isa = active_cpu_isa());

// Dense baselines (DiLoCo): Δ of step 1 for every element, as `bf16_delta` defines it for bf16
// local weights.
void pseudo_gradient(const float* global, const void* local, DType local_dtype,
                     Bf16Delta bf16_delta, float* delta, std::uint64_t count,
                     CpuIsa isa = active_cpu_isa());

// values[i] = values[i] / divisor, a true fp32 division (dense averages).
void divide(float* values, std::uint64_t count, float divisor, CpuIsa isa = active_cpu_isa());

// Step 10 for one tensor: combine_digests({buffer_digest of θ_g's bytes, of m's bytes}).
// `momentum` is empty before the first outer step. The CUDA build computes the same value from
// device buffers (kernels/cuda/window_kernels_cuda.h), so CPU and GPU replicas compare digests.
[[nodiscard]] Digest state_digest(std::span<const float> global, std::span<const float> momentum);

}  // namespace pulseloco::kernels
