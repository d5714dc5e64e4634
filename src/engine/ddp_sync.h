// Internal: data-parallel synchronisation: every gradient averaged over the ranks after each
// backward pass (Engine::average_gradients), no outer step. Its "window" runs no exchange of its
// own: it reports what the window's gradient all-reduces moved, and the engine compares the
// replicas' weights by digest.
#pragma once

#include <cstdint>

#include <pulseloco/engine/window_strategy.h>

namespace pulseloco::engine_detail {

class DdpSync final : public WindowStrategy {
 public:
  explicit DdpSync(const ReplicatedState& state) : state_(state) {}

  [[nodiscard]] Mode mode() const noexcept override { return Mode::ddp; }
  void run(const AttachedGroup& group, WindowReport& report) override;
  // Gradients match the parameters' sizes and dtypes and are on the parameters' device
  // (InvalidArgument).
  void average_gradients(const AttachedGroup& group,
                         std::span<const TensorView> gradients) override;
  [[nodiscard]] bool exchanges_during_steps() const noexcept override { return true; }

 private:
  const ReplicatedState& state_;
  DenseBuckets buckets_;
  // What the gradient all-reduces of the current window moved (this rank's gradients, what the
  // transport received), and how long they took.
  std::uint64_t payload_bytes_ = 0;
  std::uint64_t received_bytes_ = 0;
  double exchange_seconds_ = 0;
  double exchange_wait_seconds_ = 0;  // of exchange_seconds_: waiting for peers to join
};

}  // namespace pulseloco::engine_detail
