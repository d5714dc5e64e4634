// What the log says beyond single lines: which rank writes a line that every rank of a group
// would write alike, and how often a long wait says that it goes on.
#pragma once

#include <spdlog/common.h>

#include <chrono>

namespace pulseloco {

// The level of a line that every rank of a group writes alike (a window's summary, a committed
// checkpoint, a regrouping): info on rank 0; debug on the other ranks unless
// PULSELOCO_LOG_ALL_RANKS is 1, so that a group's combined log holds one such line per event.
// Warnings stay every rank's own.
[[nodiscard]] spdlog::level::level_enum shared_line_level(int rank);

// How often a long wait (the rendezvous, a collective waiting for a peer, an elastic regroup)
// logs that it goes on and whom it waits for: PULSELOCO_WAIT_LOG_SECONDS (seconds, fractions
// allowed; default 10; 0 turns the lines off), read when a wait begins.
[[nodiscard]] std::chrono::milliseconds wait_progress_interval();

// Paces a wait's progress lines: due() is true once per interval (wait_progress_interval() when
// constructed), the first time one interval after construction.
class WaitProgress {
 public:
  WaitProgress();
  explicit WaitProgress(std::chrono::milliseconds interval);
  // Whether a progress line is due now; when it is, the next one is due an interval later.
  [[nodiscard]] bool due();
  // Seconds since the wait began.
  [[nodiscard]] double seconds() const;
  [[nodiscard]] std::chrono::milliseconds interval() const noexcept { return interval_; }

 private:
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point next_;
  std::chrono::milliseconds interval_;
};

}  // namespace pulseloco
