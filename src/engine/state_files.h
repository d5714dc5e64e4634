// Internal: the layout of pulseloco's state files (checkpoints and window traces), shared by
// checkpoint.cpp, trace.cpp and replay.cpp. docs/operations.md describes the files for users.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include <pulseloco/engine/options.h>
#include <pulseloco/io/safetensors.h>

namespace pulseloco::state_files {

inline constexpr std::string_view kCheckpointFormat = "pulseloco-checkpoint";
inline constexpr std::string_view kCheckpointRankFormat = "pulseloco-checkpoint-rank";
inline constexpr std::string_view kTraceFormat = "pulseloco-trace";
inline constexpr std::string_view kFormatVersion = "1";

// Tensor name prefixes inside the files.
inline constexpr std::string_view kGlobal = "global.";      // θ_g, F32
inline constexpr std::string_view kMomentum = "momentum.";  // m, F32
inline constexpr std::string_view kResidual = "residual.";  // e, F32
inline constexpr std::string_view kLocal = "local.";        // θ_l, the model's dtype
inline constexpr std::string_view kStart = "start.";        // eager start point S, F32

[[nodiscard]] std::filesystem::path checkpoint_global_file(const std::filesystem::path& dir);
[[nodiscard]] std::filesystem::path checkpoint_rank_file(const std::filesystem::path& dir,
                                                         int rank);
// The embedding program's own file `name` of `rank` (CheckpointFile).
[[nodiscard]] std::filesystem::path checkpoint_user_file(const std::filesystem::path& dir, int rank,
                                                         std::string_view name);
[[nodiscard]] std::filesystem::path trace_window_dir(const std::filesystem::path& dir,
                                                     std::uint64_t window);
[[nodiscard]] std::filesystem::path trace_file(const std::filesystem::path& dir,
                                               std::uint64_t window, int rank, bool inputs);
// The encoded message this rank sent in a traced window (`pulseloco inspect` reads it).
[[nodiscard]] std::filesystem::path trace_message_file(const std::filesystem::path& dir,
                                                       std::uint64_t window, int rank);

// How a file's recorded digests were computed: the metadata key kDigestKey names the definition
// (kBufferDigestName, base/digest.h); files written without it used xxh3-64 of each tensor's
// whole bytes, and still verify that way.
inline constexpr std::string_view kDigestKey = "digest";
enum class DigestDefinition { whole_buffer, pieces };
[[nodiscard]] DigestDefinition digest_definition(const io::Metadata& metadata,
                                                 const std::filesystem::path& file);

// Metadata helpers: every value is a string in safetensors.
[[nodiscard]] const std::string& require(const io::Metadata& metadata, const std::string& key,
                                         const std::filesystem::path& file);
[[nodiscard]] std::uint64_t require_u64(const io::Metadata& metadata, const std::string& key,
                                        const std::filesystem::path& file);
[[nodiscard]] bool require_bool(const io::Metadata& metadata, const std::string& key,
                                const std::filesystem::path& file);  // "true" or "false"

// The engine options a checkpoint's or trace's file recorded (metadata "options", JSON). Errors
// name the file: ProtocolError when the metadata is missing or not JSON, InvalidArgument (as
// options_from_json) when the options are not valid ones.
[[nodiscard]] EngineOptions recorded_options(const io::Metadata& metadata,
                                             const std::filesystem::path& file);

}  // namespace pulseloco::state_files
