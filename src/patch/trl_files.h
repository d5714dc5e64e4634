// The patch files a TRL-style receiver loads (the layout of TRL's async GRPO delta weight sync):
//
//   anchors/step_NNNNNN.safetensors   every tensor in full, BF16, under its checkpoint name
//   deltas/step_NNNNNN.safetensors    per changed tensor: "{name}.idx" (raw: I32 absolute flat
//                                     indices; gap_delta: the gaps idx[k] - idx[k-1] - 1 with
//                                     idx[-1] = -1, U16 when every gap fits, U32 otherwise) and
//                                     "{name}.val" (BF16, the new values)
//
// The "__metadata__" holds TRL's keys (format "sparse_weight_patch", version "1", sparse,
// model_version, num_changed_params, total_changed_elements, total_elements, sparsity,
// encoding), which TRL's reader parses, and ours, which it ignores: pulseloco.digest (the
// state after the file, bf16_state.h), pulseloco.digest_definition and, in deltas,
// pulseloco.parent_version and pulseloco.parent_digest. docs/patches.md describes both.
//
// The readers treat a file as hostile input: every error is a ProtocolError (or the
// safetensors reader's IoError / InvalidArgument) naming the file, and nothing is returned
// unless the whole file is valid.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/io/atomic_file.h>
#include <pulseloco/patch/bf16_state.h>

namespace pulseloco::patch {

// How a delta file codes its indices (TRL's "encoding" key).
enum class IndexEncoding : std::uint8_t { raw, gap_delta };
[[nodiscard]] std::string_view index_encoding_name(IndexEncoding encoding) noexcept;
// Throws InvalidArgument for a name other than "raw" or "gap_delta".
[[nodiscard]] IndexEncoding parse_index_encoding(std::string_view name);

// The changed elements of one tensor: indices strictly ascending, values their new bf16 bits.
struct TensorDelta {
  std::string name;
  std::uint64_t numel = 0;  // the tensor's element count
  std::vector<std::uint32_t> indices;
  std::vector<std::uint16_t> values;
  // The bits the values replace: known to the publisher (the compact patch codes values
  // relative to them), not carried by the TRL files; empty after reading one.
  std::vector<std::uint16_t> previous;
};

struct Delta {
  std::uint64_t version = 0;
  std::uint64_t parent_version = 0;
  Digest parent_digest = 0;
  Digest digest = 0;  // of the state after the delta
  std::uint64_t total_elements = 0;
  IndexEncoding encoding = IndexEncoding::gap_delta;
  std::vector<TensorDelta> tensors;  // changed tensors only, in name order

  [[nodiscard]] std::uint64_t changed_elements() const noexcept;
};

struct Anchor {
  std::uint64_t version = 0;
  Digest digest = 0;
  Bf16State state;
};

// The file names of a version inside a publishing directory.
[[nodiscard]] std::filesystem::path anchor_file_name(std::uint64_t version);
[[nodiscard]] std::filesystem::path delta_file_name(std::uint64_t version);

// Write atomically (io/atomic_file.h); return the file's size and xxh3-64.
io::FileChecksum write_delta_file(const std::filesystem::path& path, const Delta& delta);
io::FileChecksum write_anchor_file(const std::filesystem::path& path, const Bf16State& state,
                                   std::uint64_t version, Digest digest, IndexEncoding encoding);

// Reads a delta for a receiver holding `layout` (its tensor names and element counts): every
// index is decoded and checked (strictly ascending, below the tensor's element count), every
// value is a non-NaN bf16, the counts in the metadata are the file's.
[[nodiscard]] Delta read_delta_file(const std::filesystem::path& path, const Bf16State& layout);
// Reads an anchor and checks that its tensors have the digest its metadata names.
[[nodiscard]] Anchor read_anchor_file(const std::filesystem::path& path);

}  // namespace pulseloco::patch
