// INTERIM, bench-only: straightforward scalar versions of the CPU window kernels the synthetic
// trace calls (kernels/window_kernels.h), used until the real kernels library provides them.
// This file is deleted when branch `kernels` is merged; see bench/CMakeLists.txt.
#include <cmath>

#include "base/bf16.h"
#include "kernels/window_kernels.h"

namespace pulseloco::kernels {
namespace {

struct GateValue {
  float s;
  bool fire;
};

GateValue gate_one(const GateChunk& chunk, std::uint64_t i) {
  const float global = chunk.global[i];
  const float local = chunk.local_dtype == DType::float32
                          ? static_cast<const float*>(chunk.local)[i]
                          : bf16_bits_to_float(static_cast<const std::uint16_t*>(chunk.local)[i]);
  const float cast_global =
      chunk.local_dtype == DType::float32 ? global : round_to_bf16(global);
  const float delta = cast_global - local;
  const float s = chunk.residual[i] + delta;
  const float corrected = global - s;
  const bool fire =
      !bf16_numeric_equal(float_to_bf16_bits(global), float_to_bf16_bits(corrected));
  return {s, fire};
}

}  // namespace

GateResult gate(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values, CpuIsa) {
  GateResult result;
  for (std::uint64_t i = 0; i < chunk.count; ++i) {
    const GateValue v = gate_one(chunk, i);
    if (!std::isfinite(v.s)) {
      result.fired = 0;
      result.non_finite_offset = i;
      return result;
    }
    if (v.fire) {
      out_offsets[result.fired] = static_cast<std::uint32_t>(i);
      out_values[result.fired] = v.s;
      ++result.fired;
    }
  }
  return result;
}

void commit_residual(const GateChunk& chunk, float* residual_out, CpuIsa) {
  for (std::uint64_t i = 0; i < chunk.count; ++i) {
    const GateValue v = gate_one(chunk, i);
    residual_out[i] = v.fire ? 0.0f : v.s;
  }
}

void aggregate(std::span<const SparseEntries> ranks_in_order, float* g, std::uint64_t count,
               CpuIsa) {
  for (std::uint64_t i = 0; i < count; ++i) g[i] = 0.0f;
  for (const SparseEntries& rank : ranks_in_order) {
    for (std::size_t k = 0; k < rank.offsets.size(); ++k) g[rank.offsets[k]] += rank.values[k];
  }
  const auto divisor = static_cast<float>(ranks_in_order.size());
  for (std::uint64_t i = 0; i < count; ++i) g[i] = g[i] / divisor;
}

void outer_step(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                std::uint64_t count, const OuterStepParams& params, CpuIsa) {
  for (std::uint64_t i = 0; i < count; ++i) {
    const float m = params.first_step ? g[i] : params.momentum * momentum[i] + g[i];
    momentum[i] = m;
    const float d = std::fma(params.momentum, m, g[i]);
    global[i] = std::fma(-params.lr, d, global[i]);
    if (local_dtype == DType::float32) {
      static_cast<float*>(local)[i] = global[i];
    } else {
      static_cast<std::uint16_t*>(local)[i] = float_to_bf16_bits(global[i]);
    }
  }
}

}  // namespace pulseloco::kernels
