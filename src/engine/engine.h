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

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "base/tensor_view.h"
#include "base/thread_pool.h"
#include "engine/options.h"
#include "engine/report.h"
#include "transport/transport.h"

namespace pulseloco {

// A parameter tensor of the user's model (θ_l): contiguous, fp32 or bf16, on the CPU (or a
// CUDA device when built with CUDA). The engine writes it at start-up and after each window.
struct NamedTensor {
  std::string name;
  TensorView view;
  std::vector<std::uint64_t> shape;  // optional, for checkpoint files; empty means {numel}
};

class Engine {
 public:
  // Collective: every rank constructs its engine with the same tensor table and options.
  // Checks that options and the tensor table agree on all ranks, broadcasts rank 0's weights
  // into every replica (θ_g = rank 0's θ_l, θ_l = cast(θ_g), e = 0, m unset, window 0).
  Engine(std::vector<NamedTensor> parameters, EngineOptions options,
         std::unique_ptr<transport::Transport> transport);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Call after every inner optimizer step; every H-th call runs a window (collective) and
  // returns its report.
  [[nodiscard]] std::optional<WindowReport> after_optimizer_step();

  // After a failed window (a failed collective aborts the transport), continues with a newly
  // formed group of the same ranks (collective on it): checks that every rank still holds the
  // same θ_g, m, window counter, options and tensor table, then uses `transport` from now on.
  // The failed window can then be run again.
  void rejoin(std::unique_ptr<transport::Transport> transport);

  // True when the next after_optimizer_step() call will run a window.
  [[nodiscard]] bool next_step_runs_window() const noexcept;

  // Runs a window now (collective), regardless of the step count.
  [[nodiscard]] WindowReport run_window();

  // ddp mode: replaces every gradient by its average over the ranks (collective; call after
  // backward, before the optimizer step). Gradients match the parameters' shapes and dtypes.
  void average_gradients(std::span<const TensorView> gradients);

  // Checkpoint (collective): rank 0 writes `dir/global.safetensors` (θ_g, m, window counter,
  // options); every rank writes `dir/rank-<r>.safetensors` (its residual e).
  void save_checkpoint(const std::filesystem::path& dir);
  // Restores a checkpoint written by a run with the same tensor table, options and world size
  // (collective). Validates everything before changing any state; θ_l is reset to cast(θ_g).
  void load_checkpoint(const std::filesystem::path& dir);

  // Writes this rank's θ_g to one safetensors file (not collective). Replicas that are
  // bit-identical write byte-identical files: the metadata holds only the window and digest.
  void save_global_weights(const std::filesystem::path& file) const;

  // Replaces θ_g, m, e, θ_l and the window counter with the inputs recorded in a window trace
  // (for `pulseloco replay`). Not collective. Validates the file before changing anything.
  void load_trace_inputs(const std::filesystem::path& file);

  [[nodiscard]] int rank() const noexcept;
  [[nodiscard]] int world_size() const noexcept;
  [[nodiscard]] std::uint64_t window() const noexcept;  // windows committed so far
  [[nodiscard]] std::uint64_t parameter_count() const noexcept;
  [[nodiscard]] const EngineOptions& options() const noexcept;
  [[nodiscard]] transport::Transport& transport() noexcept;

  // Read access to the replicated state, for tests and tools (CPU state only).
  [[nodiscard]] std::span<const float> global_weights(std::size_t tensor) const;
  [[nodiscard]] std::span<const float> momentum(std::size_t tensor) const;
  [[nodiscard]] std::span<const float> residual(std::size_t tensor) const;
  [[nodiscard]] Digest state_digest() const;  // combined digest of θ_g and m

  // The implementation (src/engine/engine_impl.h); internal to the engine's sources.
  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace pulseloco
