// Internal: how the CPU and CUDA kernels pick their per-element code for a chunk: the local
// dtype and, for bf16 local weights, the definition of Δ (Bf16Delta), both as template arguments
// so that every loop is compiled for exactly one of them.
#pragma once

#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::kernels::detail {

// Whether step 1 sees θ_g through the local cast, Δ = float(bf16(θ_g)) − float(θ_l): bf16 local
// weights with Bf16Delta::exact. Otherwise Δ = θ_g − float(θ_l).
template <DType kLocal, Bf16Delta kDelta>
inline constexpr bool kDeltaThroughCast = kLocal == DType::bfloat16&& kDelta == Bf16Delta::exact;

// Returns run.template operator()<kLocal, kDelta>() for the chunk's local dtype and Δ choice.
// fp32 local weights have one arithmetic for both choices and take Bf16Delta::exact's code.
template <typename Run>
decltype(auto) with_local_kind(DType local_dtype, Bf16Delta bf16_delta, Run&& run) {
  if (local_dtype == DType::float32)
    return run.template operator()<DType::float32, Bf16Delta::exact>();
  if (bf16_delta == Bf16Delta::authors)
    return run.template operator()<DType::bfloat16, Bf16Delta::authors>();
  return run.template operator()<DType::bfloat16, Bf16Delta::exact>();
}

}  // namespace pulseloco::kernels::detail
