#include <pulseloco/transport/tcp/progress.h>

#include <boost/asio/post.hpp>

#include <algorithm>

#include <pulseloco/base/log.h>
#include <pulseloco/base/thread_name.h>

namespace pulseloco::transport::tcp {

namespace asio = boost::asio;

namespace {
// The Progress this thread drives through drive_until, if any.
thread_local const Progress* t_driving = nullptr;
}  // namespace

Progress::Progress(asio::io_context& io, std::chrono::microseconds busy_poll)
    : io_(io), busy_poll_(busy_poll) {}

Progress::~Progress() {
  join();
}

void Progress::start_threads(int count, std::function<void(const std::exception&)> on_error) {
  thread_count_ = count;
  for (int i = 0; i < count; ++i) {
    threads_.emplace_back([this, on_error] { run_thread(on_error); });
    set_thread_name(threads_.back().native_handle(), "pl-tcp-io");
  }
}

void Progress::join() noexcept {
  {
    const std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  parked_changed_.notify_all();
  for (auto& thread : threads_)
    if (thread.joinable()) thread.join();
  threads_.clear();
}

void Progress::run_thread(const std::function<void(const std::exception&)>& on_error) {
  for (;;) {
    try {
      io_thread_loop();
      break;
    } catch (const std::exception& error) {
      on_error(error);
    }
  }
  // A driver waiting for this thread to park (begin_driving) stops waiting for it.
  {
    const std::lock_guard lock(mutex_);
    ++exited_;
  }
  parked_changed_.notify_all();
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
      if (drivers_ > 0) {
        // A driver may be waiting for this (begin_driving); and a handler this thread ran just
        // now may have completed what a driver blocked in the reactor waits for.
        parked_changed_.notify_all();
        wake_drivers();
      }
    }
    // A driver that leaves does not wake this thread (that would cost the hand-over this class
    // saves); it moves resume_at_, which this thread looks at every kLinger.
    changed_.wait_until(lock, drivers_ > 0 ? Clock::now() + kLinger : resume_at_);
  }
  if (parked) --parked_;
  return !stopping_ && !io_.stopped();
}

bool Progress::begin_driving() {
  const std::lock_guard lock(mutex_);
  ++drivers_;
  t_driving = this;
  return all_threads_parked();
}

void Progress::await_io_threads_parked(Clock::time_point deadline) {
  // An I/O thread is inside the io_context, most likely blocked in epoll_wait, where it holds
  // the reactor: this caller could then only run handlers, never collect a socket event. A
  // handler wakes it; it parks on its way out of the io_context once it has run one (or at
  // once, if it was polling). Meanwhile this caller stays out of the io_context: there it would
  // only take the very handler meant for the I/O thread (the I/O thread, left in the reactor,
  // would then keep every socket event from the caller until its next wake-up), and spin.
  // The handler wakes one thread (an idle one waiting for handlers before the one in the
  // reactor); each thread that parks while a caller drives posts another
  // (park_while_callers_drive), which wakes the next one still inside.
  asio::post(io_, [] {});
  // The I/O thread usually parks within microseconds: poll for that, yielding the core (it may
  // be this one), for at most busy_poll, then sleep until it parks.
  const auto poll_until = std::min(deadline, Clock::now() + busy_poll_);
  while (Clock::now() < poll_until) {
    if (all_threads_parked() || io_.stopped()) return;
    std::this_thread::yield();
  }
  std::unique_lock lock(mutex_);
  // In slices, so that a stopped io_context (nobody notifies of that) ends the wait too. An I/O
  // thread parks or exits under mutex_, so its notification cannot slip in between the check
  // and the wait.
  while (!all_threads_parked() && !stopping_ && !io_.stopped() && Clock::now() < deadline) {
    parked_changed_.wait_until(lock, std::min(deadline, Clock::now() + kLinger));
  }
}

bool Progress::all_threads_parked() const noexcept {
  return parked_.load() + exited_.load() >= thread_count_;
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
  // Done already: no need to take the io_context from the I/O threads.
  if (ready()) return true;
  const bool io_threads_parked = begin_driving();
  struct EndDriving {
    Progress& progress;
    ~EndDriving() { progress.end_driving(); }
  } const end{*this};
  if (!io_threads_parked) await_io_threads_parked(deadline);
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
