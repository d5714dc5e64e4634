#include <pulseloco/base/bf16.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <pulseloco/base/cpu_features.h>
#include <pulseloco/base/errors.h>

namespace pulseloco {
namespace {

std::uint16_t to_bf16(std::uint32_t bits) {
  return float_to_bf16_bits(bits_to_float(bits));
}

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(0x3F800000u), 0x3F80);  // 1.0 exactly
  EXPECT_EQ(to_bf16(0x3F807FFFu), 0x3F80);  // just below half: down
  EXPECT_EQ(to_bf16(0x3F808000u), 0x3F80);  // tie, kept LSB even: stays
  EXPECT_EQ(to_bf16(0x3F808001u), 0x3F81);  // just above half: up
  EXPECT_EQ(to_bf16(0x3F818000u), 0x3F82);  // tie, kept LSB odd: up to even
  EXPECT_EQ(to_bf16(0xBF818000u), 0xBF82);  // same for negatives
  EXPECT_EQ(to_bf16(0x3FFF8000u), 0x4000);  // mantissa carry into the exponent
}

TEST(Bf16, SpecialValues) {
  EXPECT_EQ(to_bf16(0x00000000u), 0x0000);  // +0
  EXPECT_EQ(to_bf16(0x80000000u), 0x8000);  // -0 keeps its sign
  EXPECT_EQ(to_bf16(0x7F800000u), 0x7F80);  // +inf
  EXPECT_EQ(to_bf16(0xFF800000u), 0xFF80);  // -inf
  EXPECT_EQ(to_bf16(0x7F7FFFFFu), 0x7F80);  // largest float rounds up to infinity
  EXPECT_EQ(to_bf16(0x7F7F7FFFu), 0x7F7F);  // largest bf16 stays finite
  EXPECT_EQ(to_bf16(0x00000001u), 0x0000);  // smallest subnormal rounds to zero
  EXPECT_EQ(to_bf16(0x00008000u), 0x0000);  // subnormal tie to even (zero)
  EXPECT_EQ(to_bf16(0x00018000u), 0x0002);  // subnormal tie to even (up)
  EXPECT_EQ(to_bf16(0x007FFFFFu), 0x0080);  // largest subnormal rounds to the smallest normal
}

TEST(Bf16, EveryNaNBecomesTheCanonicalNaN) {
  for (std::uint32_t bits : {0x7F800001u, 0x7FC00000u, 0x7FFFFFFFu, 0xFF800001u, 0xFFC00000u,
                             0xFFFFFFFFu, 0x7F80FFFFu}) {
    EXPECT_EQ(to_bf16(bits), kBf16CanonicalNaN) << std::hex << bits;
  }
}

TEST(Bf16, WideningIsExact) {
  EXPECT_EQ(float_to_bits(bf16_bits_to_float(0x3F80)), 0x3F800000u);
  EXPECT_EQ(float_to_bits(bf16_bits_to_float(0x8001)), 0x80010000u);
  for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
    const auto bits16 = static_cast<std::uint16_t>(b);
    const float widened = bf16_bits_to_float(bits16);
    if ((bits16 & 0x7FFF) > 0x7F80) continue;  // NaNs are canonicalised
    ASSERT_EQ(float_to_bf16_bits(widened), bits16) << "bf16 -> fp32 -> bf16 is the identity";
  }
}

TEST(Bf16, NumericEqualityTreatsSignedZerosAsEqualAndNaNAsUnequal) {
  EXPECT_TRUE(bf16_numeric_equal(0x0000, 0x8000));
  EXPECT_TRUE(bf16_numeric_equal(0x3F80, 0x3F80));
  EXPECT_FALSE(bf16_numeric_equal(0x3F80, 0x3F81));
  EXPECT_FALSE(bf16_numeric_equal(0x3F80, 0xBF80));
  EXPECT_FALSE(bf16_numeric_equal(0x7FC0, 0x7FC0));
  EXPECT_FALSE(bf16_numeric_equal(0x7F80, 0x7FC0));
  EXPECT_TRUE(bf16_numeric_equal(0x7F80, 0x7F80));
}

std::vector<float> random_floats(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> values(n);
  for (auto& v : values)
    v = bits_to_float(rng());
  // Sprinkle in the interesting patterns at odd positions.
  const std::uint32_t special[] = {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u,
                                   0xFFFFFFFFu, 0x3F808000u, 0x3F818000u, 0x00008000u, 0x7F7FFFFFu};
  for (std::size_t i = 0; i < std::size(special) && 7 * i + 3 < n; ++i) {
    values[7 * i + 3] = bits_to_float(special[i]);
  }
  return values;
}

class Bf16Vectorised : public ::testing::TestWithParam<std::size_t> {};

TEST_P(Bf16Vectorised, EveryImplementationMatchesTheScalarRoutine) {
  const std::size_t n = GetParam();
  const std::vector<float> src = random_floats(n, static_cast<std::uint32_t>(n) + 17);
  std::vector<std::uint16_t> expected(n);
  for (std::size_t i = 0; i < n; ++i)
    expected[i] = float_to_bf16_bits(src[i]);

  std::vector<std::uint16_t> portable(n, 0xAAAA);
  bf16_impl::float_to_bf16_portable(src.data(), portable.data(), n);
  EXPECT_EQ(portable, expected);

  std::vector<std::uint16_t> dispatched(n, 0xAAAA);
  float_to_bf16(src, dispatched);
  EXPECT_EQ(dispatched, expected);

  if (cpu_has_avx2()) {
    std::vector<std::uint16_t> avx2(n, 0xAAAA);
    bf16_impl::float_to_bf16_avx2(src.data(), avx2.data(), n);
    EXPECT_EQ(avx2, expected);

    std::vector<float> widened(n), widened_avx2(n);
    bf16_impl::bf16_to_float_portable(expected.data(), widened.data(), n);
    bf16_impl::bf16_to_float_avx2(expected.data(), widened_avx2.data(), n);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(float_to_bits(widened[i]), float_to_bits(widened_avx2[i])) << i;
      ASSERT_EQ(float_to_bits(widened[i]), std::uint32_t{expected[i]} << 16) << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, Bf16Vectorised,
                         ::testing::Values(0, 1, 7, 8, 15, 16, 17, 31, 33, 1000, 65537),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "_elements";
                         });

TEST(Bf16, MismatchedSpansAreRejected) {
  std::vector<float> src(4);
  std::vector<std::uint16_t> dst(3);
  EXPECT_THROW(float_to_bf16(src, dst), InvalidArgument);
}

}  // namespace
}  // namespace pulseloco
