// Internal: how a window runs in one mode. One implementation per mode (docs/algorithm.md), each
// over the engine's replicated state:
//
//   PulseWindow   (pulse_window.h)   gate + encode -> sparse all-gather + validate -> commit
//                                    vote -> aggregate + commit residual + outer step + reset
//   DilocoWindow  (diloco_window.h)  pseudo-gradient -> dense all-reduce per bucket -> commit
//                                    vote -> outer step + reset
//   DdpSync       (ddp_sync.h)       gradients averaged during the steps; the window only
//                                    counts them
//
// The engine runs what is common to every mode around the strategy: the report, traces, the
// window counter, the digests and their comparison.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <vector>

#include <pulseloco/base/tensor_view.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/engine/attached_group.h>
#include <pulseloco/engine/layout.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/replicated_state.h>
#include <pulseloco/engine/report.h>

namespace pulseloco::engine_detail {

class WindowStrategy {
 public:
  virtual ~WindowStrategy() = default;

  [[nodiscard]] virtual Mode mode() const noexcept = 0;

  // Runs this rank's part of the window (collective) and commits it on this rank once every
  // rank has accepted: fills the report's entries, bytes, density and the gate, exchange and
  // apply seconds. A window commits entirely or throws leaving the state unchanged. The engine
  // advances the window counter afterwards.
  virtual void run(const AttachedGroup& group, WindowReport& report) = 0;

  // Mode ddp: replaces every gradient by its average over the ranks (collective). The other
  // modes refuse.
  virtual void average_gradients(const AttachedGroup& group, std::span<const TensorView> gradients);

  // True when the window's exchanges run during the inner steps (ddp): the engine adds them to
  // the window's total time.
  [[nodiscard]] virtual bool exchanges_during_steps() const noexcept { return false; }

  // --- overlapped windows (overlapped_window.h); the blocking strategies have none in flight --

  // After a boundary has verified (collective until then): starts the exchange of the window in
  // flight on the engine's thread.
  virtual void start_in_flight(const AttachedGroup& /*group*/) {}
  // Waits until no exchange runs (its outcome is kept for the next boundary), before anything
  // else uses the transport or replaces it.
  virtual void wait_in_flight() noexcept {}
  // Finishes and applies the window in flight without starting another (collective); false
  // when none is in flight.
  [[nodiscard]] virtual bool complete_in_flight(const AttachedGroup& /*group*/,
                                                WindowReport& /*report*/) {
    return false;
  }
  // The state was replaced from a checkpoint or a trace: forgets any exchange of the state it
  // replaced.
  virtual void state_loaded() {}
};

// The strategy of options.mode over `state`.
[[nodiscard]] std::unique_ptr<WindowStrategy> make_window_strategy(ReplicatedState& state,
                                                                   const EngineOptions& options,
                                                                   ThreadPool& pool);

// --- shared by the strategies ------------------------------------------------------------------

using SteadyClock = std::chrono::steady_clock;

[[nodiscard]] inline double seconds_since(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

// NonFiniteError for element `offset` of `chunk`: the local model diverged, nothing was sent.
[[noreturn]] void throw_non_finite(const ReplicatedState& state, int rank, const ChunkRef& chunk,
                                   std::uint64_t offset);

// The dense modes' all-reduce buffers (diloco, ddp), kept between buckets and windows, where
// the transport takes them: in the state memory's own storage when the transport's
// buffer_device() is the state's device (NCCL on the state's GPU: the payload never crosses to
// the host), in host memory otherwise (the transport stages what it must). One code path for
// every memory: only the buffers' location changes.
class DenseBuckets {
 public:
  // Input and output of at least `elements` floats, placed for `transport`.
  void prepare(StateMemory& memory, const transport::Transport& transport, std::uint64_t elements);
  [[nodiscard]] BucketMemory where() const noexcept { return input_.where; }
  [[nodiscard]] float* input() const noexcept { return input_.values.get(); }
  [[nodiscard]] float* output() const noexcept { return output_.values.get(); }
  // Sums the first `elements` of input() over the group into output() (collective). Returns the
  // payload bytes the transport received meanwhile: the all-reduce's own messages, since
  // nothing else uses the transport during a dense exchange.
  [[nodiscard]] std::uint64_t allreduce(const AttachedGroup& group, std::uint64_t elements) const;

 private:
  Bucket input_;
  Bucket output_;
};

// The commit vote: every rank says whether it accepted every message of the window; the window
// commits only when all did. Rethrows `local_error` (this rank's reason to reject) once the
// others know; throws ProtocolError naming the ranks that rejected.
void agree_to_commit(const AttachedGroup& group, bool accepted,
                     const std::exception_ptr& local_error);
// The vote round alone (collective): the ranks that rejected, the same list on every rank.
[[nodiscard]] std::vector<int> rejecting_ranks(const AttachedGroup& group, bool accepted);
// The error of a rejected vote: `local_error` when this rank rejected, else ProtocolError
// naming `rejecting`.
[[noreturn]] void throw_rejected(const AttachedGroup& group, const std::vector<int>& rejecting,
                                 const std::exception_ptr& local_error);

// entries_sent / parameters (0 for an empty model).
[[nodiscard]] double density_of(const WindowReport& report);

// How much the ranks' sets overlapped in the applied window: elements sent by at least one rank,
// and the sum over ranks of the elements each sent.
struct SetOverlap {
  std::uint64_t union_entries = 0;
  std::uint64_t group_entries = 0;
  std::string_view exchange;  // the kind that ran: exchange_name(), or "allreduce"
};
// Sets the report's exchange, union_entries, group_entries and union_ratio.
void set_overlap(WindowReport& report, const SetOverlap& overlap);

}  // namespace pulseloco::engine_detail
