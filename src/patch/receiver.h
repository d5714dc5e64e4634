// Brings a bf16 state to a published version (docs/patches.md): from a publishing directory by
// the shortest path (the fewest bytes: the deltas from the held version, or an anchor and the
// deltas after it), or one delta file at a time. Every file is checked before it changes
// anything: its size and checksum against the manifest, the whole file's validity, the parent
// version and digest against the held state; and after each delta the state's digest against
// the one the file and the manifest name. Any failure throws an error naming the version and
// leaves the held state and version exactly as they were.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string_view>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/patch/bf16_state.h>
#include <pulseloco/patch/manifest.h>
#include <pulseloco/patch/trl_files.h>

namespace pulseloco::patch {

// What a step reads: an anchor, a TRL delta or the same delta as a compact patch.
enum class StepKind : std::uint8_t { anchor, delta, compact };
[[nodiscard]] std::string_view step_kind_name(StepKind kind) noexcept;

struct UpdateStep {
  std::uint64_t version = 0;
  StepKind kind = StepKind::delta;
  std::uint64_t bytes = 0;
};

struct UpdateReport {
  std::optional<std::uint64_t> from;
  std::uint64_t to = 0;
  std::vector<UpdateStep> steps;  // empty when the state was already at the target
  [[nodiscard]] std::uint64_t bytes() const noexcept;
};

class Receiver {
 public:
  Receiver() = default;  // holds no version yet: the first update starts from an anchor
  // A state known to be `version` (a receiver's saved state); its digest is checked against
  // the manifest or the first delta before anything is applied.
  Receiver(Bf16State state, std::uint64_t version);

  // Brings the state to `target` (default: the newest version the manifest lists).
  // `directory` may be an s3://bucket/prefix address (bucket.h): the manifest and the files
  // of the path are fetched, checked against the manifest as they arrive, then applied with
  // the same checks as a directory's.
  // ProtocolError for a corrupted, reordered or foreign file or a state the directory did not
  // publish, IoError for a file that is missing or cannot be read, InvalidArgument for a target
  // the manifest does not list. Each names the version concerned.
  UpdateReport update(const std::filesystem::path& directory,
                      std::optional<std::uint64_t> target = std::nullopt);

  // Applies one patch file, a TRL delta or a compact patch (by its extension, .plsp), to the
  // held state (a receiver fed file by file): its parent version and digest must be the held
  // state's.
  void apply_file(const std::filesystem::path& path);
  // Applies a delta already read (a patch received over TCP, subscriber.h), with the same checks
  // of parent and result. Errors name the delta's version.
  void apply_delta(const Delta& delta);

  [[nodiscard]] const Bf16State& state() const noexcept { return state_; }
  [[nodiscard]] std::optional<std::uint64_t> version() const noexcept { return version_; }

 private:
  Bf16State state_;
  std::optional<std::uint64_t> version_;
};

// Throws the same kind of error with "version V: " in front of its message.
[[noreturn]] void rethrow_for_version(const Error& error, std::uint64_t version);

// The file a step of `entry` reads (the manifest lists it: plan_update's steps).
[[nodiscard]] const ManifestFile& step_file(const ManifestVersion& entry, StepKind kind);

// The steps update() takes from `from` to `target`: the fewest bytes (deltas first on a tie;
// of a version's TRL delta and compact patch, the smaller).
// InvalidArgument when the target is not listed or cannot be reached.
[[nodiscard]] std::vector<UpdateStep> plan_update(const Manifest& manifest,
                                                  std::optional<std::uint64_t> from,
                                                  std::uint64_t target);

}  // namespace pulseloco::patch
