#include "context_entropy.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/codec/context_coding.h>

namespace pulseloco::bench {
namespace {

double log2_binomial(std::uint64_t n, std::uint64_t k) {
  if (k == 0 || k >= n) return 0.0;
  const auto nd = static_cast<double>(n);
  const auto kd = static_cast<double>(k);
  return (std::lgamma(nd + 1) - std::lgamma(kd + 1) - std::lgamma(nd - kd + 1)) / std::log(2.0);
}

double order0_bits(std::span<const std::uint8_t> symbols) {
  std::array<std::uint64_t, 256> counts{};
  for (const std::uint8_t s : symbols)
    ++counts[s];
  double bits = 0;
  const auto n = static_cast<double>(symbols.size());
  for (const std::uint64_t c : counts) {
    if (c > 0) bits -= static_cast<double>(c) * std::log2(static_cast<double>(c) / n);
  }
  return bits;
}

// Σ over contexts of the order-0 bits of the symbols seen in each (an ideal adaptive coder per
// context, without the cost of describing the model).
double conditional_bits(std::span<const std::uint8_t> contexts,
                        std::span<const std::uint8_t> symbols) {
  std::vector<std::array<std::uint32_t, 256>> counts(256, std::array<std::uint32_t, 256>{});
  std::array<std::uint64_t, 256> totals{};
  for (std::size_t i = 0; i < symbols.size(); ++i) {
    ++counts[contexts[i]][symbols[i]];
    ++totals[contexts[i]];
  }
  double bits = 0;
  for (std::size_t c = 0; c < 256; ++c) {
    for (const std::uint32_t k : counts[c]) {
      if (k > 0) {
        bits -= static_cast<double>(k) *
                std::log2(static_cast<double>(k) / static_cast<double>(totals[c]));
      }
    }
  }
  return bits;
}

// The value bits of a model that also reads where θ_g sits in its bf16 cell: a fired s moved
// θ_g - s across the rounding boundary below θ_g (s > 0) or above it (s < 0), so |s| is at least
// that boundary's distance and usually of its order. Codes the sign given θ_g's position in the
// cell (8 buckets), the exponent of |s| relative to that distance's given the distance's exponent
// relative to θ_g's, U as the context coding does, and the raw mantissa bits without the sign.
double boundary_value_bits(std::span<const std::uint32_t> offsets, std::span<const float> values,
                           std::span<const float> context, std::span<const std::uint8_t> u,
                           std::uint64_t raw_bits) {
  const std::size_t n = offsets.size();
  std::vector<std::uint8_t> sign(n), sign_context(n), above(n), above_context(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float g = context[offsets[i]];
    const float s = values[i];
    const std::uint16_t b = float_to_bf16_bits(g);
    const double centre = bf16_bits_to_float(b);
    const double up = bf16_bits_to_float(static_cast<std::uint16_t>(b + 1));
    const double down = bf16_bits_to_float(static_cast<std::uint16_t>(b - 1));
    // Magnitude grows with the bits: for a negative centre, b + 1 is the neighbour below.
    const double low = 0.5 * (centre + (centre < 0 || std::signbit(centre) ? up : down));
    const double high = 0.5 * (centre + (centre < 0 || std::signbit(centre) ? down : up));
    const double to_low = static_cast<double>(g) - low;
    const double to_high = high - static_cast<double>(g);
    const double cell = to_low + to_high;
    const bool finite = std::isfinite(cell) && cell > 0 && std::isfinite(g) && std::isfinite(s);
    sign[i] = std::signbit(s) ? 1 : 0;
    sign_context[i] =
        finite ? static_cast<std::uint8_t>(std::clamp(static_cast<int>(8 * to_low / cell), 0, 7))
               : 8;
    const double distance = s > 0 ? to_low : to_high;
    int distance_exponent = 0;
    int s_exponent = 0;
    int g_exponent = 0;
    (void)std::frexp(std::max(distance, 1e-300), &distance_exponent);
    (void)std::frexp(std::fabs(static_cast<double>(s)) + 1e-300, &s_exponent);
    (void)std::frexp(std::fabs(static_cast<double>(g)) + 1e-300, &g_exponent);
    above[i] =
        finite
            ? static_cast<std::uint8_t>(std::clamp(s_exponent - distance_exponent, -64, 191) + 64)
            : 255;
    above_context[i] =
        finite ? static_cast<std::uint8_t>(std::clamp(distance_exponent - g_exponent + 128, 0, 254))
               : 255;
  }
  return conditional_bits(sign_context, sign) + conditional_bits(above_context, above) +
         order0_bits(u) + static_cast<double>(raw_bits) - static_cast<double>(n);
}

}  // namespace

EntropyEstimate estimate_entropy(std::span<const std::uint32_t> offsets,
                                 std::span<const float> values, std::span<const float> context) {
  EntropyEstimate e;
  const std::size_t n = offsets.size();
  e.index_positions = log2_binomial(context.size(), n);
  std::array<std::uint64_t, 256> elements{};
  std::array<std::uint64_t, 256> fired{};
  for (const float c : context)
    ++elements[(std::bit_cast<std::uint32_t>(c) >> 23) & 0xFF];
  for (const std::uint32_t o : offsets)
    ++fired[(std::bit_cast<std::uint32_t>(context[o]) >> 23) & 0xFF];
  for (std::size_t x = 0; x < 256; ++x)
    e.index_exponent += log2_binomial(elements[x], fired[x]);
  if (n == 0) return e;
  std::vector<std::uint8_t> d(n), u(n), ex(n);
  std::vector<std::byte> bits(codec::detail::raw_bits_capacity(n));
  // The boundary model reads the values as they are ...
  const std::uint64_t raw_as_they_are = codec::detail::split_against_context(
      offsets, values, context, nullptr, ex.data(), d.data(), u.data(), bits.data());
  e.value_boundary = boundary_value_bits(offsets, values, context, u, raw_as_they_are);
  // ... the symbol stream's models the values as the context frame codes them: less their
  // context's cast residue where the encoder removes it.
  std::vector<float> less_residue(n);
  std::vector<std::uint8_t> multiples(n);
  const std::span<const float> coded =
      codec::detail::remove_context_residue(offsets, values, context, {}, less_residue.data(),
                                            multiples.data())
          ? std::span<const float>(less_residue)
          : values;
  const std::uint64_t raw = codec::detail::split_against_context(
      offsets, coded, context, nullptr, ex.data(), d.data(), u.data(), bits.data());
  // D given the context exponent, U given D's bucket (as the symbol stream models them).
  std::vector<std::uint8_t> bucket(n);
  for (std::size_t i = 0; i < n; ++i)
    bucket[i] = static_cast<std::uint8_t>(std::clamp<int>(static_cast<std::int8_t>(d[i]), -12, 3));
  e.value_context =
      conditional_bits(ex, d) + conditional_bits(bucket, u) + static_cast<double>(raw);
  e.value_order0 = order0_bits(d) + order0_bits(u) + static_cast<double>(raw);
  e.value_raw = static_cast<double>(raw);
  return e;
}

nlohmann::json entropy_json(const EntropyEstimate& bits, std::uint64_t entries) {
  const double n = std::max<double>(1.0, static_cast<double>(entries));
  return {{"index_positions", bits.index_positions / 8 / n},
          {"index_given_exponent", bits.index_exponent / 8 / n},
          {"value_context_model", bits.value_context / 8 / n},
          {"value_order0_model", bits.value_order0 / 8 / n},
          {"value_boundary_model", bits.value_boundary / 8 / n},
          {"value_raw_bits", bits.value_raw / 8 / n}};
}

}  // namespace pulseloco::bench
