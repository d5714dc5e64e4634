// Internal: how a checkpoint commits as a whole (docs/operations.md, "Checkpoints"). Each save
// writes a new directory under the checkpoint root, `window-NNNNNN` (`window-NNNNNN.K` when that
// name is taken). Its files are written under temporary names and renamed, and the directory
// becomes a checkpoint only when rank 0 writes `manifest.json` there, after every rank reported
// its files written; the manifest lists every file with its size and xxh3-64, and carries the
// xxh3-64 of its own content. A directory without a manifest is no checkpoint: loading ignores
// it and the next successful save removes it. Committed checkpoints are ordered by the commit
// sequence their manifests record, not by window: after resuming from an older checkpoint, the
// next save is the newest although its window is lower. The ranks agree on every step's outcome
// (agree()), so a failure on one rank is the same error on every rank.
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/engine/attached_group.h>

namespace pulseloco::engine_detail {

inline constexpr std::string_view kManifestFile = "manifest.json";

// One file of a checkpoint directory, as the manifest lists it.
struct CheckpointFileRecord {
  std::string name;  // within the directory
  int rank = 0;      // the rank that wrote it
  std::uint64_t size = 0;
  Digest xxh3 = 0;
};

struct Manifest {
  std::uint64_t sequence = 0;  // 1 + the highest under the root when it committed
  std::uint64_t window = 0;
  int world_size = 0;
  std::vector<CheckpointFileRecord> files;

  // The record of `name`; ProtocolError naming the manifest when it lists no such file.
  [[nodiscard]] const CheckpointFileRecord& file(const std::filesystem::path& dir,
                                                 std::string_view name) const;
};

[[nodiscard]] nlohmann::json to_json(const CheckpointFileRecord& record);
// ProtocolError naming `source` when `json` is not a file record.
[[nodiscard]] CheckpointFileRecord file_record_from_json(const nlohmann::json& json,
                                                         std::string_view source);

struct NewCheckpointDir {
  std::filesystem::path path;
  std::uint64_t sequence = 0;  // its manifest's, when it commits
};

// Creates the directory of a new checkpoint of `window` under `root` (which is created when
// missing): the first of window-NNNNNN, window-NNNNNN.1, ... that does not exist, with the
// sequence after every committed checkpoint's under `root` (a warning names a manifest that
// cannot be read).
[[nodiscard]] NewCheckpointDir create_checkpoint_dir(const std::filesystem::path& root,
                                                     std::uint64_t window);

// The metadata key of a checkpoint's global.safetensors that names the file whose existence commits
// its directory (kManifestFile). Files of the flat layout, written before manifests, lack it: a
// directory without a manifest whose global file records it is a save that did not commit.
inline constexpr std::string_view kCommittedByKey = "committed_by";

struct ResolvedCheckpoint {
  std::filesystem::path dir;
  bool flat = false;  // the flat layout: no manifest, files verified by their own digests
};

// The checkpoint that loading `path` means, in this order:
//  - `path` itself when it holds a manifest;
//  - the newest committed checkpoint under `path` (highest sequence) when it holds one; the error
//    of a committed checkpoint's manifest that cannot be read (which might be the newest),
//    naming it;
//  - never a save's own directory (window-NNNNNN[.K]) without a manifest: IoError naming it, its
//    save did not commit;
//  - `path` as a checkpoint of the flat layout that predates manifests, recognised by what only
//    that layout has: global.safetensors of format pulseloco-checkpoint without kCommittedByKey
//    and the safetensors file of every rank of the world size it records, directly in a
//    directory that is not a save's. IoError naming what it lacks otherwise.
// IoError naming `path` when it holds none of these.
[[nodiscard]] ResolvedCheckpoint resolve_checkpoint_dir(const std::filesystem::path& path);

[[nodiscard]] bool has_manifest(const std::filesystem::path& dir);

// The newest committed checkpoint under `root` (by commit sequence; a checkpoint whose manifest
// cannot be read counts), or nothing when `root` holds none or does not exist.
[[nodiscard]] std::optional<std::filesystem::path> newest_committed_checkpoint(
    const std::filesystem::path& root);

// Written under a temporary name, fsynced, renamed and the directory fsynced: the directory
// becomes a committed checkpoint in one step.
void write_manifest(const std::filesystem::path& dir, const Manifest& manifest);
// ProtocolError naming the manifest when it is not one; IoError when it cannot be read.
[[nodiscard]] Manifest read_manifest(const std::filesystem::path& dir);

// Checks a file's size and xxh3-64 against its record: ProtocolError naming the file otherwise.
void verify_file(const std::filesystem::path& dir, const CheckpointFileRecord& record);

// The file's bytes, once their size and xxh3-64 match the record (ProtocolError naming it).
[[nodiscard]] std::vector<std::byte> read_verified_file(const std::filesystem::path& dir,
                                                        const CheckpointFileRecord& record);

// After `committed` committed under `root`: removes the committed checkpoints older than the
// newest `keep`, and every directory that holds no manifest (leftovers of failed or interrupted
// saves). A checkpoint whose manifest cannot be read is left alone. Nothing it cannot remove is
// an error: it logs a warning.
void remove_old_checkpoints(const std::filesystem::path& root,
                            const std::filesystem::path& committed, std::uint32_t keep) noexcept;
// Removes the directory of a save that did not commit (a warning when it cannot).
void remove_uncommitted(const std::filesystem::path& dir) noexcept;

// Collective: every rank's `payload`, when no rank failed (`error` is null everywhere).
// Otherwise every rank throws the same error: "<what>: rank r: <its error>; ...<consequence>",
// with the failing ranks in its context and the kind of the lowest failing rank's error
// (io, invalid argument or protocol; io for anything else).
[[nodiscard]] std::vector<nlohmann::json> agree(const AttachedGroup& group,
                                                const std::exception_ptr& error,
                                                const nlohmann::json& payload,
                                                std::string_view what,
                                                std::string_view consequence);

}  // namespace pulseloco::engine_detail
