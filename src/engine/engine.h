// The window engine: owns the replicated state (θ_g, m) and this rank's residual (e) for every
// parameter tensor, and runs windows (pulseloco-algorithm.md steps 1-10):
//
//   gate -> encode -> sparse all-gather -> decode+validate -> aggregate -> commit residual ->
//   outer step -> reset -> verify digests
//
// A window either commits on this rank entirely or leaves θ_g, m, e and θ_l untouched (every
// received message is fully validated before the first state write), so a failed exchange can
// be retried. Modes diloco and ddp run the dense baselines with the same bookkeeping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <pulseloco/base/tensor_view.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/report.h>
#include <pulseloco/engine/window_runner.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco {

// A parameter tensor of the user's model (θ_l): contiguous, fp32 or bf16, on the CPU (or a
// CUDA device when built with CUDA). The engine writes it at start-up and after each window.
struct NamedTensor {
  std::string name;
  TensorView view;
  std::vector<std::uint64_t> shape;  // optional, for checkpoint files; empty means {numel}
};

// A file of the embedding program's own state for this rank (such as its inner optimizer's,
// serialised), saved with a checkpoint as `rank-NNNNN.<name>` and verified when loaded.
struct CheckpointFile {
  std::string name;  // letters, digits, '.', '_' and '-'; unique among this rank's files
  std::vector<std::byte> bytes;
};

struct CheckpointSave {
  std::uint32_t keep = 2;             // committed checkpoints kept under the root (at least 1)
  std::vector<CheckpointFile> files;  // this rank's own files
};

struct LoadedCheckpoint {
  std::filesystem::path dir;  // the checkpoint directory loaded
  std::uint64_t window = 0;   // windows it had committed (Engine::committed_windows())
  // Where the data loop continues: the number the next boundary's window gets
  // (Engine::next_window()) and its first inner step, next_window * steps_per_window. With
  // overlapped windows a window was in flight when the checkpoint was taken, so these run one
  // ahead of `window`: resuming the data from `window` would train a window twice.
  std::uint64_t next_window = 0;
  std::uint64_t next_step = 0;
  std::vector<CheckpointFile> files;  // this rank's own files, verified
};

// Which group an engine belongs to (attach()): for reports, logs and traces.
struct GroupInfo {
  std::uint64_t generation = 0;      // 0 for a fixed group; 1, 2, ... in an elastic run
  std::vector<std::string> members;  // worker ids in rank order; empty: "rank-<r>"
  // This rank's node: ranks with the same name share a host and its link to the others
  // (EngineOptions::node_aware). Empty: PULSELOCO_NODE, else the host name.
  std::string node;
};

class Engine final : public WindowRunner {
 public:
  // Collective: every rank constructs its engine with the same tensor table and options.
  // Checks that options and the tensor table agree on all ranks, broadcasts rank 0's weights
  // into every replica (θ_g = rank 0's θ_l, θ_l = cast(θ_g), e = 0, m unset, window 0).
  // Equivalent to Engine(parameters, options) followed by attach(transport).
  Engine(std::vector<NamedTensor> parameters, EngineOptions options,
         std::unique_ptr<transport::Transport> transport);
  // Not collective: an engine that belongs to no group yet and holds no replicated state. Throws
  // InvalidArgument at once for invalid options or parameters. Call attach() before any window.
  Engine(std::vector<NamedTensor> parameters, EngineOptions options);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Call after every inner optimizer step; every H-th call runs a window (collective) and
  // returns its report.
  [[nodiscard]] std::optional<WindowReport> after_optimizer_step() override;

  // Makes this engine a member of the group `transport` connects (collective on it): the first
  // group of a run, or a new group after a failure or a membership change (elastic runs,
  // docs/elastic.md). Every member calls it. In turn:
  //  - options and tensor tables must agree on every rank (InvalidArgument otherwise);
  //  - when no member holds state yet, rank 0's θ_l becomes everyone's (as the first
  //    constructor does);
  //  - otherwise the members with the most windows committed (W) must hold identical θ_g and
  //    m (DivergenceError otherwise); the lowest-ranked of them sends θ_g, m and the window
  //    counters to every member that is behind: a new member (its residual starts at 0), or a
  //    member with W - 1 committed that had accepted the messages of the next window when the
  //    old group failed before it learnt the outcome (it commits its residual of that window
  //    first, so nothing is lost);
  //    members that are behind in any other way are re-synchronised the same way with e = 0,
  //    with a warning. Their θ_l is reset to cast(θ_g); up-to-date members keep theirs.
  //  - the digests of θ_g and m are compared on every rank (DivergenceError naming the ranks).
  // A failure inside attach() (another member lost) leaves this engine ready for the next
  // attach(); a member that was receiving state then counts as new.
  void attach(std::unique_ptr<transport::Transport> transport, GroupInfo group = {});

  // Destroys the transport (after a failed window, before forming the next group; its
  // listening port is then free again). The state is kept.
  void detach() noexcept;

  // After run_window() or after_optimizer_step() threw: the report of that window if it had
  // committed on this rank before the failure (its digests are then compared by the next
  // attach()); empty otherwise. Clears it.
  [[nodiscard]] std::optional<WindowReport> take_committed_report();

  // True when the next after_optimizer_step() call will run a window.
  [[nodiscard]] bool next_step_runs_window() const noexcept;

  // Runs a window now (collective), regardless of the step count.
  [[nodiscard]] WindowReport run_window() override;

  // Overlapped windows (EngineOptions::overlap): finishes the window in flight and applies its
  // outer step without starting another (collective), e.g. at the end of training, so that the
  // final θ_g includes every window. Returns that boundary's report (its `window` is the applied
  // one; no message was sent), or nothing when no window is in flight (blocking runs, or nothing
  // since the last call). The next boundary then starts from the state this leaves: θ_l is
  // reset to cast(θ_g).
  [[nodiscard]] std::optional<WindowReport> complete_in_flight() override;

  // True while a window's message has been sent but its outer step not applied (overlapped
  // windows between boundaries).
  [[nodiscard]] bool window_in_flight() const noexcept;

  // ddp mode: replaces every gradient by its average over the ranks (collective; call after
  // backward, before the optimizer step). Gradients match the parameters' shapes and dtypes and
  // are where the state is: host memory, or the parameters' CUDA device with state on the device
  // (ordered after the stream set_cuda_stream gave).
  void average_gradients(std::span<const TensorView> gradients);

  // Checkpoint (collective): writes a new directory under the checkpoint root `root`,
  // `window-NNNNNN` (docs/operations.md, "Checkpoints"): rank 0's `global.safetensors` (θ_g, m,
  // window counter, options), every rank's `rank-NNNNN.safetensors` (its residual e) and its
  // own files (`save.files`), then `manifest.json`, which rank 0 writes once every rank has
  // written its files and which lists every file with its xxh3-64. Only then is it a checkpoint;
  // rank 0 then removes the committed checkpoints beyond the newest `save.keep` (its value
  // counts) and directories without a manifest. Returns the new directory. A failure on any
  // rank (a full disk) throws the same error on every rank, naming each failing rank and its
  // error (kind io for the OS's errors), and leaves the committed checkpoints as they were. A
  // root that holds checkpoints this run neither resumed from (load_checkpoint) nor saved is
  // another run's: InvalidArgument naming it, before anything is written or removed.
  std::filesystem::path save_checkpoint(const std::filesystem::path& root,
                                        const CheckpointSave& save = {});
  // Restores a checkpoint written by a run with the same tensor table, options and world size
  // (collective): `path` is a checkpoint directory, or a root whose newest committed checkpoint
  // (the one committed last) is loaded (IoError when it has none). A directory without a
  // manifest never loads (IoError naming it: its save did not commit), unless it is a checkpoint
  // of the flat layout that predates manifests (docs/operations.md, "Resuming"). Verifies every
  // file this rank reads against the manifest and validates everything, and all ranks agree, before
  // changing any state; a damaged file is an error on every rank naming it. θ_l is reset to
  // cast(θ_g). Returns the directory, its window, where the data loop continues (next_window,
  // next_step) and this rank's own files. `required_files`: own files this rank needs (its
  // optimizer's state): a checkpoint without one of them is refused like a damaged one, on
  // every rank, naming the file and the ranks that lack it, before any state changes.
  LoadedCheckpoint load_checkpoint(const std::filesystem::path& path,
                                   std::span<const std::string> required_files = {});

  // Writes this rank's θ_g to one safetensors file (not collective). Replicas that are
  // bit-identical write byte-identical files: the metadata holds only the window and digest.
  void save_global_weights(const std::filesystem::path& file) const;

  // Replaces θ_g, m, e, θ_l and the window counter with the inputs recorded in a window trace
  // (for `pulseloco replay`). Not collective. Validates the file before changing anything.
  void load_trace_inputs(const std::filesystem::path& file);

  // WindowRunner: this engine itself.
  [[nodiscard]] Engine& engine() noexcept override { return *this; }

  [[nodiscard]] int rank() const noexcept;
  [[nodiscard]] int world_size() const noexcept;
  // Windows committed so far (outer steps applied). Not a window number: reports and logs number
  // windows as next_window() does, and the two part once a window was dropped.
  [[nodiscard]] std::uint64_t committed_windows() const noexcept;
  // The number the next boundary's window will carry (its report's `window`):
  // committed_windows() when blocking; with overlapped windows one more while a window is in
  // flight, plus the windows dropped so far. A loop resumed from a checkpoint continues its data
  // from here.
  [[nodiscard]] std::uint64_t next_window() const noexcept;
  [[nodiscard]] std::uint64_t parameter_count() const noexcept;
  [[nodiscard]] const EngineOptions& options() const noexcept;
  [[nodiscard]] transport::Transport& transport();  // InvalidArgument when detached
  [[nodiscard]] const GroupInfo& group() const noexcept;

  // Read access to the replicated state, for tests and tools: views of host state (state on a
  // device: InvalidArgument; use copy_state).
  [[nodiscard]] std::span<const float> global_weights(std::size_t tensor) const;
  [[nodiscard]] std::span<const float> momentum(std::size_t tensor) const;
  [[nodiscard]] std::span<const float> residual(std::size_t tensor) const;
  // A host copy of one tensor's θ_g, m or e, wherever the state lives.
  enum class StateTensor : std::uint8_t { global_weights, momentum, residual };
  [[nodiscard]] std::vector<float> copy_state(StateTensor which, std::size_t tensor) const;
  [[nodiscard]] Digest state_digest() const;  // combined digest of θ_g and m
  // Where this rank keeps θ_g, m and e: "host" or "cuda:<ordinal>".
  [[nodiscard]] std::string state_location() const;

  // The CUDA stream (a cudaStream_t of the parameters' device; nullptr: the legacy default
  // stream) whose work the engine's device work must follow, and which must follow it: each
  // window, attach and file operation waits for the work `stream` holds when it starts, and
  // work enqueued on `stream` afterwards waits for it (events; no device-wide synchronisation).
  // Ignored when the state is in host memory.
  void set_cuda_stream(void* stream);

  // The implementation (src/engine/engine_impl.h); internal to the engine's sources.
  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The newest committed checkpoint under the checkpoint root `root` (the one committed last), or
// nothing when it holds none or does not exist; IoError when it is not a directory or cannot be
// listed. Not collective: a launcher's check before a run saves where another run's checkpoints
// are.
[[nodiscard]] std::optional<std::filesystem::path> newest_checkpoint(
    const std::filesystem::path& root);

}  // namespace pulseloco
