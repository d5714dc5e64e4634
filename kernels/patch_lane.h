// Internal: the per-element rule of patch extraction (kernels/patch_kernels.h), shared by the
// CPU loop and the CUDA kernel so that both compute the same bits.
#pragma once

#include <cstdint>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/tensor_view.h>

namespace pulseloco::kernels::detail {

struct PatchLane {
  std::uint16_t bits;  // bf16(current)
  bool nan;            // the current value is a NaN (bits is then meaningless)
};

template <DType kCurrent>
PULSELOCO_HOST_DEVICE PatchLane patch_lane(const void* current, std::uint64_t i) {
  if constexpr (kCurrent == DType::float32) {
    const std::uint32_t bits = float_to_bits(static_cast<const float*>(current)[i]);
    return {float_to_bf16_bits(bits_to_float(bits)), (bits & 0x7FFFFFFFu) > 0x7F800000u};
  } else {
    const std::uint16_t bits = static_cast<const std::uint16_t*>(current)[i];
    return {bits, (bits & 0x7FFFu) > 0x7F80u};
  }
}

}  // namespace pulseloco::kernels::detail
