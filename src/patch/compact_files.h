// Compact patch files: a version's delta as a compact patch (codec/patch_message.h,
// docs/wire-format.md "Compact patches"), for links where bytes matter. The publisher writes
// one beside each TRL delta (compact/step_NNNNNN.plsp); the receiver reads it instead of the
// TRL delta when the manifest lists it, since it is smaller.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>

#include <pulseloco/io/atomic_file.h>
#include <pulseloco/patch/bf16_state.h>
#include <pulseloco/patch/trl_files.h>

namespace pulseloco::patch {

[[nodiscard]] std::filesystem::path compact_file_name(std::uint64_t version);

// Every tensor of `delta` must carry the bits its values replace (TensorDelta::previous).
io::FileChecksum write_compact_file(const std::filesystem::path& path, const Delta& delta);

// Reads a compact patch for a receiver holding `held` (the parent state): every tensor must be
// one the receiver holds, with its element count; the indices are checked as the codec decodes
// them and no new value may be NaN. ProtocolError naming the file (and the tensor and index).
[[nodiscard]] Delta read_compact_file(const std::filesystem::path& path, const Bf16State& held);
// The same for a compact patch's bytes received from `source` (named in the errors).
[[nodiscard]] Delta read_compact_patch(std::span<const std::byte> bytes, const Bf16State& held,
                                       std::string_view source);
// The largest compact patch of the state `held`: a larger one is refused unread.
[[nodiscard]] std::uint64_t max_compact_bytes(const Bf16State& held);

}  // namespace pulseloco::patch
