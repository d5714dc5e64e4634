// Internal: what an Engine is made of. The replicated state (replicated_state.h) and the window
// strategy of its mode (window_strategy.h) do the work; joining a group (group_join.h),
// checkpoints (checkpoint.h) and traces (trace.h) work on the state; the phase observer is
// the tests' seam for faults (phase_hooks.h), null in production.
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include <pulseloco/base/thread_pool.h>
#include <pulseloco/engine/attached_group.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/phase_hooks.h>
#include <pulseloco/engine/replicated_state.h>
#include <pulseloco/engine/weight_publishing.h>
#include <pulseloco/engine/window_strategy.h>

namespace pulseloco {

struct Engine::Impl {
  EngineOptions options;
  ThreadPool pool;
  engine_detail::ReplicatedState state;
  // Set by attach(): the strategy of options.mode.
  std::unique_ptr<engine_detail::WindowStrategy> strategy;
  std::unique_ptr<transport::Transport> transport;
  int rank = 0;
  int world = 1;
  GroupInfo group;
  // The group's nodes when pulse windows exchange node-aware (engine/node_layout.h), set by
  // attach(); empty: flat.
  std::optional<collectives::NodeLayout> nodes;
  // An invalid parameter table found by the constructor, reported in the first attach's
  // agreement round so that every rank fails at once.
  std::exception_ptr setup_error;
  std::optional<WindowReport> committed_report;  // see Engine::take_committed_report()
  std::uint64_t steps_in_window = 0;             // optimizer steps since the last window
  // ddp: average_gradients() calls since the last window, and whether the window being finished
  // had fewer of them than optimizer steps (a forgotten before_optimizer_step(), named in the
  // warning and in a DivergenceError).
  std::uint64_t gradient_averages = 0;
  bool gradients_not_averaged = false;
  bool warned_gradients_not_averaged = false;
  transport::TransportStats stats_at_window_start{};
  // PULSELOCO_FAULT's injector (engine/fault_injection.h) in tests; null in production.
  std::unique_ptr<PhaseObserver> phase_observer;
  engine_detail::WeightPublishing publishing{options};  // θ_g for inference servers (rank 0)
  // The checkpoint roots this run resumed from or saved into (as root_identity() in engine.cpp
  // gives them): saving into another root that holds checkpoints is refused
  // (engine_detail::save_checkpoint).
  std::vector<std::filesystem::path> checkpoint_roots;

  explicit Impl(EngineOptions opts) : options(std::move(opts)), pool(options.threads) {}

  // Validates the options (throws) and the parameters (records the error in setup_error).
  void prepare(std::vector<NamedTensor> parameters);
  void attach(std::unique_ptr<transport::Transport> replacement, GroupInfo info);
  // The group attached to; InvalidArgument when detached.
  [[nodiscard]] engine_detail::AttachedGroup attached_group() const;

  [[nodiscard]] WindowReport new_report() const;  // the common fields of a boundary's report
  WindowReport run_window();
  [[nodiscard]] std::optional<WindowReport> complete_in_flight();
  // Digests, verification, publishing, transport counters, the log line; then the window in
  // flight's exchange starts (overlapped windows).
  void finish_boundary(const engine_detail::AttachedGroup& attached, WindowReport& report,
                       engine_detail::SteadyClock::time_point start);
  // No exchange of a window in flight runs when this returns.
  void wait_in_flight() noexcept;
  // Step 10: every rank's digest compared (DivergenceError naming the ranks off the majority,
  // or every digest and its ranks when no digest has a majority).
  void verify(const engine_detail::AttachedGroup& group, WindowReport& report) const;
};

}  // namespace pulseloco
