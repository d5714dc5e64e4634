// AVX2 implementations of the CPU window kernels, eight fp32 lanes at a time.
//
// Every function carries target("avx2,fma") itself, so the library needs no global -mavx2 and
// runs on any x86-64 CPU (window_kernels_cpu.cpp calls these only when the CPU has AVX2+FMA).
// Each lane computes exactly what the scalar functions of window_kernels_internal.h compute:
// separate IEEE add/sub/mul/div, _mm256_fmadd_ps only for the two fused steps of step 8, and
// bf16 rounding with the integer round-to-nearest-even of base/bf16.h, canonical NaN included.
// The tails (count not a multiple of 8) run those scalar functions.
#include <array>
#include <bit>
#include <cstdint>

#include <pulseloco/kernels/cpu/window_kernels_internal.h>

#if defined(__x86_64__)
#include <immintrin.h>

#define PULSELOCO_AVX2 __attribute__((target("avx2,fma")))
#define PULSELOCO_AVX2_INLINE __attribute__((target("avx2,fma"), always_inline)) inline

namespace pulseloco::kernels::detail {
namespace {

// kLeftPack[mask] lists, in order, the lanes whose bit is set in `mask`, then zeros: the
// permutation that packs the fired lanes of a vector to its front.
constexpr std::array<std::uint64_t, 256> make_left_pack_table() {
  std::array<std::uint64_t, 256> table{};
  for (unsigned mask = 0; mask < 256; ++mask) {
    std::uint64_t packed = 0;
    unsigned slot = 0;
    for (unsigned lane = 0; lane < 8; ++lane) {
      if ((mask >> lane) & 1u) packed |= std::uint64_t{lane} << (8 * slot++);
    }
    table[mask] = packed;
  }
  return table;
}
alignas(64) constexpr std::array<std::uint64_t, 256> kLeftPack = make_left_pack_table();

PULSELOCO_AVX2_INLINE __m256i left_pack_permutation(int mask) {
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(kLeftPack[mask])));
}

// The fp32 value of bf16(x) in every lane for every non-NaN x (round to nearest even; values
// past the largest bf16 round to infinity).
PULSELOCO_AVX2_INLINE __m256 round_to_bf16_non_nan_ps(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(bits, bias),
                                              _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The fp32 value of bf16(x) in every lane, NaN included (-> canonical 0x7FC0), as base/bf16.h.
PULSELOCO_AVX2_INLINE __m256 round_to_bf16_ps(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  // Signed compare is safe: both sides are non-negative once the sign is masked off.
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF)),
                                            _mm256_set1_epi32(0x7F800000));
  const __m256i canonical_nan = _mm256_set1_epi32(static_cast<int>(kBf16CanonicalNaN) << 16);
  return _mm256_castsi256_ps(
      _mm256_blendv_epi8(_mm256_castps_si256(round_to_bf16_non_nan_ps(x)), canonical_nan, is_nan));
}

// Eight bf16 values (as the fp32 values of round_to_bf16_ps) -> eight packed bf16 bit patterns.
PULSELOCO_AVX2_INLINE __m128i pack_bf16(__m256 rounded) {
  const __m256i high_halves = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(high_halves),
                          _mm256_extracti128_si256(high_halves, 1));
}

template <DType kLocal>
PULSELOCO_AVX2_INLINE __m256 load_local_ps(const void* local, std::uint64_t i) {
  if constexpr (kLocal == DType::float32) {
    return _mm256_loadu_ps(static_cast<const float*>(local) + i);
  } else {
    const __m128i bf16 = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(local) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16), 16));
  }
}

// θ_l[i..i+8) = cast_local(value); `value` is already bf16-rounded when kLocal is bfloat16.
template <DType kLocal>
PULSELOCO_AVX2_INLINE void store_local_ps(void* local, std::uint64_t i, __m256 value) {
  if constexpr (kLocal == DType::float32) {
    _mm256_storeu_ps(static_cast<float*>(local) + i, value);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(local) + i),
                     pack_bf16(value));
  }
}

struct GateLanes {
  __m256 s;
  __m256 fire;  // all ones where the lane fires
};

// Steps 1-4 for eight elements (see gate_lane).
template <DType kLocal, Bf16Delta kDelta>
PULSELOCO_AVX2_INLINE GateLanes gate_lanes(__m256 global, __m256 local, __m256 residual) {
  const __m256 global_bf16 = round_to_bf16_ps(global);
  const __m256 seen_global = kDeltaThroughCast<kLocal, kDelta> ? global_bf16 : global;
  const __m256 delta = _mm256_sub_ps(seen_global, local);
  const __m256 s = _mm256_add_ps(residual, delta);
  const __m256 corrected = _mm256_sub_ps(global, s);
  // Unordered not-equal: +0 equals -0, a NaN equals nothing (as bf16_numeric_equal).
  return {s, _mm256_cmp_ps(global_bf16, round_to_bf16_ps(corrected), _CMP_NEQ_UQ)};
}

PULSELOCO_AVX2_INLINE int non_finite_mask(__m256 values) {
  const __m256i exponent = _mm256_set1_epi32(0x7F800000);
  const __m256i bits = _mm256_and_si256(_mm256_castps_si256(values), exponent);
  return _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, exponent)));
}

// The gate's lanes, cheaper than gate_lanes because the gate stops at the first non-finite s:
// `bad` flags lanes whose s or θ_g is NaN or infinite. A non-finite θ_g always makes the
// scalar s non-finite (its cast is NaN or infinite), and for finite θ_g and s no NaN reaches a
// rounding, so NaN canonicalisation can be skipped: lanes not flagged equal gate_lanes'.
template <DType kLocal, Bf16Delta kDelta>
PULSELOCO_AVX2_INLINE GateLanes gate_lanes_unless_non_finite(__m256 global, __m256 local,
                                                             __m256 residual, int& bad) {
  const __m256 global_bf16 = round_to_bf16_non_nan_ps(global);
  const __m256 seen_global = kDeltaThroughCast<kLocal, kDelta> ? global_bf16 : global;
  const __m256 s = _mm256_add_ps(residual, _mm256_sub_ps(seen_global, local));
  const __m256 corrected = _mm256_sub_ps(global, s);
  // x - x is NaN exactly when x is NaN or infinite.
  const __m256 poison = _mm256_add_ps(_mm256_sub_ps(s, s), _mm256_sub_ps(global, global));
  bad = _mm256_movemask_ps(_mm256_cmp_ps(poison, poison, _CMP_UNORD_Q));
  return {s, _mm256_cmp_ps(global_bf16, round_to_bf16_non_nan_ps(corrected), _CMP_NEQ_UQ)};
}

struct OuterLanes {
  __m256 global;
  __m256 momentum;
};

// Step 8 for eight elements (see outer_lane).
PULSELOCO_AVX2_INLINE OuterLanes outer_lanes(__m256 global, __m256 momentum, __m256 g,
                                             __m256 neg_lr, __m256 mu, bool first_step) {
  const __m256 m = first_step ? g : _mm256_add_ps(_mm256_mul_ps(mu, momentum), g);
  const __m256 d = _mm256_fmadd_ps(mu, m, g);
  return {_mm256_fmadd_ps(neg_lr, d, global), m};
}

// How far ahead of its loads the gate (and the residual commit, which recomputes it)
// prefetches, in elements: 32 KiB of an fp32 stream. The gate reads three streams, writes
// almost nothing and does enough arithmetic per element that the hardware prefetchers alone
// leave it short of the memory's read rate out of cache; pulseloco_bench_kernels'
// gate/<dtype>/avx2 and gate/<dtype>/avx2/no_prefetch rows measure the difference
// (docs/benchmarks.md, "Window kernels"). The outer step and the fused commit + outer step,
// which write as many streams as they read, gain nothing from prefetching and do not prefetch.
constexpr std::uint64_t kPrefetchElements = 8192;

// Prefetches element i + kPrefetchElements of `stream` (elements of kElementBytes) into L1,
// once per cache line of the stream (the loops advance 8 elements at a time); stays inside the
// chunk's `count` elements.
template <std::size_t kElementBytes>
PULSELOCO_AVX2_INLINE void prefetch_ahead(const void* stream, std::uint64_t i,
                                          std::uint64_t count) {
  constexpr std::uint64_t kElementsPerLine = 64 / kElementBytes;
  if (i % kElementsPerLine != 0 || i + kPrefetchElements >= count) return;
  _mm_prefetch(static_cast<const char*>(stream) + (i + kPrefetchElements) * kElementBytes,
               _MM_HINT_T0);
}

template <DType kLocal>
PULSELOCO_AVX2_INLINE void prefetch_local_ahead(const void* local, std::uint64_t i,
                                                std::uint64_t count) {
  prefetch_ahead<kLocal == DType::float32 ? 4 : 2>(local, i, count);
}

template <DType kLocal, Bf16Delta kDelta, bool kPrefetch = true>
PULSELOCO_AVX2 GateResult gate_avx2_typed(const GateChunk& chunk, std::uint32_t* out_offsets,
                                          float* out_values) {
  // Local copies: the intrinsics' stores may alias anything, including `chunk`.
  const float* const global = chunk.global;
  const void* const local = chunk.local;
  const float* const residual = chunk.residual;
  const std::uint64_t count = chunk.count;
  std::uint64_t fired = 0;
  std::uint64_t i = 0;
  __m256i lane_offsets = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i eight = _mm256_set1_epi32(8);
  for (; i + 8 <= count; i += 8) {
    if constexpr (kPrefetch) {
      prefetch_ahead<4>(global, i, count);
      prefetch_local_ahead<kLocal>(local, i, count);
      prefetch_ahead<4>(residual, i, count);
    }
    int bad = 0;
    const GateLanes lanes = gate_lanes_unless_non_finite<kLocal, kDelta>(
        _mm256_loadu_ps(global + i), load_local_ps<kLocal>(local, i), _mm256_loadu_ps(residual + i),
        bad);
    if (bad != 0) {
      // The lowest flagged lane: its s is non-finite (a non-finite θ_g makes s non-finite).
      return GateResult{.fired = 0,
                        .non_finite_offset = i + static_cast<std::uint64_t>(
                                                     std::countr_zero(static_cast<unsigned>(bad)))};
    }
    // Branch-free compaction: pack the fired lanes to the front and store all eight lanes at
    // the write position (fired <= i, so the store stays inside [0, count)); only the packed
    // ones count.
    const int mask = _mm256_movemask_ps(lanes.fire);
    const __m256i permutation = left_pack_permutation(mask);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_offsets + fired),
                        _mm256_permutevar8x32_epi32(lane_offsets, permutation));
    _mm256_storeu_ps(out_values + fired, _mm256_permutevar8x32_ps(lanes.s, permutation));
    fired += static_cast<std::uint64_t>(std::popcount(static_cast<unsigned>(mask)));
    lane_offsets = _mm256_add_epi32(lane_offsets, eight);
  }
  for (; i < count; ++i) {
    const GateLane lane = gate_lane<kLocal, kDelta>(
        chunk.global[i], load_local<kLocal>(chunk.local, i), chunk.residual[i]);
    if (!is_finite_value(lane.s)) return GateResult{.fired = 0, .non_finite_offset = i};
    out_offsets[fired] = static_cast<std::uint32_t>(i);
    out_values[fired] = lane.s;
    fired += lane.fire ? 1 : 0;
  }
  return GateResult{.fired = fired, .non_finite_offset = std::nullopt};
}

template <DType kLocal, Bf16Delta kDelta>
PULSELOCO_AVX2 void commit_residual_avx2_typed(const GateChunk& chunk, float* residual_out) {
  const float* const global = chunk.global;  // (the intrinsics' stores may alias `chunk`)
  const void* const local = chunk.local;
  const float* const residual = chunk.residual;
  const std::uint64_t count = chunk.count;
  std::uint64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    prefetch_ahead<4>(global, i, count);
    prefetch_local_ahead<kLocal>(local, i, count);
    prefetch_ahead<4>(residual, i, count);
    const GateLanes lanes =
        gate_lanes<kLocal, kDelta>(_mm256_loadu_ps(global + i), load_local_ps<kLocal>(local, i),
                                   _mm256_loadu_ps(residual + i));
    _mm256_storeu_ps(residual_out + i, _mm256_andnot_ps(lanes.fire, lanes.s));  // fire ? +0 : s
  }
  for (; i < count; ++i) {
    const GateLane lane = gate_lane<kLocal, kDelta>(
        chunk.global[i], load_local<kLocal>(chunk.local, i), chunk.residual[i]);
    residual_out[i] = lane.fire ? 0.0f : lane.s;
  }
}

template <DType kLocal>
PULSELOCO_AVX2 void outer_step_avx2_typed(float* global, float* momentum, const float* g,
                                          void* local, std::uint64_t count,
                                          const OuterStepParams& params) {
  const __m256 neg_lr = _mm256_set1_ps(-params.lr);
  const __m256 mu = _mm256_set1_ps(params.momentum);
  const bool first_step = params.first_step;
  std::uint64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 old_momentum = first_step ? _mm256_setzero_ps() : _mm256_loadu_ps(momentum + i);
    const OuterLanes out = outer_lanes(_mm256_loadu_ps(global + i), old_momentum,
                                       _mm256_loadu_ps(g + i), neg_lr, mu, first_step);
    _mm256_storeu_ps(global + i, out.global);
    _mm256_storeu_ps(momentum + i, out.momentum);
    store_local_ps<kLocal>(local, i,
                           kLocal == DType::float32 ? out.global : round_to_bf16_ps(out.global));
  }
  for (; i < count; ++i) {
    outer_lane(global[i], momentum[i], g[i], params.lr, params.momentum, params.first_step);
    store_local<kLocal>(local, i, global[i]);
  }
}

template <DType kLocal, Bf16Delta kDelta>
PULSELOCO_AVX2 void commit_and_outer_step_avx2_typed(const WindowChunk& chunk, const float* g,
                                                     const OuterStepParams& params) {
  const __m256 neg_lr = _mm256_set1_ps(-params.lr);
  const __m256 mu = _mm256_set1_ps(params.momentum);
  const bool first_step = params.first_step;
  float* const global_out = chunk.global;  // (the intrinsics' stores may alias `chunk`)
  float* const momentum_out = chunk.momentum;
  float* const residual_out = chunk.residual;
  void* const local_out = chunk.local;
  const std::uint64_t count = chunk.count;
  std::uint64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 global = _mm256_loadu_ps(global_out + i);
    const GateLanes lanes = gate_lanes<kLocal, kDelta>(global, load_local_ps<kLocal>(local_out, i),
                                                       _mm256_loadu_ps(residual_out + i));
    _mm256_storeu_ps(residual_out + i, _mm256_andnot_ps(lanes.fire, lanes.s));
    const __m256 old_momentum =
        first_step ? _mm256_setzero_ps() : _mm256_loadu_ps(momentum_out + i);
    const OuterLanes out =
        outer_lanes(global, old_momentum, _mm256_loadu_ps(g + i), neg_lr, mu, first_step);
    _mm256_storeu_ps(global_out + i, out.global);
    _mm256_storeu_ps(momentum_out + i, out.momentum);
    store_local_ps<kLocal>(local_out, i,
                           kLocal == DType::float32 ? out.global : round_to_bf16_ps(out.global));
  }
  for (; i < count; ++i) {
    const GateLane lane = gate_lane<kLocal, kDelta>(
        chunk.global[i], load_local<kLocal>(chunk.local, i), chunk.residual[i]);
    chunk.residual[i] = lane.fire ? 0.0f : lane.s;
    outer_lane(chunk.global[i], chunk.momentum[i], g[i], params.lr, params.momentum,
               params.first_step);
    store_local<kLocal>(chunk.local, i, chunk.global[i]);
  }
}

template <DType kLocal, Bf16Delta kDelta>
PULSELOCO_AVX2 void pseudo_gradient_avx2_typed(const float* global, const void* local, float* delta,
                                               std::uint64_t count) {
  constexpr bool kThroughCast = kDeltaThroughCast<kLocal, kDelta>;
  std::uint64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 g = _mm256_loadu_ps(global + i);
    const __m256 seen_global = kThroughCast ? round_to_bf16_ps(g) : g;
    _mm256_storeu_ps(delta + i, _mm256_sub_ps(seen_global, load_local_ps<kLocal>(local, i)));
  }
  for (; i < count; ++i) {
    const float seen_global = kThroughCast ? round_to_bf16(global[i]) : global[i];
    delta[i] = seen_global - load_local<kLocal>(local, i);
  }
}

}  // namespace

GateResult gate_avx2(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values) {
  return with_local_kind(chunk.local_dtype, chunk.bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    return gate_avx2_typed<kL, kD>(chunk, out_offsets, out_values);
  });
}

GateResult gate_avx2_without_prefetch(const GateChunk& chunk, std::uint32_t* out_offsets,
                                      float* out_values) {
  return with_local_kind(chunk.local_dtype, chunk.bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    return gate_avx2_typed<kL, kD, false>(chunk, out_offsets, out_values);
  });
}

void commit_residual_avx2(const GateChunk& chunk, float* residual_out) {
  with_local_kind(chunk.local_dtype, chunk.bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    commit_residual_avx2_typed<kL, kD>(chunk, residual_out);
  });
}

void outer_step_avx2(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                     std::uint64_t count, const OuterStepParams& params) {
  if (local_dtype == DType::float32) {
    outer_step_avx2_typed<DType::float32>(global, momentum, g, local, count, params);
  } else {
    outer_step_avx2_typed<DType::bfloat16>(global, momentum, g, local, count, params);
  }
}

void commit_and_outer_step_avx2(const WindowChunk& chunk, const float* g,
                                const OuterStepParams& params) {
  with_local_kind(chunk.local_dtype, chunk.bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    commit_and_outer_step_avx2_typed<kL, kD>(chunk, g, params);
  });
}

void pseudo_gradient_avx2(const float* global, const void* local, DType local_dtype,
                          Bf16Delta bf16_delta, float* delta, std::uint64_t count) {
  with_local_kind(local_dtype, bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    pseudo_gradient_avx2_typed<kL, kD>(global, local, delta, count);
  });
}

PULSELOCO_AVX2 void divide_avx2(float* values, std::uint64_t count, float divisor) {
  const __m256 by = _mm256_set1_ps(divisor);
  std::uint64_t i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(values + i, _mm256_div_ps(_mm256_loadu_ps(values + i), by));
  for (; i < count; ++i)
    values[i] = values[i] / divisor;
}

}  // namespace pulseloco::kernels::detail

#else  // not x86-64: never dispatched to (cpu_has_avx2() is false); the portable code stands in.

namespace pulseloco::kernels::detail {
GateResult gate_avx2(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values) {
  return gate_portable(chunk, out_offsets, out_values);
}
GateResult gate_avx2_without_prefetch(const GateChunk& chunk, std::uint32_t* out_offsets,
                                      float* out_values) {
  return gate_portable(chunk, out_offsets, out_values);
}
void commit_residual_avx2(const GateChunk& chunk, float* residual_out) {
  commit_residual_portable(chunk, residual_out);
}
void outer_step_avx2(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                     std::uint64_t count, const OuterStepParams& params) {
  outer_step_portable(global, momentum, g, local, local_dtype, count, params);
}
void commit_and_outer_step_avx2(const WindowChunk& chunk, const float* g,
                                const OuterStepParams& params) {
  commit_and_outer_step_portable(chunk, g, params);
}
void pseudo_gradient_avx2(const float* global, const void* local, DType local_dtype,
                          Bf16Delta bf16_delta, float* delta, std::uint64_t count) {
  pseudo_gradient_portable(global, local, local_dtype, bf16_delta, delta, count);
}
void divide_avx2(float* values, std::uint64_t count, float divisor) {
  divide_portable(values, count, divisor);
}
}  // namespace pulseloco::kernels::detail

#endif
