// Test helper: captures what the library logs while it lives.
#pragma once

#include <memory>
#include <sstream>
#include <string>

#include <spdlog/sinks/ostream_sink.h>

#include <pulseloco/base/log.h>

namespace pulseloco::testing {

// Adds a sink to the library's logger for its lifetime, and lowers the logger's level to `level`
// meanwhile where it is higher (PULSELOCO_LOG_LEVEL may have raised it). Create and destroy it
// while nothing else logs (a logger's sinks are not guarded).
class LogCapture {
 public:
  explicit LogCapture(spdlog::level::level_enum level = spdlog::level::info)
      : previous_level_(logger().level()) {
    logger().sinks().push_back(std::make_shared<spdlog::sinks::ostream_sink_mt>(lines_));
    if (level < previous_level_) logger().set_level(level);
  }
  ~LogCapture() {
    logger().set_level(previous_level_);
    logger().sinks().pop_back();
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  [[nodiscard]] std::string text() const { return lines_.str(); }

 private:
  spdlog::level::level_enum previous_level_;
  std::ostringstream lines_;
};

}  // namespace pulseloco::testing
