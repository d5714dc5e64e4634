// Internal: a long wait's progress lines on an Asio io_context (the rendezvous server and
// client, the membership coordinator): calls `line` once per wait_progress_interval() until it
// is stopped or destroyed. Header-only, for the components that run Asio.
#pragma once

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>

#include <chrono>
#include <functional>
#include <utility>

#include <pulseloco/base/log_lines.h>

namespace pulseloco::group {

class ProgressLines {
 public:
  // `line` runs on the io_context's thread and gets the seconds since construction.
  ProgressLines(boost::asio::io_context& io, std::function<void(double seconds)> line)
      : timer_(io), line_(std::move(line)) {
    schedule();
  }
  ~ProgressLines() { stop(); }
  ProgressLines(const ProgressLines&) = delete;
  ProgressLines& operator=(const ProgressLines&) = delete;

  // No more lines (the wait is over).
  void stop() {
    stopped_ = true;
    timer_.cancel();
  }

 private:
  void schedule() {
    const std::chrono::milliseconds interval = progress_.interval();
    if (stopped_ || interval.count() <= 0) return;
    timer_.expires_after(interval);
    timer_.async_wait([this](const boost::system::error_code& error) {
      if (error || stopped_) return;  // cancelled: `this` may be gone
      if (progress_.due()) line_(progress_.seconds());
      schedule();
    });
  }

  boost::asio::steady_timer timer_;
  std::function<void(double)> line_;
  WaitProgress progress_;
  bool stopped_ = false;
};

}  // namespace pulseloco::group
