// Patch extraction on CUDA against the CPU kernel (which tests/kernels/patch_kernels_test.cpp
// holds to the scalar reference): the same entries and the same snapshot for fp32 and bf16
// current weights, sizes around the block size, a NaN reported at its lowest offset with the
// snapshot unchanged. Skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include <pulseloco/kernels/cuda/patch_kernels_cuda.h>
#include <pulseloco/kernels/patch_kernels.h>
#include "gpu/cuda_backend.h"
#include "gpu/gpu_test_util.h"
#include "kernels/patch_test_inputs.h"

namespace pulseloco::testing {
namespace {

struct DevicePatch {
  kernels::PatchResult result;
  std::vector<std::uint32_t> offsets;
  std::vector<std::uint16_t> values;
  std::vector<std::uint16_t> previous;
  std::vector<std::uint16_t> snapshot;
};

DevicePatch extract_on_device(const PatchInputs& in) {
  const std::size_t count = in.snapshot.size();
  CudaStream stream;
  kernels::cuda::DeviceWorkspace workspace(count);
  DeviceBytes snapshot = DeviceBytes::from_host(in.snapshot.data(), count * 2, stream.get());
  DeviceBytes current = DeviceBytes::from_host(in.current(), in.current_bytes(), stream.get());
  DeviceBytes offsets(count * 4);
  DeviceBytes values(count * 2);
  DeviceBytes previous(count * 2);
  DevicePatch out;
  out.result = kernels::cuda::extract_patch({.snapshot = snapshot.get<std::uint16_t>(),
                                             .current = current.get(),
                                             .current_dtype = in.dtype,
                                             .count = count},
                                            {.offsets = offsets.get<std::uint32_t>(),
                                             .values = values.get<std::uint16_t>(),
                                             .previous = previous.get<std::uint16_t>()},
                                            workspace, stream.get());
  out.offsets.resize(out.result.changed);
  out.values.resize(out.result.changed);
  out.previous.resize(out.result.changed);
  out.snapshot.resize(count);
  offsets.to_host(out.offsets.data(), out.result.changed * 4, stream.get());
  values.to_host(out.values.data(), out.result.changed * 2, stream.get());
  previous.to_host(out.previous.data(), out.result.changed * 2, stream.get());
  snapshot.to_host(out.snapshot.data(), count * 2, stream.get());
  return out;
}

class PatchCpuVsCuda : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { PULSELOCO_SKIP_WITHOUT_GPU(); }
};

TEST_P(PatchCpuVsCuda, SameEntriesAndSnapshot) {
  for (std::size_t count : {0u, 1u, 10u, 255u, 256u, 257u, 65537u, 3'000'001u}) {
    PatchInputs in = make_patch_inputs(GetParam(), count, 17 + count);
    const DevicePatch gpu = extract_on_device(in);
    const ExtractedPatch cpu = extract_on_cpu(in, 0, count);
    ASSERT_FALSE(gpu.result.nan_offset);
    ASSERT_EQ(gpu.result.changed, cpu.result.changed) << count;
    EXPECT_EQ(gpu.offsets, cpu.offsets) << count;
    EXPECT_EQ(gpu.values, cpu.values) << count;
    EXPECT_EQ(gpu.previous, cpu.previous) << count;
    EXPECT_EQ(gpu.snapshot, in.snapshot) << count;
  }
}

TEST_P(PatchCpuVsCuda, NanLeavesTheSnapshotUnchanged) {
  PatchInputs in = make_patch_inputs(GetParam(), 100'000, 4);
  for (std::size_t i : {99'000u, 40'001u, 70'000u}) {
    if (in.dtype == DType::float32) {
      in.current_f32[i] = std::numeric_limits<float>::quiet_NaN();
    } else {
      in.current_bf16[i] = 0xFFC1;
    }
  }
  const DevicePatch gpu = extract_on_device(in);
  EXPECT_EQ(gpu.result.changed, 0u);
  ASSERT_TRUE(gpu.result.nan_offset);
  EXPECT_EQ(*gpu.result.nan_offset, 40'001u);
  EXPECT_EQ(gpu.snapshot, in.snapshot);
}

INSTANTIATE_TEST_SUITE_P(CurrentDtypes, PatchCpuVsCuda,
                         ::testing::Values(DType::float32, DType::bfloat16),
                         [](const auto& param_info) {
                           return std::string(dtype_name(param_info.param));
                         });

}  // namespace
}  // namespace pulseloco::testing
