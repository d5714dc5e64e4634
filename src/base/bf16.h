// bf16 <-> fp32 conversion: the one bit-level routine every CPU and CUDA kernel uses.
//
// fp32 -> bf16 rounds to nearest, ties to even, exactly as PyTorch's c10::BFloat16 does, for
// every fp32 bit pattern (tests/base/bf16_exhaustive_test.cpp checks all 2^32 against libtorch).
//
// NaN: PyTorch is not self-consistent (the scalar c10::BFloat16 gives 0x7FC0, its vectorised
// tensor cast gives 0xFFFF). We map every NaN to the canonical quiet NaN 0x7FC0, like the scalar
// path. A valid window never casts NaN (the gate rejects non-finite values first).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#if defined(__CUDACC__)
#define PULSELOCO_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PULSELOCO_HOST_DEVICE inline
#endif

#if !defined(__CUDA_ARCH__)
#include <bit>
#endif

namespace pulseloco {

inline constexpr std::uint16_t kBf16CanonicalNaN = 0x7FC0;

PULSELOCO_HOST_DEVICE std::uint32_t float_to_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  return std::bit_cast<std::uint32_t>(value);
#endif
}

PULSELOCO_HOST_DEVICE float bits_to_float(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  return std::bit_cast<float>(bits);
#endif
}

// fp32 -> bf16 bits, round to nearest even; NaN -> 0x7FC0.
PULSELOCO_HOST_DEVICE std::uint16_t float_to_bf16_bits(float value) {
  const std::uint32_t bits = float_to_bits(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return kBf16CanonicalNaN;
  // Adding 0x7FFF rounds to nearest; adding one more when the kept LSB is odd breaks ties to
  // even. Overflow of the mantissa carries into the exponent, which is the correct rounding
  // (up to infinity for values above the largest bf16).
  const std::uint32_t rounding_bias = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding_bias) >> 16);
}

PULSELOCO_HOST_DEVICE float bf16_bits_to_float(std::uint16_t bits) {
  return bits_to_float(static_cast<std::uint32_t>(bits) << 16);
}

// The fp32 value of bf16(value): what a weight looks like to a bf16 forward pass.
PULSELOCO_HOST_DEVICE float round_to_bf16(float value) {
  return bf16_bits_to_float(float_to_bf16_bits(value));
}

// Numeric equality of two bf16 values: +0 equals -0, NaN equals nothing.
PULSELOCO_HOST_DEVICE bool bf16_numeric_equal(std::uint16_t a, std::uint16_t b) {
  const bool a_nan = (a & 0x7FFFu) > 0x7F80u;
  const bool b_nan = (b & 0x7FFFu) > 0x7F80u;
  if (a_nan || b_nan) return false;
  return a == b || ((a | b) & 0x7FFFu) == 0;
}

#if !defined(__CUDA_ARCH__)
// Vectorised conversions over host buffers (AVX2 when the CPU has it, a portable loop
// otherwise; see base/cpu_features.h). `dst` must have the size of `src`.
void float_to_bf16(std::span<const float> src, std::span<std::uint16_t> dst);
void bf16_to_float(std::span<const std::uint16_t> src, std::span<float> dst);

// The two implementations, for tests and benchmarks. The AVX2 ones must only be called when
// cpu_has_avx2() is true.
namespace bf16_impl {
void float_to_bf16_portable(const float* src, std::uint16_t* dst, std::size_t n);
void float_to_bf16_avx2(const float* src, std::uint16_t* dst, std::size_t n);
void bf16_to_float_portable(const std::uint16_t* src, float* dst, std::size_t n);
void bf16_to_float_avx2(const std::uint16_t* src, float* dst, std::size_t n);
}  // namespace bf16_impl
#endif

}  // namespace pulseloco
