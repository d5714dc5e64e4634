// Internal: who runs a TCP transport's io_context: a caller waiting on an operation, or the
// transport's I/O threads when nobody waits.
//
// Why: when an I/O thread owns the reactor, every message crosses threads twice (the I/O
// thread reads a frame and wakes the waiting caller; the caller's next send wakes the I/O
// thread), and every arrival needs the sleeping I/O thread to be scheduled. On a machine with
// more busy threads than cores (several ranks per machine, or a training process) a woken
// thread can wait a whole scheduler slice for a core, which dominates a small exchange
// (docs/benchmarks.md, "Transports: point-to-point throughput", measures what this class
// gives). MPI's progress engine avoids the hand-overs by having the waiting thread drive its
// sockets itself, and so does this one:
//
//  - A caller in wait() is a driver (drive_until): it runs the io_context itself, the reactor
//    and every ready handler, until its operation completes. It polls without blocking while
//    handlers keep running and for busy_poll after the last (a frame of the same collective
//    round usually follows within microseconds), then blocks in the reactor (epoll), still as
//    the driver: nobody has to wake it but the socket event it waits for.
//  - While a caller drives, the I/O threads step aside: they park outside the io_context,
//    because a thread blocked in epoll_wait holds the reactor, and the caller could then only
//    run handlers, never collect a socket event itself. A caller that starts driving while an
//    I/O thread is inside the io_context posts a handler to wake it (one wake-up per stretch
//    of waits, not per message) and stays out of the io_context until it has parked (polling
//    for busy_poll, then sleeping). Were the caller to run the io_context meanwhile, it would
//    take that very handler, leave the I/O thread in the reactor and spin (re-posting the
//    handler, locking the scheduler, reading the clock) until the I/O thread got a core: every
//    collective that started after more than kLinger of idleness paid for that.
//  - The I/O threads stay parked for kLinger after the last driver left: a collective's next
//    wait follows within microseconds, and calling the I/O thread back for the gap would cost
//    the hand-over this class exists to avoid. After that they run the io_context again, so
//    that sends and reads progress while the caller computes or sleeps elsewhere.
//  - A completion noticed by a thread other than the one driver (an I/O thread about to park,
//    a second driver, abort() on another thread) posts an empty handler, so that a driver
//    blocked in the reactor looks at its operation again (completion_happened()).
//
// With busy_poll zero nobody polls: drivers block in the reactor at once, and an I/O thread
// sleeps in the reactor as soon as it has no handler left to run.
#pragma once

#include <atomic>
#include <boost/asio/io_context.hpp>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pulseloco::transport::tcp {

class Progress {
 public:
  using Clock = std::chrono::steady_clock;
  // How long the I/O threads stay parked after the last driver left (see above). Long against
  // the gaps between the waits of one collective and between back-to-back collectives (tens of
  // microseconds to a few milliseconds), short against what a send nobody waits for may be
  // kept back.
  static constexpr std::chrono::milliseconds kLinger{5};

  Progress(boost::asio::io_context& io, std::chrono::microseconds busy_poll);
  ~Progress();  // joins the I/O threads (stop the io_context first)
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Starts `count` I/O threads. An exception escaping a handler on one of them goes to
  // `on_error`, and the thread carries on.
  void start_threads(int count, std::function<void(const std::exception&)> on_error);
  [[nodiscard]] bool has_threads() const noexcept { return !threads_.empty(); }
  // Wakes parked threads so that they see the stopped io_context, and joins them.
  void join() noexcept;

  // Callers in drive_until now, and I/O threads parked outside the io_context.
  [[nodiscard]] int drivers() const noexcept { return drivers_.load(); }
  [[nodiscard]] int parked_threads() const noexcept { return parked_.load(); }

  // An operation completed or failed (call after changing it, outside the transport's lock):
  // wakes the drivers that might not otherwise look at it.
  void completion_happened();

  // A caller waiting for `ready`: runs the io_context until ready() holds or `deadline`
  // passes (returns ready()'s last value). ready() is called after every handler.
  [[nodiscard]] bool drive_until(const std::function<bool()>& ready, Clock::time_point deadline);

 private:
  void run_thread(const std::function<void(const std::exception&)>& on_error);
  void io_thread_loop();
  // Blocks while callers drive or drove less than kLinger ago; false once stopped.
  bool park_while_callers_drive();
  // Counts this thread as a driver (until end_driving); true when every I/O thread is parked
  // (or gone) already.
  [[nodiscard]] bool begin_driving();
  // Wakes the I/O threads inside the io_context and waits (until `deadline` at most) until
  // they have parked.
  void await_io_threads_parked(Clock::time_point deadline);
  void end_driving() noexcept;
  [[nodiscard]] bool all_threads_parked() const noexcept;
  void wake_drivers();
  // Runs at most one handler, for at most until `deadline` (0 when none ran).
  [[nodiscard]] std::size_t run_one(bool block, Clock::time_point deadline) noexcept;

  boost::asio::io_context& io_;
  const std::chrono::microseconds busy_poll_;
  std::vector<std::thread> threads_;
  int thread_count_ = 0;

  std::mutex mutex_;
  std::condition_variable changed_;
  std::atomic<int> drivers_{0};    // callers in drive_until (changed under mutex_)
  Clock::time_point resume_at_{};  // parked I/O threads run the io_context again from then on
  std::atomic<int> parked_{0};     // I/O threads parked outside the io_context
  std::atomic<int> exited_{0};     // I/O threads that left for good (the io_context stopped)
  std::condition_variable parked_changed_;  // an I/O thread parked or exited (for begin_driving)
  bool stopping_ = false;
};

}  // namespace pulseloco::transport::tcp
