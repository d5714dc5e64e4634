// Patch extraction on the CPU (contract: kernels/patch_kernels.h).
#include <pulseloco/kernels/patch_kernels.h>

#include <fmt/format.h>

#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/kernels/argument_checks.h>
#include <pulseloco/kernels/patch_lane.h>

namespace pulseloco::kernels {
namespace {

// Compares without writing the snapshot, so that a NaN leaves it unchanged.
template <DType kCurrent>
PatchResult select_changed(const PatchChunk& chunk, const PatchOutput& out) {
  std::uint64_t changed = 0;
  for (std::uint64_t i = 0; i < chunk.count; ++i) {
    const detail::PatchLane lane = detail::patch_lane<kCurrent>(chunk.current, i);
    if (lane.nan) return PatchResult{.changed = 0, .nan_offset = i};
    // Branch-free compaction: always write, advance only when changed (changed <= i < count).
    out.offsets[changed] = static_cast<std::uint32_t>(i);
    out.values[changed] = lane.bits;
    changed += lane.bits != chunk.snapshot[i] ? 1 : 0;
  }
  return PatchResult{.changed = changed, .nan_offset = std::nullopt};
}

}  // namespace

PatchResult extract_patch(const PatchChunk& chunk, const PatchOutput& out) {
  detail::check_patch_arguments(chunk, out, "extract_patch");
  const PatchResult result = chunk.current_dtype == DType::float32
                                 ? select_changed<DType::float32>(chunk, out)
                                 : select_changed<DType::bfloat16>(chunk, out);
  for (std::uint64_t k = 0; k < result.changed; ++k) {
    std::uint16_t& element = chunk.snapshot[out.offsets[k]];
    if (out.previous != nullptr) out.previous[k] = element;
    element = out.values[k];
  }
  return result;
}

void check_patch_finite(const PatchResult& result, std::string_view tensor,
                        std::uint64_t chunk_begin) {
  if (!result.nan_offset) return;
  throw NonFiniteError(
      "a weight to publish is NaN, which no bf16 patch can carry verifiably; nothing was "
      "published and the snapshot is unchanged",
      ErrorContext{.tensor = std::string(tensor), .index = chunk_begin + *result.nan_offset});
}

}  // namespace pulseloco::kernels
