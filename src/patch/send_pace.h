// Internal: when the patch push server (push_server.h) drops a subscriber that does not keep up,
// as a pure policy over the bytes the subscriber took and when. The server tells it what each
// write took, arms a timer for deadline() and drops the subscriber once verdict() names a
// reason; the tests drive it with times of their own.
//
// Two rules, from the moment the server has bytes for the subscriber (a SendPace lives while
// messages are on their way; a subscriber that holds the newest version is never judged):
//  - idle: it took no bytes for `idle_timeout`;
//  - slow: in one of the consecutive windows of `window` that follow that moment, it took fewer
//    than `min_bytes_per_second` times the window's length (0: no such rule).
// Bytes count when the write that carried them completes, in the window where it completes.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace pulseloco::patch {

struct PaceLimits {
  std::chrono::milliseconds idle_timeout{60'000};
  std::uint64_t min_bytes_per_second = 0;
  std::chrono::milliseconds window{60'000};
};

struct PaceVerdict {
  enum class Rule { idle, slow };
  Rule rule = Rule::idle;
  std::string reason;  // "it took no bytes for 60000 ms", "it took 1024 bytes in 60000 ms (...)"
};

class SendPace {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  // The server has bytes for the subscriber from `start`.
  SendPace(const PaceLimits& limits, TimePoint start);

  // A write that took `bytes` completed at `now` (not before the previous one).
  void took(std::uint64_t bytes, TimePoint now);
  // The time by which the subscriber must take more bytes to be kept: the idle deadline, or the
  // end of the first window that is still short of its bytes, whichever comes first.
  [[nodiscard]] TimePoint deadline() const;
  // Why the subscriber is dropped at `now`, or nullopt while it keeps pace.
  [[nodiscard]] std::optional<PaceVerdict> verdict(TimePoint now) const;

 private:
  [[nodiscard]] std::uint64_t window_minimum() const noexcept;
  [[nodiscard]] PaceVerdict slow(std::uint64_t bytes) const;

  PaceLimits limits_;
  TimePoint last_progress_;
  TimePoint window_start_;
  std::uint64_t window_bytes_ = 0;
  std::optional<std::uint64_t> short_window_;  // the bytes of a window that ended short
};

}  // namespace pulseloco::patch
