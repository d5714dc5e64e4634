// The CPU window kernels: argument checks, ISA dispatch and the portable implementations.
// The AVX2 implementations are in window_kernels_avx2.cpp; both give identical bits.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/kernels/argument_checks.h>
#include <pulseloco/kernels/cpu/window_kernels_internal.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::kernels {
namespace detail {
namespace {

template <DType kLocal, Bf16Delta kDelta>
GateResult gate_portable_typed(const GateChunk& chunk, std::uint32_t* out_offsets,
                               float* out_values) {
  std::uint64_t fired = 0;
  for (std::uint64_t i = 0; i < chunk.count; ++i) {
    const GateLane lane = gate_lane<kLocal, kDelta>(
        chunk.global[i], load_local<kLocal>(chunk.local, i), chunk.residual[i]);
    if (!is_finite_value(lane.s)) return GateResult{.fired = 0, .non_finite_offset = i};
    // Branch-free compaction: always write, advance only when fired (fired <= i < count).
    out_offsets[fired] = static_cast<std::uint32_t>(i);
    out_values[fired] = lane.s;
    fired += lane.fire ? 1 : 0;
  }
  return GateResult{.fired = fired, .non_finite_offset = std::nullopt};
}

template <DType kLocal, Bf16Delta kDelta>
void commit_residual_portable_typed(const GateChunk& chunk, float* residual_out) {
  for (std::uint64_t i = 0; i < chunk.count; ++i) {
    const GateLane lane = gate_lane<kLocal, kDelta>(
        chunk.global[i], load_local<kLocal>(chunk.local, i), chunk.residual[i]);
    residual_out[i] = lane.fire ? 0.0f : lane.s;
  }
}

template <DType kLocal>
void outer_step_portable_typed(float* global, float* momentum, const float* g, void* local,
                               std::uint64_t count, const OuterStepParams& params) {
  for (std::uint64_t i = 0; i < count; ++i) {
    outer_lane(global[i], momentum[i], g[i], params.lr, params.momentum, params.first_step);
    store_local<kLocal>(local, i, global[i]);
  }
}

template <DType kLocal, Bf16Delta kDelta>
void commit_and_outer_step_portable_typed(const WindowChunk& chunk, const float* g,
                                          const OuterStepParams& params) {
  for (std::uint64_t i = 0; i < chunk.count; ++i) {
    const GateLane lane = gate_lane<kLocal, kDelta>(
        chunk.global[i], load_local<kLocal>(chunk.local, i), chunk.residual[i]);
    chunk.residual[i] = lane.fire ? 0.0f : lane.s;
    outer_lane(chunk.global[i], chunk.momentum[i], g[i], params.lr, params.momentum,
               params.first_step);
    store_local<kLocal>(chunk.local, i, chunk.global[i]);
  }
}

template <DType kLocal, Bf16Delta kDelta>
void pseudo_gradient_portable_typed(const float* global, const void* local, float* delta,
                                    std::uint64_t count) {
  for (std::uint64_t i = 0; i < count; ++i) {
    const float seen_global =
        kDeltaThroughCast<kLocal, kDelta> ? round_to_bf16(global[i]) : global[i];
    delta[i] = seen_global - load_local<kLocal>(local, i);
  }
}

}  // namespace

GateResult gate_portable(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values) {
  return with_local_kind(chunk.local_dtype, chunk.bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    return gate_portable_typed<kL, kD>(chunk, out_offsets, out_values);
  });
}

void commit_residual_portable(const GateChunk& chunk, float* residual_out) {
  with_local_kind(chunk.local_dtype, chunk.bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    commit_residual_portable_typed<kL, kD>(chunk, residual_out);
  });
}

void outer_step_portable(float* global, float* momentum, const float* g, void* local,
                         DType local_dtype, std::uint64_t count, const OuterStepParams& params) {
  if (local_dtype == DType::float32) {
    outer_step_portable_typed<DType::float32>(global, momentum, g, local, count, params);
  } else {
    outer_step_portable_typed<DType::bfloat16>(global, momentum, g, local, count, params);
  }
}

void commit_and_outer_step_portable(const WindowChunk& chunk, const float* g,
                                    const OuterStepParams& params) {
  with_local_kind(chunk.local_dtype, chunk.bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    commit_and_outer_step_portable_typed<kL, kD>(chunk, g, params);
  });
}

void pseudo_gradient_portable(const float* global, const void* local, DType local_dtype,
                              Bf16Delta bf16_delta, float* delta, std::uint64_t count) {
  with_local_kind(local_dtype, bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    pseudo_gradient_portable_typed<kL, kD>(global, local, delta, count);
  });
}

void divide_portable(float* values, std::uint64_t count, float divisor) {
  for (std::uint64_t i = 0; i < count; ++i)
    values[i] = values[i] / divisor;
}

}  // namespace detail

namespace {

// IEEE arithmetic for the duration of a kernel, whatever the caller's floating-point mode: the
// host process (a training framework, torch.set_flush_denormal) may have set flush-to-zero,
// denormals-are-zero or another rounding mode in MXCSR, which would change our bits and break
// agreement with other replicas. Restores the caller's mode on exit.
class IeeeFloatMode {
 public:
#if defined(__x86_64__)
  IeeeFloatMode() : saved_(_mm_getcsr()) {
    constexpr unsigned kFlushToZero = 1u << 15, kDenormalsAreZero = 1u << 6;
    constexpr unsigned kRoundingControl = 3u << 13;  // 00 = round to nearest even
    const unsigned ieee = saved_ & ~(kFlushToZero | kDenormalsAreZero | kRoundingControl);
    if (ieee != saved_) _mm_setcsr(ieee);
  }
  ~IeeeFloatMode() {
    // Keep the exception flags raised meanwhile; restore the modes.
    constexpr unsigned kFlags = 0x3Fu;
    const unsigned now = _mm_getcsr();
    if ((now & ~kFlags) != (saved_ & ~kFlags)) _mm_setcsr((saved_ & ~kFlags) | (now & kFlags));
  }

 private:
  unsigned saved_;
#else
  IeeeFloatMode() = default;  // other targets: IEEE unless the caller changed the FP environment
#endif
 public:
  IeeeFloatMode(const IeeeFloatMode&) = delete;
  IeeeFloatMode& operator=(const IeeeFloatMode&) = delete;
};

using detail::check_count;
using detail::check_dtype;
using detail::check_gate_chunk;
using detail::check_outer_params;
using detail::check_pointer;

bool use_avx2(CpuIsa isa, std::string_view kernel) {
  if (isa == CpuIsa::portable) return false;
  if (isa == CpuIsa::avx2) {
    if (!cpu_has_avx2()) {
      throw InvalidArgument(
          fmt::format("{}: CpuIsa::avx2 was requested but this CPU lacks AVX2/FMA", kernel));
    }
    return true;
  }
  throw InvalidArgument(fmt::format("{}: unknown CpuIsa {}", kernel, static_cast<int>(isa)));
}

}  // namespace

GateResult gate(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values, CpuIsa isa) {
  check_gate_chunk(chunk, "gate");
  check_pointer(out_offsets, chunk.count, "gate", "offset output");
  check_pointer(out_values, chunk.count, "gate", "value output");
  const IeeeFloatMode ieee_mode;
  return use_avx2(isa, "gate") ? detail::gate_avx2(chunk, out_offsets, out_values)
                               : detail::gate_portable(chunk, out_offsets, out_values);
}

void check_finite(const GateResult& result, std::string_view tensor, std::uint64_t chunk_begin,
                  std::optional<int> rank) {
  if (!result.non_finite_offset) return;
  throw NonFiniteError(
      "the pseudo-gradient s = e + Δ is NaN or infinite: the run has diverged; nothing was sent "
      "and the state is unchanged",
      ErrorContext{.rank = rank,
                   .tensor = std::string(tensor),
                   .index = chunk_begin + *result.non_finite_offset});
}

void commit_residual(const GateChunk& chunk, float* residual_out, CpuIsa isa) {
  check_gate_chunk(chunk, "commit_residual");
  check_pointer(residual_out, chunk.count, "commit_residual", "residual output");
  const IeeeFloatMode ieee_mode;
  if (use_avx2(isa, "commit_residual")) {
    detail::commit_residual_avx2(chunk, residual_out);
  } else {
    detail::commit_residual_portable(chunk, residual_out);
  }
}

void aggregate(std::span<const SparseEntries> ranks_in_order, float* g, std::uint64_t count,
               CpuIsa isa) {
  check_count(count, "aggregate");
  check_pointer(g, count, "aggregate", "output");
  const bool avx2 = use_avx2(isa, "aggregate");
  detail::check_ranks_shape(ranks_in_order, "aggregate");
  // Validate every rank's offsets before writing anything.
  detail::check_ranks_offsets(ranks_in_order, count, "aggregate");
  const IeeeFloatMode ieee_mode;
  std::fill_n(g, count, 0.0f);  // +0
  for (const SparseEntries& entries : ranks_in_order) {
    const std::uint32_t* offsets = entries.offsets.data();
    const float* values = entries.values.data();
    for (std::size_t k = 0; k < entries.offsets.size(); ++k)
      g[offsets[k]] = g[offsets[k]] + values[k];
  }
  const auto ranks = static_cast<float>(ranks_in_order.size());
  if (avx2) {
    detail::divide_avx2(g, count, ranks);
  } else {
    detail::divide_portable(g, count, ranks);
  }
}

std::uint64_t sparse_sum(std::span<const SparseEntries> ranks_in_order, std::uint64_t count,
                         float* sum, std::uint8_t* seen, std::uint32_t* out_offsets,
                         float* out_values) {
  check_count(count, "sparse_sum");
  check_pointer(sum, count, "sparse_sum", "sum scratch");
  check_pointer(seen, count, "sparse_sum", "seen scratch");
  detail::check_ranks_shape(ranks_in_order, "sparse_sum");
  detail::check_ranks_offsets(ranks_in_order, count, "sparse_sum");
  const IeeeFloatMode ieee_mode;
  std::uint64_t lowest = count;
  std::uint64_t highest = 0;
  for (const SparseEntries& entries : ranks_in_order) {
    const std::uint32_t* offsets = entries.offsets.data();
    const float* values = entries.values.data();
    for (std::size_t k = 0; k < entries.offsets.size(); ++k) {
      const std::uint32_t o = offsets[k];
      // aggregate() starts every element at +0.
      const float before = seen[o] != 0 ? sum[o] : 0.0f;
      sum[o] = before + values[k];
      seen[o] = 1;
    }
    if (!entries.offsets.empty()) {
      lowest = std::min<std::uint64_t>(lowest, entries.offsets.front());
      highest = std::max<std::uint64_t>(highest, entries.offsets.back());
    }
  }
  std::uint64_t written = 0;
  for (std::uint64_t i = lowest; i <= highest && i < count; ++i) {
    if (seen[i] == 0) continue;
    seen[i] = 0;
    out_offsets[written] = static_cast<std::uint32_t>(i);
    out_values[written] = sum[i];
    ++written;
  }
  return written;
}

void outer_step(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                std::uint64_t count, const OuterStepParams& params, CpuIsa isa) {
  check_count(count, "outer_step");
  check_dtype(local_dtype, "outer_step");
  check_outer_params(params, "outer_step");
  check_pointer(global, count, "outer_step", "global weights");
  check_pointer(momentum, count, "outer_step", "momentum");
  check_pointer(g, count, "outer_step", "aggregate");
  check_pointer(local, count, "outer_step", "local weights");
  const IeeeFloatMode ieee_mode;
  if (use_avx2(isa, "outer_step")) {
    detail::outer_step_avx2(global, momentum, g, local, local_dtype, count, params);
  } else {
    detail::outer_step_portable(global, momentum, g, local, local_dtype, count, params);
  }
}

void commit_and_outer_step(const WindowChunk& chunk, const float* g, const OuterStepParams& params,
                           CpuIsa isa) {
  constexpr std::string_view kName = "commit_and_outer_step";
  detail::check_window_chunk(chunk, kName);
  check_outer_params(params, kName);
  check_pointer(g, chunk.count, kName, "aggregate");
  const IeeeFloatMode ieee_mode;
  if (use_avx2(isa, kName)) {
    detail::commit_and_outer_step_avx2(chunk, g, params);
  } else {
    detail::commit_and_outer_step_portable(chunk, g, params);
  }
}

void reset_local(const float* global, void* local, DType local_dtype, std::uint64_t count,
                 CpuIsa isa) {
  check_count(count, "reset_local");
  check_dtype(local_dtype, "reset_local");
  check_pointer(global, count, "reset_local", "global weights");
  check_pointer(local, count, "reset_local", "local weights");
  const bool avx2 = use_avx2(isa, "reset_local");
  if (local_dtype == DType::float32) {
    if (count > 0 && static_cast<const void*>(global) != local)
      std::memmove(local, global, count * sizeof(float));
  } else if (avx2) {
    bf16_impl::float_to_bf16_avx2(global, static_cast<std::uint16_t*>(local), count);
  } else {
    bf16_impl::float_to_bf16_portable(global, static_cast<std::uint16_t*>(local), count);
  }
}

void pseudo_gradient(const float* global, const void* local, DType local_dtype,
                     Bf16Delta bf16_delta, float* delta, std::uint64_t count, CpuIsa isa) {
  check_count(count, "pseudo_gradient");
  check_dtype(local_dtype, "pseudo_gradient");
  detail::check_bf16_delta(bf16_delta, "pseudo_gradient");
  check_pointer(global, count, "pseudo_gradient", "global weights");
  check_pointer(local, count, "pseudo_gradient", "local weights");
  check_pointer(delta, count, "pseudo_gradient", "output");
  const IeeeFloatMode ieee_mode;
  if (use_avx2(isa, "pseudo_gradient")) {
    detail::pseudo_gradient_avx2(global, local, local_dtype, bf16_delta, delta, count);
  } else {
    detail::pseudo_gradient_portable(global, local, local_dtype, bf16_delta, delta, count);
  }
}

void divide(float* values, std::uint64_t count, float divisor, CpuIsa isa) {
  check_count(count, "divide");
  check_pointer(values, count, "divide", "values");
  const IeeeFloatMode ieee_mode;
  if (use_avx2(isa, "divide")) {
    detail::divide_avx2(values, count, divisor);
  } else {
    detail::divide_portable(values, count, divisor);
  }
}

Digest state_digest(std::span<const float> global, std::span<const float> momentum) {
  const Digest parts[2] = {buffer_digest(std::as_bytes(global)),
                           buffer_digest(std::as_bytes(momentum))};
  return combine_digests(parts);
}

}  // namespace pulseloco::kernels
