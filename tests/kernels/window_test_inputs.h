// Deterministic inputs for the window-kernel tests and benchmarks: global weights like an LLM's
// (std 0.02), local weights moved by AdamW-like inner steps, and edge cases (±0, subnormals,
// huge and tiny magnitudes, values exactly at bf16 rounding ties) placed among them.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/tensor_view.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::testing {

// SplitMix64: fast, good enough for test data, identical on every platform.
class FastRandom {
 public:
  explicit FastRandom(std::uint64_t seed) : state_(seed) {}

  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float uniform() {
    return static_cast<float>(static_cast<std::int64_t>(next() >> 40) - (1 << 23)) * 0x1p-23f;
  }
  // Approximately standard normal (Irwin-Hall sum of four uniforms, variance 1).
  float normal() { return (uniform() + uniform() + uniform() + uniform()) * 0.8660254f; }

 private:
  std::uint64_t state_;
};

// θ_l of one rank in its dtype.
class LocalWeights {
 public:
  LocalWeights(DType dtype, std::size_t count)
      : dtype_(dtype),
        f32_(dtype == DType::float32 ? count : 0),
        bf16_(dtype == DType::bfloat16 ? count : 0),
        count_(count) {}

  [[nodiscard]] DType dtype() const { return dtype_; }
  [[nodiscard]] std::size_t size() const { return count_; }
  [[nodiscard]] void* data() {
    return dtype_ == DType::float32 ? static_cast<void*>(f32_.data())
                                    : static_cast<void*>(bf16_.data());
  }
  [[nodiscard]] const void* data() const {
    return dtype_ == DType::float32 ? static_cast<const void*>(f32_.data())
                                    : static_cast<const void*>(bf16_.data());
  }
  [[nodiscard]] std::size_t bytes() const { return count_ * dtype_size(dtype_); }
  [[nodiscard]] float get(std::size_t i) const {
    return dtype_ == DType::float32 ? f32_[i] : bf16_bits_to_float(bf16_[i]);
  }
  // θ_l[i] = cast_local(value).
  void set(std::size_t i, float value) {
    if (dtype_ == DType::float32) {
      f32_[i] = value;
    } else {
      bf16_[i] = float_to_bf16_bits(value);
    }
  }
  friend bool operator==(const LocalWeights&, const LocalWeights&) = default;

 private:
  DType dtype_;
  std::vector<float> f32_;
  std::vector<std::uint16_t> bf16_;
  std::size_t count_;
};

// Global weights ~ N(0, 0.02); on the bf16 grid when `on_bf16_grid` (a model whose master
// weights came from a bf16 checkpoint), otherwise general fp32 values.
inline std::vector<float> make_global_weights(std::size_t count, std::uint64_t seed,
                                              bool on_bf16_grid = false) {
  FastRandom random(seed);
  std::vector<float> global(count);
  for (float& value : global) {
    value = 0.02f * random.normal();
    if (on_bf16_grid) value = round_to_bf16(value);
  }
  return global;
}

// θ_l = cast_local(θ_g), element by element with the scalar bf16 routine.
inline void cast_global_into(const std::vector<float>& global, LocalWeights& local) {
  for (std::size_t i = 0; i < global.size(); ++i)
    local.set(i, global[i]);
}

// `steps` AdamW-like inner steps at learning rate `lr`: each element moves by lr times a
// direction that is consistent across steps (Adam's m̂/√v̂, of size `direction_scale` in the
// mean: near 1 for a steady gradient sign, well below 1 for noisy gradients) plus noise, and
// decays by lr * 0.1 (weight decay). bf16 local weights round after every step, as a bf16
// model's would.
inline void apply_inner_steps(LocalWeights& local, float lr, int steps, std::uint64_t seed,
                              float direction_scale = 1.0f) {
  FastRandom random(seed);
  for (std::size_t i = 0; i < local.size(); ++i) {
    const float direction = direction_scale * random.normal();
    std::uint64_t noise_bits = random.next();  // 8 bits of noise per step, 8 steps per draw
    float value = local.get(i);
    for (int step = 0; step < steps; ++step) {
      if (step % 8 == 7) noise_bits = random.next();
      const float noise = static_cast<float>(static_cast<int>(noise_bits & 0xFF) - 128) * 0x1p-7f;
      noise_bits >>= 8;
      const float update = direction + 0.3f * direction_scale * noise + 0.1f * value;
      value = value - lr * update;
      if (local.dtype() == DType::bfloat16) value = round_to_bf16(value);
    }
    local.set(i, value);
  }
}

// Number of edge cases inject_edge_cases() cycles through.
inline constexpr int kEdgeCaseKinds = 12;

// Places edge cases among the elements (about one in eleven): sets θ_g, and each rank's θ_l and
// e, so that s, w̃ and the bf16 comparison meet the situation named in each case. Everything
// stays finite. Call after the inner steps of the first window.
inline void inject_edge_cases(std::vector<float>& global, std::vector<LocalWeights>& locals,
                              std::vector<std::vector<float>>& residuals) {
  for (std::size_t i = 0; i < global.size(); ++i) {
    if ((i * 7 + 3) % 11 != 0) continue;
    const int kind = static_cast<int>((i / 11) % kEdgeCaseKinds);
    for (std::size_t r = 0; r < locals.size(); ++r) {
      LocalWeights& local = locals[r];
      float& e = residuals[r][i];
      const bool bf16_local = local.dtype() == DType::bfloat16;
      const auto rank_scale = static_cast<float>(r + 1);
      switch (kind) {
        case 0:  // +0 everywhere: s = +0, never fires
          global[i] = 0.0f;
          local.set(i, 0.0f);
          e = 0.0f;
          break;
        case 1:  // θ_g = -0 and a tiny local move: w̃ is tiny but nonzero, fires
          global[i] = -0.0f;
          local.set(i, 1e-30f * rank_scale);
          e = -0.0f;
          break;
        case 2:  // subnormals in θ_g, θ_l and e
          global[i] = 1e-40f;
          local.set(i, 3e-41f * rank_scale);
          e = 1.4e-45f;
          break;
        case 3:  // huge magnitudes, a small relative move
          global[i] = 1.0e36f;
          local.set(i, 1.0e36f * (1.0f - 0x1p-10f * rank_scale));
          e = 0.0f;
          break;
        case 4:  // huge negative magnitudes, a large relative move
          global[i] = -3.0e35f;
          local.set(i, -3.0e35f * (1.0f + 0x1p-6f * rank_scale));
          e = 1.0e30f;
          break;
        case 5:  // tiny normal magnitudes
          global[i] = 1e-35f;
          local.set(i, 1.5e-35f * rank_scale);
          e = -2e-36f;
          break;
        case 6:    // w̃ exactly at a bf16 tie, rounding down to bf16(θ_g) (even): no fire
        case 7: {  // w̃ exactly at a bf16 tie, rounding up (odd): fires
          const std::uint32_t parity = kind == 6 ? 0u : 1u;
          const std::uint32_t base = ((0x3C49u & ~1u) | parity) << 16;  // near 0.0123
          const std::uint32_t low = (0x1234u * static_cast<std::uint32_t>(r + 1)) & 0x7FFFu;
          const float g = bits_to_float(base | low);  // below the tie: bf16(g) = base
          const float tie = bits_to_float(base | 0x8000u);
          global[i] = g;
          // s = g - tie exactly (Sterbenz), so w̃ = g - s = tie exactly.
          if (bf16_local) {
            local.set(i, g);  // bf16(g): Δ = 0, the residual carries s
            e = g - tie;
          } else {
            local.set(i, tie);
            e = 0.0f;
          }
          break;
        }
        case 8: {  // θ_g itself exactly at a bf16 tie
          const std::uint32_t bits = (0xBD23u << 16) | 0x8000u;
          global[i] = bits_to_float(bits);
          local.set(i, bits_to_float(bits) + 1e-6f * rank_scale);
          e = 0.0f;
          break;
        }
        case 9: {  // the residual cancels Δ exactly: s = +0, no fire
          global[i] = 0.25f;
          local.set(i, 0.25f - 0.001f * rank_scale);
          const float cast_global = bf16_local ? round_to_bf16(global[i]) : global[i];
          e = -(cast_global - local.get(i));
          break;
        }
        case 10:  // a large old residual pushes an unchanged weight over the bf16 gap
          global[i] = -0.03125f;
          local.set(i, -0.03125f);
          e = 0.01f * rank_scale;
          break;
        case 11:  // opposite moves on different ranks
          global[i] = 0.5f;
          local.set(i, r % 2 == 0 ? 0.5f + 0.01f : 0.5f - 0.01f);
          e = 0.0f;
          break;
        default:
          break;
      }
    }
  }
}

// Arbitrary bit patterns (NaN, infinities, subnormals, ±0, a bf16 tie) mixed with realistic
// values; with `finite_only`, NaN and infinities are replaced by 1.5.
inline std::vector<float> arbitrary_values(std::size_t n, std::uint64_t seed, bool finite_only) {
  FastRandom random(seed);
  std::vector<float> out(n);
  for (float& value : out) {
    const std::uint64_t pick = random.next() % 8;
    if (pick < 4) {
      value = 0.02f * random.normal();
    } else if (pick < 6) {
      value = bits_to_float(static_cast<std::uint32_t>(random.next()));
    } else if (pick == 6) {
      const float specials[] = {0.0f,
                                -0.0f,
                                1e-45f,
                                -1e-40f,
                                3.3e38f,
                                bits_to_float(0x3F808000u),  // a bf16 tie
                                std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::quiet_NaN()};
      value = specials[random.next() % 8];
    } else {
      value = round_to_bf16(0.02f * random.normal());
    }
    if (finite_only && !std::isfinite(value)) value = 1.5f;
  }
  return out;
}

// What the kernels' per-element code depends on: the local dtype and, for bf16, the Δ choice.
struct LocalKind {
  DType dtype = DType::float32;
  kernels::Bf16Delta bf16_delta = kernels::Bf16Delta::exact;
};

// fp32 (one arithmetic for both Δ choices), bf16 with Δ exact, bf16 with Δ as the authors'.
inline std::vector<LocalKind> local_kinds() {
  return {{DType::float32, kernels::Bf16Delta::exact},
          {DType::bfloat16, kernels::Bf16Delta::exact},
          {DType::bfloat16, kernels::Bf16Delta::authors}};
}

// "float32", "bfloat16_exact", "bfloat16_authors" (readable test names).
inline std::string local_kind_name(const LocalKind& kind) {
  std::string name(dtype_name(kind.dtype));
  if (kind.dtype == DType::bfloat16)
    name += "_" + std::string(kernels::bf16_delta_name(kind.bf16_delta));
  return name;
}

}  // namespace pulseloco::testing
