// Internals of the CPU window kernels: the per-element arithmetic every path shares, and the
// two implementations (portable, AVX2) behind the dispatching functions of window_kernels.h.
//
// The per-element functions are the definition of the arithmetic: the portable loops are made
// of them, the AVX2 loops use them for their tails and must give the same bits for every lane.
// This file is compiled with -ffp-contract=off, so `a * b + c` is two roundings and the only
// fused operations are the explicit std::fma calls of step 8.
#pragma once

#include <cmath>
#include <cstdint>

#include <pulseloco/base/bf16.h>
#include <pulseloco/kernels/local_kind.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::kernels::detail {

[[nodiscard]] inline bool is_finite_value(float value) noexcept {
  return (float_to_bits(value) & 0x7F800000u) != 0x7F800000u;
}

// float(θ_l[i]) for either local dtype.
template <DType kLocal>
[[nodiscard]] inline float load_local(const void* local, std::uint64_t i) noexcept {
  if constexpr (kLocal == DType::float32) {
    return static_cast<const float*>(local)[i];
  } else {
    return bf16_bits_to_float(static_cast<const std::uint16_t*>(local)[i]);
  }
}

// θ_l[i] = cast_local(value).
template <DType kLocal>
inline void store_local(void* local, std::uint64_t i, float value) noexcept {
  if constexpr (kLocal == DType::float32) {
    static_cast<float*>(local)[i] = value;
  } else {
    static_cast<std::uint16_t*>(local)[i] = float_to_bf16_bits(value);
  }
}

struct GateLane {
  float s = 0.0f;
  bool fire = false;
};

// Steps 1-4 for one element.
template <DType kLocal, Bf16Delta kDelta>
[[nodiscard]] inline GateLane gate_lane(float global, float local, float residual) noexcept {
  const std::uint16_t global_bf16 = float_to_bf16_bits(global);
  const float seen_global =
      kDeltaThroughCast<kLocal, kDelta> ? bf16_bits_to_float(global_bf16) : global;
  const float delta = seen_global - local;                                      // step 1
  const float s = residual + delta;                                             // step 2
  const float corrected = global - s;                                           // step 3
  return {s, !bf16_numeric_equal(global_bf16, float_to_bf16_bits(corrected))};  // step 4
}

// Step 8 for one element: PyTorch SGD(nesterov=True) roundings.
inline void outer_lane(float& global, float& momentum, float g, float lr, float mu,
                       bool first_step) noexcept {
  const float m = first_step ? g : (mu * momentum) + g;  // two roundings
  const float d = std::fma(mu, m, g);                    // one rounding
  global = std::fma(-lr, d, global);                     // one rounding
  momentum = m;
}

// The implementations. Arguments are validated by the public functions before these run.
GateResult gate_portable(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values);
GateResult gate_avx2(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values);
// The AVX2 gate without its software prefetching: for the benchmark that measures what the
// prefetching gives (pulseloco_bench_kernels' gate/<dtype>/avx2/no_prefetch rows).
GateResult gate_avx2_without_prefetch(const GateChunk& chunk, std::uint32_t* out_offsets,
                                      float* out_values);

void commit_residual_portable(const GateChunk& chunk, float* residual_out);
void commit_residual_avx2(const GateChunk& chunk, float* residual_out);

void outer_step_portable(float* global, float* momentum, const float* g, void* local,
                         DType local_dtype, std::uint64_t count, const OuterStepParams& params);
void outer_step_avx2(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                     std::uint64_t count, const OuterStepParams& params);

void commit_and_outer_step_portable(const WindowChunk& chunk, const float* g,
                                    const OuterStepParams& params);
void commit_and_outer_step_avx2(const WindowChunk& chunk, const float* g,
                                const OuterStepParams& params);

void pseudo_gradient_portable(const float* global, const void* local, DType local_dtype,
                              Bf16Delta bf16_delta, float* delta, std::uint64_t count);
void pseudo_gradient_avx2(const float* global, const void* local, DType local_dtype,
                          Bf16Delta bf16_delta, float* delta, std::uint64_t count);

void divide_portable(float* values, std::uint64_t count, float divisor);
void divide_avx2(float* values, std::uint64_t count, float divisor);

}  // namespace pulseloco::kernels::detail
