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
    const ExtractedPatch patch = extract_on_cpu(in, 0, count);
    const kernels::PatchResult& result = patch.result;
    ASSERT_FALSE(result.nan_offset);
    ASSERT_EQ(result.changed, expected.offsets.size()) << count;
    EXPECT_EQ(patch.offsets, expected.offsets);
    EXPECT_EQ(patch.values, expected.values);
    EXPECT_EQ(patch.previous, expected.previous);
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
  const ExtractedPatch patch = extract_on_cpu(in, 0, 10);
  // +0 -> -0, -0 -> +0, 1 -> -inf, a tie rounding up, a subnormal, an overflow to +inf.
  EXPECT_EQ(patch.offsets, (std::vector<std::uint32_t>{0, 1, 4, 6, 8, 9}));
  EXPECT_EQ(patch.values,
            (std::vector<std::uint16_t>{0x8000, 0x0000, 0xFF80, 0x3F82, 0x0002, 0x7F80}));
}

TEST_P(PatchKernel, ChunksGiveTheWholeResult) {
  const std::size_t count = 100'003;
  PatchInputs in = make_patch_inputs(GetParam(), count, 5);
  const ReferencePatch expected = reference_patch(in);
  std::vector<std::uint32_t> all;
  for (std::size_t begin = 0; begin < count; begin += 4099) {
    const std::size_t n = std::min<std::size_t>(4099, count - begin);
    for (const std::uint32_t offset : extract_on_cpu(in, begin, n).offsets)
      all.push_back(static_cast<std::uint32_t>(begin + offset));
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
  const kernels::PatchResult result = extract_on_cpu(in, 0, 1000).result;
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
