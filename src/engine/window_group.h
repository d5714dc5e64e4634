// Internal: the group a window runs in, as the window strategies, the join and the files see it
// (the transport, this rank's place in it, the options of the engine's collectives, the phase
// hooks), and the agreement round every mode's commit ends with.
#pragma once

#include <cstdint>
#include <exception>
#include <string_view>

#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/phase_hooks.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::engine_detail {

class WindowGroup {
 public:
  // `observer` may be null (production). Every reference must outlive this object.
  WindowGroup(transport::Transport& transport, const EngineOptions& options, const GroupInfo& info,
              PhaseObserver* observer);

  [[nodiscard]] transport::Transport& transport() const noexcept { return *transport_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world() const noexcept { return world_; }
  [[nodiscard]] std::uint64_t generation() const noexcept { return generation_; }
  // Options of every collective the engine runs: they run one at a time, in the same order on
  // every rank, under one base tag.
  [[nodiscard]] const collectives::CollectiveOptions& collective() const noexcept {
    return collective_;
  }

  // Tells the phase observer, if there is one, that this rank reached `phase` of `window`.
  void reached(WindowPhase phase, std::uint64_t window) const {
    if (observer_ != nullptr) [[unlikely]] {
      observer_->at({phase, window, rank_, worker_, *transport_});
    }
  }

 private:
  transport::Transport* transport_;
  int rank_;
  int world_;
  std::uint64_t generation_;
  std::string_view worker_;
  collectives::CollectiveOptions collective_;
  PhaseObserver* observer_;
};

// The commit vote: every rank says whether it accepted every message of the window; the window
// commits only when all did. Rethrows `local_error` (this rank's reason to reject) once the
// others know; throws ProtocolError naming the ranks that rejected.
void agree_to_commit(const WindowGroup& group, bool accepted,
                     const std::exception_ptr& local_error);

}  // namespace pulseloco::engine_detail
