// Internal: checkpoints and the global weights file, written from and read into the replicated
// state. In a checkpoint's directory rank 0 writes the replicated state (θ_g, m, window counter,
// options) to `global.safetensors`; every rank writes its own residual e to
// `rank-NNNNN.safetensors` (mode ddp: θ_l in place of θ_g and m, no residual) and its own
// files. How the directory commits as a whole is checkpoint_commit.h; the layout is in
// state_files.h and docs/operations.md.
#pragma once

#include <filesystem>
#include <span>
#include <string>

#include <pulseloco/base/thread_pool.h>
#include <pulseloco/engine/attached_group.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/replicated_state.h>

namespace pulseloco::engine_detail {

// Collective (Engine::save_checkpoint): the new checkpoint's directory once it has committed.
// `root_is_this_runs`: this rank's run resumed from a checkpoint under `root` or saved there.
// When no rank's is and `root` holds a committed checkpoint, it is another run's, whose
// checkpoints the removal beyond `save.keep` would delete: InvalidArgument naming it, nothing
// written or removed.
std::filesystem::path save_checkpoint(const ReplicatedState& state, const EngineOptions& options,
                                      const AttachedGroup& group, ThreadPool& pool,
                                      const std::filesystem::path& root, bool root_is_this_runs,
                                      const CheckpointSave& save = {});

// Collective (Engine::load_checkpoint). Verifies the files against the manifest and validates
// every file completely (metadata, tensor table, data digests, the own files `required_files`
// names), and all ranks agree, before any state changes; then θ_l is reset to cast(θ_g).
LoadedCheckpoint load_checkpoint(ReplicatedState& state, const EngineOptions& options,
                                 const AttachedGroup& group, ThreadPool& pool,
                                 const std::filesystem::path& path,
                                 std::span<const std::string> required_files = {});

// θ_g in one file (not collective); the metadata holds only the window and the digest, so
// bit-identical replicas write byte-identical files.
void save_global_weights(const ReplicatedState& state, const EngineOptions& options, int rank,
                         ThreadPool& pool, const std::filesystem::path& file);

}  // namespace pulseloco::engine_detail
