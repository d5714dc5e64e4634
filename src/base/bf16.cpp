#include <pulseloco/base/bf16.h>

#include <pulseloco/base/cpu_features.h>
#include <pulseloco/base/errors.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define PULSELOCO_X86 1
#endif

namespace pulseloco {
namespace bf16_impl {

void float_to_bf16_portable(const float* src, std::uint16_t* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    dst[i] = float_to_bf16_bits(src[i]);
}

void bf16_to_float_portable(const std::uint16_t* src, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    dst[i] = bf16_bits_to_float(src[i]);
}

#if defined(PULSELOCO_X86)
// Eight fp32 -> eight bf16, in the low 16 bits of each 32-bit lane (same rule as the scalar).
__attribute__((target("avx2"))) static inline __m256i round_lanes_to_bf16(__m256i bits) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bias_base = _mm256_set1_epi32(0x7FFF);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i inf_bits = _mm256_set1_epi32(0x7F800000);
  const __m256i nan_out = _mm256_set1_epi32(kBf16CanonicalNaN);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias_base, lsb)), 16);
  // Signed compare is safe: both sides are non-negative after masking the sign.
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, abs_mask), inf_bits);
  return _mm256_blendv_epi8(rounded, nan_out, is_nan);
}

__attribute__((target("avx2"))) void float_to_bf16_avx2(const float* src, std::uint16_t* dst,
                                                        std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo =
        round_lanes_to_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m256i hi =
        round_lanes_to_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8)));
    // packus works per 128-bit lane: [lo0 hi0 lo1 hi1]; reorder to [lo0 lo1 hi0 hi1].
    const __m256i packed = _mm256_packus_epi32(lo, hi);
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), ordered);
  }
  for (; i < n; ++i)
    dst[i] = float_to_bf16_bits(src[i]);
}

__attribute__((target("avx2"))) void bf16_to_float_avx2(const std::uint16_t* src, float* dst,
                                                        std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i widened = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), widened);
  }
  for (; i < n; ++i)
    dst[i] = bf16_bits_to_float(src[i]);
}
#else
void float_to_bf16_avx2(const float* src, std::uint16_t* dst, std::size_t n) {
  float_to_bf16_portable(src, dst, n);
}
void bf16_to_float_avx2(const std::uint16_t* src, float* dst, std::size_t n) {
  bf16_to_float_portable(src, dst, n);
}
#endif

}  // namespace bf16_impl

void float_to_bf16(std::span<const float> src, std::span<std::uint16_t> dst) {
  if (src.size() != dst.size()) {
    throw InvalidArgument("float_to_bf16: source and destination sizes differ");
  }
  if (active_cpu_isa() == CpuIsa::avx2) {
    bf16_impl::float_to_bf16_avx2(src.data(), dst.data(), src.size());
  } else {
    bf16_impl::float_to_bf16_portable(src.data(), dst.data(), src.size());
  }
}

void bf16_to_float(std::span<const std::uint16_t> src, std::span<float> dst) {
  if (src.size() != dst.size()) {
    throw InvalidArgument("bf16_to_float: source and destination sizes differ");
  }
  if (active_cpu_isa() == CpuIsa::avx2) {
    bf16_impl::bf16_to_float_avx2(src.data(), dst.data(), src.size());
  } else {
    bf16_impl::bf16_to_float_portable(src.data(), dst.data(), src.size());
  }
}

}  // namespace pulseloco
