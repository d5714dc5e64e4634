// Internal: a DiLoCo window: the dense fp32 pseudo-gradient all-reduced bucket by bucket, then,
// once every rank voted to commit, the averaged outer step (docs/algorithm.md, "Dense
// baselines"). The ranks' sum is held in the state until the vote, so a failed exchange leaves
// θ_g, m and θ_l unchanged.
#pragma once

#include <cstdint>

#include <pulseloco/base/thread_pool.h>
#include <pulseloco/engine/window_strategy.h>

namespace pulseloco::engine_detail {

class DilocoWindow final : public WindowStrategy {
 public:
  DilocoWindow(ReplicatedState& state, const EngineOptions& options, ThreadPool& pool)
      : state_(state), options_(options), pool_(pool) {}

  [[nodiscard]] Mode mode() const noexcept override { return Mode::diloco; }
  void run(const AttachedGroup& group, WindowReport& report) override;

 private:
  struct Exchanged {
    double seconds = 0;                // in the all-reduces
    std::uint64_t received_bytes = 0;  // what the transport received in them
  };
  // Pseudo-gradients, summed over the ranks, held in the state.
  [[nodiscard]] Exchanged exchange(const AttachedGroup& group);
  void apply(int world);

  ReplicatedState& state_;
  const EngineOptions& options_;
  ThreadPool& pool_;
  DenseBuckets buckets_;
};

}  // namespace pulseloco::engine_detail
