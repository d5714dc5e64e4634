// Patch extraction: which bf16 weights a receiver must overwrite to go from the last published
// bf16 snapshot to the current weights, one chunk of one tensor at a time.
//
// An element changes when the bits of bf16(current) differ from the snapshot's bits: the
// comparison is bitwise, so +0 and -0 are different values (a receiver reconstructs the
// publisher's bytes, not a numerically equal state). The cast is base/bf16.h's (round to nearest
// even, as PyTorch). A NaN in the current weights has no bf16 a receiver could verify (every NaN
// casts to one pattern), so it is an error, reported by its lowest offset; infinities are
// values like any other. The CUDA build computes the same result from device buffers
// (kernels/cuda/patch_kernels_cuda.h).
//
// Threading: one call handles one chunk on the calling thread; callers parallelise across
// chunks (src/patch/publisher.cpp does, with base/thread_pool.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include <pulseloco/base/tensor_view.h>

namespace pulseloco::kernels {

// One chunk: the snapshot (bf16 bits, updated in place) and the current weights.
struct PatchChunk {
  std::uint16_t* snapshot = nullptr;  // the last published bf16 bits
  const void* current = nullptr;      // fp32 or bf16 (current_dtype)
  DType current_dtype = DType::float32;
  std::uint64_t count = 0;  // elements; at most kMaxChunkElements (window_kernels.h)
};

struct PatchResult {
  std::uint64_t changed = 0;  // entries written to the output
  // Lowest offset whose current value is NaN. When set, `changed` is 0, the output holds
  // nothing valid and the snapshot is unchanged.
  std::optional<std::uint64_t> nan_offset;
};

// The entries of one chunk, each buffer with room for chunk.count entries.
struct PatchOutput {
  std::uint32_t* offsets = nullptr;   // ascending offsets whose bf16 value changed
  std::uint16_t* values = nullptr;    // their new bf16 bits
  std::uint16_t* previous = nullptr;  // the bits they replace (optional: null skips them)
};

// Writes the changed entries, then writes their values into the snapshot. The previous bits
// let a caller undo the snapshot update (publishing failed later) and code a value relative to
// the one it replaces. Throws InvalidArgument for a bad chunk (null buffers, unknown dtype, too
// many elements).
[[nodiscard]] PatchResult extract_patch(const PatchChunk& chunk, const PatchOutput& out);

// Turns a result that reports a NaN into a NonFiniteError naming the tensor and the element
// index within it (chunk_begin + offset); returns otherwise.
void check_patch_finite(const PatchResult& result, std::string_view tensor,
                        std::uint64_t chunk_begin);

}  // namespace pulseloco::kernels
