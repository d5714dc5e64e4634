// Internal: warnings that strangers can cause (failed accepts, refused or dropped connections)
// go through a LogThrottle, so that a flood of connections cannot flood the log: at most `burst`
// lines per kInterval, and the first line logged after some were left out says how many.
#pragma once

#include <chrono>
#include <cstddef>
#include <mutex>
#include <string>

#include <pulseloco/base/log.h>

namespace pulseloco::transport::tcp {

class LogThrottle {
 public:
  static constexpr std::chrono::seconds kInterval{5};

  explicit LogThrottle(std::size_t burst) : burst_(burst) {}

  // Logs `line` at warning level unless `burst` lines were logged in the current interval; then
  // only counts it. Thread-safe.
  void warn(const std::string& line) {
    const std::lock_guard lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    if (now - interval_start_ >= kInterval) {
      interval_start_ = now;
      logged_ = 0;
    }
    if (logged_ >= burst_) {
      ++suppressed_;
      return;
    }
    ++logged_;
    if (suppressed_ == 0) {
      logger().warn("{}", line);
    } else {
      logger().warn("{} ({} similar lines left out before this one)", line, suppressed_);
      suppressed_ = 0;
    }
  }

  // Lines counted but not logged since the last line that was logged.
  [[nodiscard]] std::size_t suppressed() const {
    const std::lock_guard lock(mutex_);
    return suppressed_;
  }

 private:
  const std::size_t burst_;
  mutable std::mutex mutex_;
  std::chrono::steady_clock::time_point interval_start_{};
  std::size_t logged_ = 0;
  std::size_t suppressed_ = 0;
};

}  // namespace pulseloco::transport::tcp
