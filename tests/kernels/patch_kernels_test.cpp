// Patch extraction on the CPU against the scalar reference (tests/kernels/patch_test_inputs.h):
// fp32 and bf16 current weights, signed zeros, infinities, rounding ties, NaN reports that leave
// the snapshot unchanged, chunks of odd sizes, argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/kernels/patch_kernels.h>
#include "kernels/patch_test_inputs.h"

namespace pulseloco::testing {
namespace {

class PatchKernel : public ::testing::TestWithParam<DType> {};

TEST_P(PatchKernel, MatchesTheScalarReference) {
  for (std::size_t count : {0u, 1u, 7u, 10u, 33u, 1000u, 65537u}) {
    PatchInputs in = make_patch_inputs(GetParam(), count, 11 + count);
    const ReferencePatch expected = reference_patch(in);
    std::vector<std::uint32_t> offsets(count);
    std::vector<std::uint16_t> values(count);
    std::vector<std::uint16_t> previous(count);
    const kernels::PatchResult result = kernels::extract_patch(
        {.snapshot = in.snapshot.data(),
         .current = in.current(),
         .current_dtype = in.dtype,
         .count = count},
        {.offsets = offsets.data(), .values = values.data(), .previous = previous.data()});
    ASSERT_FALSE(result.nan_offset);
    ASSERT_EQ(result.changed, expected.offsets.size()) << count;
    offsets.resize(result.changed);
    values.resize(result.changed);
    previous.resize(result.changed);
    EXPECT_EQ(offsets, expected.offsets);
    EXPECT_EQ(values, expected.values);
    EXPECT_EQ(previous, expected.previous);
    EXPECT_EQ(in.snapshot, expected.snapshot_after);
    if (count > 1000) {
      // Realistic data: a few percent change, the absorbed updates do not.
      EXPECT_GT(result.changed, count / 100);
      EXPECT_LT(result.changed, count / 20);
    }
  }
}

TEST_P(PatchKernel, EdgeCasesAreComparedBitwise) {
  PatchInputs in = make_patch_inputs(GetParam(), 10, 3);
  std::vector<std::uint32_t> offsets(10);
  std::vector<std::uint16_t> values(10);
  const kernels::PatchResult result =
      kernels::extract_patch({.snapshot = in.snapshot.data(),
                              .current = in.current(),
                              .current_dtype = in.dtype,
                              .count = 10},
                             {.offsets = offsets.data(), .values = values.data()});
  offsets.resize(result.changed);
  values.resize(result.changed);
  // +0 -> -0, -0 -> +0, 1 -> -inf, a tie rounding up, a subnormal, an overflow to +inf.
  EXPECT_EQ(offsets, (std::vector<std::uint32_t>{0, 1, 4, 6, 8, 9}));
  EXPECT_EQ(values, (std::vector<std::uint16_t>{0x8000, 0x0000, 0xFF80, 0x3F82, 0x0002, 0x7F80}));
}

TEST_P(PatchKernel, ChunksGiveTheWholeResult) {
  const std::size_t count = 100'003;
  PatchInputs in = make_patch_inputs(GetParam(), count, 5);
  const ReferencePatch expected = reference_patch(in);
  std::vector<std::uint32_t> all;
  for (std::size_t begin = 0; begin < count; begin += 4099) {
    const std::size_t n = std::min<std::size_t>(4099, count - begin);
    std::vector<std::uint32_t> offsets(n);
    std::vector<std::uint16_t> values(n);
    const auto* current =
        static_cast<const std::byte*>(in.current()) + begin * dtype_size(in.dtype);
    const kernels::PatchResult result =
        kernels::extract_patch({.snapshot = in.snapshot.data() + begin,
                                .current = current,
                                .current_dtype = in.dtype,
                                .count = n},
                               {.offsets = offsets.data(), .values = values.data()});
    for (std::uint64_t k = 0; k < result.changed; ++k)
      all.push_back(static_cast<std::uint32_t>(begin + offsets[k]));
  }
  EXPECT_EQ(all, expected.offsets);
  EXPECT_EQ(in.snapshot, expected.snapshot_after);
}

TEST_P(PatchKernel, NanIsReportedAtItsLowestOffsetAndTheSnapshotIsUnchanged) {
  PatchInputs in = make_patch_inputs(GetParam(), 1000, 9);
  if (in.dtype == DType::float32) {
    in.current_f32[700] = std::numeric_limits<float>::quiet_NaN();
    in.current_f32[412] = -std::numeric_limits<float>::quiet_NaN();
  } else {
    in.current_bf16[700] = 0x7FC0;
    in.current_bf16[412] = 0xFF81;  // a negative signalling-pattern NaN
  }
  const std::vector<std::uint16_t> before = in.snapshot;
  std::vector<std::uint32_t> offsets(1000);
  std::vector<std::uint16_t> values(1000);
  const kernels::PatchResult result =
      kernels::extract_patch({.snapshot = in.snapshot.data(),
                              .current = in.current(),
                              .current_dtype = in.dtype,
                              .count = 1000},
                             {.offsets = offsets.data(), .values = values.data()});
  EXPECT_EQ(result.changed, 0u);
  ASSERT_TRUE(result.nan_offset);
  EXPECT_EQ(*result.nan_offset, 412u);
  EXPECT_EQ(in.snapshot, before);
  try {
    kernels::check_patch_finite(result, "layer.weight", 2000);
    FAIL() << "expected NonFiniteError";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::non_finite);
    EXPECT_EQ(e.context().tensor, "layer.weight");
    EXPECT_EQ(e.context().index, 2412u);
  }
}

INSTANTIATE_TEST_SUITE_P(CurrentDtypes, PatchKernel,
                         ::testing::Values(DType::float32, DType::bfloat16),
                         [](const auto& param_info) {
                           return std::string(dtype_name(param_info.param));
                         });

TEST(PatchKernelArguments, BadChunksAreInvalidArguments) {
  std::vector<std::uint16_t> snapshot(4);
  std::vector<float> current(4);
  std::vector<std::uint32_t> offsets(4);
  std::vector<std::uint16_t> values(4);
  const auto kind_of = [&](const kernels::PatchChunk& chunk, std::uint32_t* o) {
    try {
      (void)kernels::extract_patch(chunk, {.offsets = o, .values = values.data()});
    } catch (const Error& e) {
      return e.kind();
    }
    return ErrorKind::io;  // not thrown
  };
  EXPECT_EQ(kind_of({.snapshot = nullptr, .current = current.data(), .count = 4}, offsets.data()),
            ErrorKind::invalid_argument);
  EXPECT_EQ(kind_of({.snapshot = snapshot.data(), .current = current.data(), .count = 4}, nullptr),
            ErrorKind::invalid_argument);
  EXPECT_EQ(kind_of({.snapshot = snapshot.data(),
                     .current = current.data(),
                     .current_dtype = static_cast<DType>(77),
                     .count = 4},
                    offsets.data()),
            ErrorKind::invalid_argument);
}

}  // namespace
}  // namespace pulseloco::testing
