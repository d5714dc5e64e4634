// Test helper: captures what the library logs while it lives.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include <spdlog/sinks/base_sink.h>

#include <pulseloco/base/log.h>

namespace pulseloco::testing {

// Adds a sink to the library's logger for its lifetime, and lowers the logger's level to `level`
// meanwhile where it is higher (PULSELOCO_LOG_LEVEL may have raised it). Create and destroy it
// while nothing else logs (a logger's sinks are not guarded); text() and wait_for() may be
// called while other threads log.
class LogCapture {
 public:
  explicit LogCapture(spdlog::level::level_enum level = spdlog::level::info)
      : previous_level_(logger().level()), sink_(std::make_shared<Sink>()) {
    logger().sinks().push_back(sink_);
    if (level < previous_level_) logger().set_level(level);
  }
  ~LogCapture() {
    logger().set_level(previous_level_);
    logger().sinks().pop_back();
  }
  LogCapture(const LogCapture&) = delete;
  LogCapture& operator=(const LogCapture&) = delete;

  [[nodiscard]] std::string text() const { return sink_->text(); }

  // Waits until the captured text contains `needle`; false when `timeout` passed first.
  [[nodiscard]] bool wait_for(std::string_view needle, std::chrono::milliseconds timeout) const {
    return sink_->wait_for(needle, timeout);
  }

 private:
  class Sink : public spdlog::sinks::base_sink<std::mutex> {
   public:
    std::string text() {
      const std::lock_guard lock(mutex_);
      return text_;
    }
    bool wait_for(std::string_view needle, std::chrono::milliseconds timeout) {
      std::unique_lock lock(mutex_);
      return changed_.wait_for(lock, timeout,
                               [&] { return text_.find(needle) != std::string::npos; });
    }

   protected:
    void sink_it_(const spdlog::details::log_msg& message) override {  // under mutex_
      spdlog::memory_buf_t formatted;
      formatter_->format(message, formatted);
      text_.append(formatted.data(), formatted.size());
      changed_.notify_all();
    }
    void flush_() override {}

   private:
    std::string text_;
    std::condition_variable changed_;
  };

  spdlog::level::level_enum previous_level_;
  std::shared_ptr<Sink> sink_;
};

}  // namespace pulseloco::testing
