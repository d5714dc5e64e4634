// Internal: the group an engine is attached to, as the window strategies, the join and the files
// see it: the transport, this rank's place in it, the options of the engine's collectives and
// the phase hooks.
#pragma once

#include <cstdint>
#include <string_view>

#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/phase_hooks.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::engine_detail {

class AttachedGroup {
 public:
  // `observer` may be null (production). Every reference must outlive this object.
  AttachedGroup(transport::Transport& transport, const EngineOptions& options,
                const GroupInfo& info, const collectives::NodeLayout* nodes,
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

  // The group's nodes when pulse windows exchange node-aware; null: flat.
  [[nodiscard]] const collectives::NodeLayout* nodes() const noexcept { return nodes_; }

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
  const collectives::NodeLayout* nodes_;
  PhaseObserver* observer_;
};

}  // namespace pulseloco::engine_detail
