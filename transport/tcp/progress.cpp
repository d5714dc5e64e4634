#include "transport/tcp/progress.h"

#include <boost/asio/post.hpp>

#include <algorithm>

#include "base/log.h"

namespace pulseloco::transport::tcp {

namespace asio = boost::asio;

namespace {
// The Progress this thread drives through drive_until, if any.
thread_local const Progress* t_driving = nullptr;
// This thread is an I/O thread (of any Progress).
thread_local bool t_io_thread = false;
}  // namespace

Progress::Progress(asio::io_context& io, std::chrono::microseconds busy_poll)
    : io_(io), busy_poll_(busy_poll) {}

Progress::~Progress() {
  join();
}

void Progress::start_threads(int count, std::function<void(const std::exception&)> on_error) {
  thread_count_ = count;
  for (int i = 0; i < count; ++i)
    threads_.emplace_back([this, on_error] { run_thread(on_error); });
}

void Progress::join() noexcept {
  {
    const std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  for (auto& thread : threads_)
    if (thread.joinable()) thread.join();
  threads_.clear();
}

void Progress::run_thread(const std::function<void(const std::exception&)>& on_error) {
  t_io_thread = true;
  for (;;) {
    try {
      io_thread_loop();
      return;
    } catch (const std::exception& error) {
      on_error(error);
    }
  }
}

void Progress::io_thread_loop() {
  while (park_while_callers_drive()) {
    // Sleep in the reactor until something happens: a socket event, a posted handler, or a
    // caller that wants to drive.
    if (io_.run_one() == 0) return;  // stopped
    // Then poll, yielding the core in between, until nothing has been ready for busy_poll (the
    // next frame of a collective round usually follows within microseconds), unless a caller
    // takes over.
    auto idle_until = Clock::now() + busy_poll_;
    while (!io_.stopped() && drivers_.load() == 0) {
      if (io_.poll() > 0) {
        idle_until = Clock::now() + busy_poll_;
      } else if (Clock::now() >= idle_until) {
        break;
      } else {
        std::this_thread::yield();
      }
    }
  }
}

bool Progress::park_while_callers_drive() {
  std::unique_lock lock(mutex_);
  bool parked = false;
  for (;;) {
    if (stopping_ || io_.stopped()) break;
    if (drivers_ == 0 && Clock::now() >= resume_at_) break;
    if (!parked) {
      parked = true;
      ++parked_;
      // A handler this thread ran just now may have completed what a driver blocked in the
      // reactor waits for.
      if (drivers_ > 0) wake_drivers();
    }
    // A driver that leaves does not wake this thread (that would cost the hand-over this class
    // saves); it moves resume_at_, which this thread looks at every kLinger.
    changed_.wait_until(lock, drivers_ > 0 ? Clock::now() + kLinger : resume_at_);
  }
  if (parked) --parked_;
  return !stopping_ && !io_.stopped();
}

void Progress::begin_driving() {
  bool wake = false;
  {
    const std::lock_guard lock(mutex_);
    ++drivers_;
    wake = parked_.load() < thread_count_;
  }
  t_driving = this;
  if (wake) nudge_io_threads();
}

void Progress::nudge_io_threads() {
  // An I/O thread blocked in epoll_wait holds the reactor: a handler interrupts it, and it parks
  // on its way out of the io_context once it has run one. Should a driver run this handler
  // first, the I/O thread may still be inside: the handler then stays queued for it.
  asio::post(io_, [this] {
    if (!t_io_thread && drivers_.load() > 0 && parked_.load() < thread_count_) nudge_io_threads();
  });
}

void Progress::end_driving() noexcept {
  t_driving = nullptr;
  const std::lock_guard lock(mutex_);
  --drivers_;
  resume_at_ = std::max(resume_at_, Clock::now() + kLinger);
}

void Progress::wake_drivers() {
  asio::post(io_, [] {});
}

void Progress::completion_happened() {
  const int drivers = drivers_.load();
  if (drivers == 0) return;
  // The only driver, running a handler: it looks at its operation after every handler.
  if (drivers == 1 && t_driving == this) return;
  wake_drivers();
}

std::size_t Progress::run_one(bool block, Clock::time_point deadline) noexcept {
  try {
    return block ? io_.run_one_until(deadline) : io_.poll_one();
  } catch (const std::exception& error) {
    // The operations a handler concerns fail through their own errors; this is a bug report.
    logger().error("tcp transport: unexpected error in a handler run by a waiting caller: {}",
                   error.what());
    return 1;
  }
}

bool Progress::drive_until(const std::function<bool()>& ready, Clock::time_point deadline) {
  begin_driving();
  struct EndDriving {
    Progress& progress;
    ~EndDriving() { progress.end_driving(); }
  } const end{*this};
  auto idle_until = std::min(deadline, Clock::now() + busy_poll_);
  for (;;) {
    if (ready()) return true;
    const auto now = Clock::now();
    if (now >= deadline || io_.stopped()) return false;
    if (now < idle_until) {
      if (run_one(false, deadline) > 0) {
        idle_until = std::min(deadline, now + busy_poll_);
      } else {
        std::this_thread::yield();
      }
    } else if (run_one(true, deadline) > 0) {
      idle_until = std::min(deadline, Clock::now() + busy_poll_);  // traffic again: poll
    }
  }
}

}  // namespace pulseloco::transport::tcp
