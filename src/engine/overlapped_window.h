// Internal: PULSELoCo windows whose exchange overlaps the next window's inner steps
// (EngineOptions::overlap = delayed | eager; docs/algorithm.md, "Overlapped windows"). A
// boundary finishes the window in flight (wait, vote), gates the window that just ended against
// its start point and commits its residual, applies the finished window's outer step, restarts
// θ_l, and (after the engine has verified the digests) starts the new window's exchange on a
// thread of its own. The phases are PulseWindow's; only their order and timing differ.
//
// The message in flight lives in the replicated state (checkpoints and traces record it); this
// class holds only the running exchange. Nothing but that thread touches the transport while an
// exchange runs: the engine waits for it (wait_in_flight) before any other collective.
#pragma once

#include <future>
#include <optional>

#include <pulseloco/engine/pulse_window.h>

namespace pulseloco::engine_detail {

class OverlappedPulseWindow final : public WindowStrategy {
 public:
  OverlappedPulseWindow(ReplicatedState& state, const EngineOptions& options, ThreadPool& pool)
      : state_(state), options_(options), pool_(pool), window_(state, options, pool) {}
  ~OverlappedPulseWindow() override { wait_in_flight(); }
  OverlappedPulseWindow(const OverlappedPulseWindow&) = delete;
  OverlappedPulseWindow& operator=(const OverlappedPulseWindow&) = delete;

  [[nodiscard]] Mode mode() const noexcept override { return Mode::pulse; }
  void run(const AttachedGroup& group, WindowReport& report) override;
  void start_in_flight(const AttachedGroup& group) override;
  void wait_in_flight() noexcept override;
  [[nodiscard]] bool complete_in_flight(const AttachedGroup& group, WindowReport& report) override;
  void state_loaded() override;

 private:
  // What the exchange thread hands back.
  struct Exchanged {
    ReceivedMessages received;
    double seconds = 0;
    SteadyClock::time_point started;  // when the exchange began
    double wait_seconds = 0;          // of `seconds`: its first part, waiting for peers to join
  };

  // Waits for the window in flight's exchange (runs it here when none runs: a retry, or the
  // state was loaded) and votes. A transport failure keeps the window in flight (the next call
  // retries it); a rejected vote drops it on every rank. Fills the exchange times and bytes.
  [[nodiscard]] ReceivedMessages finish(const AttachedGroup& group, WindowReport& report);
  // Steps 7-9 of the finished window without the residual commit; counts it.
  void apply(const ReceivedMessages& received, WindowReport& report);
  // With overlap eager: S from θ_g, m and the message in flight, and θ_l = cast(S).
  void start_from_own();

  ReplicatedState& state_;
  const EngineOptions& options_;
  ThreadPool& pool_;
  PulseWindow window_;
  std::future<Exchanged> exchange_;  // valid while an exchange runs or its outcome is unread
};

// Puts the message in flight's entries back into e and forgets it (a dropped window, whose
// number is not used again), and clears the accepted window: its progress is sent again by a
// later window. No-op when none.
void drop_in_flight(ReplicatedState& state, ThreadPool& pool);

}  // namespace pulseloco::engine_detail
