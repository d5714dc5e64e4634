// tcp::Progress on a bare io_context: who runs the handlers while a caller waits, and that a
// driver sleeping in the io_context learns of completions made elsewhere.
#include <pulseloco/transport/tcp/progress.h>

#include <gtest/gtest.h>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include <atomic>
#include <chrono>
#include <optional>
#include <string>
#include <thread>

#include <pulseloco/base/log.h>
#include <pulseloco/base/thread_name.h>

namespace pulseloco::transport::tcp {
namespace {

namespace asio = boost::asio;
using namespace std::chrono_literals;
using Clock = Progress::Clock;

constexpr auto kGiveUp = 60s;
// A driver that missed its wake-up would sleep until this deadline.
constexpr auto kMissedWakeUp = 20s;

// An io_context with work, a reactor (the timer) and `threads` I/O threads.
struct Rig {
  explicit Rig(int threads, std::chrono::microseconds busy_poll = 0us)
      : work(asio::make_work_guard(io)), timer(io), progress(io, busy_poll) {
    progress.start_threads(threads, [](const std::exception& error) {
      ADD_FAILURE() << "a handler threw: " << error.what();
    });
  }
  ~Rig() {
    work.reset();
    io.stop();
    progress.join();
  }
  asio::io_context io;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  asio::steady_timer timer;
  Progress progress;
};

// Spins (yielding) until `condition` holds; fails the test after kGiveUp.
template <typename Condition>
void wait_for(const Condition& condition, const char* what) {
  const auto give_up = Clock::now() + kGiveUp;
  while (!condition()) {
    ASSERT_LT(Clock::now(), give_up) << "gave up waiting until " << what;
    std::this_thread::yield();
  }
}

// Named, so that top -H, ps -L, gdb and perf tell them from the application's threads.
TEST(Progress, TheIoThreadsAreNamed) {
  Rig rig(2);
  std::atomic<int> seen{0};
  std::string names[2];
  for (int i = 0; i < 2; ++i) {
    asio::post(rig.io, [&, i] {
      names[i] = this_thread_name();
      ++seen;
    });
  }
  wait_for([&] { return seen.load() == 2; }, "the I/O threads ran both handlers");
  EXPECT_EQ(names[0], "pl-tcp-io");
  EXPECT_EQ(names[1], "pl-tcp-io");
}

TEST(Progress, WhileACallerDrivesTheIoThreadParksAndTheCallerRunsTheHandlers) {
  Rig rig(1);
  std::atomic<bool> done{false};
  std::atomic<std::thread::id> ran_on{};
  std::thread::id driver_id;
  std::thread driver([&] {
    driver_id = std::this_thread::get_id();
    EXPECT_TRUE(
        rig.progress.drive_until([&] { return done.load(); }, Clock::now() + kMissedWakeUp));
  });
  wait_for([&] { return rig.progress.parked_threads() == 1; }, "the I/O thread parked");
  EXPECT_EQ(rig.progress.drivers(), 1);
  asio::post(rig.io, [&] {
    ran_on = std::this_thread::get_id();
    done = true;
  });
  driver.join();
  EXPECT_EQ(ran_on.load(), driver_id);
}

TEST(Progress, TheIoThreadRunsTheIoContextAgainOnceTheLastDriverHasLeft) {
  Rig rig(1);
  std::atomic<bool> done{false};
  std::thread driver([&] {
    EXPECT_TRUE(
        rig.progress.drive_until([&] { return done.load(); }, Clock::now() + kMissedWakeUp));
  });
  wait_for([&] { return rig.progress.parked_threads() == 1; }, "the I/O thread parked");
  asio::post(rig.io, [&] { done = true; });
  driver.join();
  // Nobody drives now: this handler is the I/O thread's, after the linger.
  std::atomic<std::thread::id> ran_on{};
  asio::post(rig.io, [&] { ran_on = std::this_thread::get_id(); });
  wait_for([&] { return ran_on.load() != std::thread::id{}; }, "the I/O thread ran the handler");
  EXPECT_NE(ran_on.load(), std::this_thread::get_id());
  EXPECT_EQ(rig.progress.parked_threads(), 0);
}

// A caller that starts driving while the I/O thread is inside the io_context (here: busy in a
// handler) must leave the io_context to it until it has parked. A caller that ran handlers
// meanwhile would also take the one posted to wake the I/O thread from the reactor, and spin.
TEST(Progress, ACallerThatStartsDrivingRunsNoHandlerUntilTheIoThreadHasParked) {
  Rig rig(1);
  std::atomic<bool> in_busy_handler{false};
  std::atomic<bool> later_handler_ran{false};
  std::atomic<int> parked_when_later_handler_ran{-1};
  std::atomic<std::thread::id> later_ran_on{};
  // Nobody has driven yet, so the I/O thread runs the io_context and takes this handler. It
  // returns once a caller drives and has had 200 ms to take the next handler: a caller that
  // waits for the I/O thread to park never does, and then this is just a slow handler.
  asio::post(rig.io, [&] {
    in_busy_handler = true;
    wait_for([&] { return rig.progress.drivers() == 1; }, "a caller drives");
    const auto window_end = Clock::now() + 200ms;
    while (!later_handler_ran.load() && Clock::now() < window_end)
      std::this_thread::yield();
  });
  wait_for([&] { return in_busy_handler.load(); }, "the I/O thread runs the busy handler");
  asio::post(rig.io, [&] {
    parked_when_later_handler_ran = rig.progress.parked_threads();
    later_ran_on = std::this_thread::get_id();
    later_handler_ran = true;
  });
  std::thread::id driver_id;
  std::thread driver([&] {
    driver_id = std::this_thread::get_id();
    EXPECT_TRUE(rig.progress.drive_until([&] { return later_handler_ran.load(); },
                                         Clock::now() + kMissedWakeUp));
  });
  driver.join();
  EXPECT_EQ(parked_when_later_handler_ran.load(), 1)
      << "the caller ran a handler while the I/O thread was inside the io_context";
  EXPECT_EQ(later_ran_on.load(), driver_id);
}

// With two I/O threads inside the io_context (one in the reactor, one waiting for handlers), a
// handler posted to wake them reaches the waiting one only: the other must be woken too (the
// first one to park does it).
TEST(Progress, ACallerThatStartsDrivingGetsEveryIoThreadToPark) {
  Rig rig(2);
  // This timer keeps the reactor busy with a wait, as a socket does.
  rig.timer.expires_after(kGiveUp);
  rig.timer.async_wait([](const boost::system::error_code&) {});
  // Nobody has driven yet, so both I/O threads run the io_context: two handlers that wait for
  // each other show it. The pause after them lets both go back in (one to the reactor, one to
  // wait for handlers), the state this test is about; the caller must cope with any state, so
  // the pause only decides whether a caller that wakes one thread alone is caught.
  std::atomic<int> started{0};
  for (int i = 0; i < 2; ++i) {
    asio::post(rig.io, [&] {
      ++started;
      wait_for([&] { return started.load() == 2; }, "both I/O threads run a handler");
    });
  }
  wait_for([&] { return started.load() == 2; }, "both I/O threads run a handler");
  std::this_thread::sleep_for(50ms);
  std::atomic<bool> done{false};
  bool finished = false;
  const auto deadline = Clock::now() + kMissedWakeUp;
  std::thread driver(
      [&] { finished = rig.progress.drive_until([&] { return done.load(); }, deadline); });
  wait_for([&] { return rig.progress.parked_threads() == 2; }, "both I/O threads parked");
  asio::post(rig.io, [&] { done = true; });
  driver.join();
  EXPECT_TRUE(finished);
  EXPECT_LT(Clock::now(), deadline);
  rig.timer.cancel();
}

// A completion made outside the io_context (another thread, as abort() or a send to oneself
// does) must wake the driver sleeping in it, whatever its busy_poll.
TEST(Progress, ACompletionMadeElsewhereWakesTheDriverSleepingInTheIoContext) {
  Rig rig(0);  // no I/O thread whose comings and goings could wake the driver by the way
  std::atomic<bool> done{false};
  std::atomic<int> looks{0};
  bool finished = false;
  const auto deadline = Clock::now() + kMissedWakeUp;
  Clock::time_point returned_at;
  std::thread driver([&] {
    finished = rig.progress.drive_until(
        [&] {
          ++looks;
          return done.load();
        },
        deadline);
    returned_at = Clock::now();
  });
  // The driver looks once; with busy_poll 0 and nothing to run it then sleeps in the
  // io_context, until something is posted.
  wait_for([&] { return looks.load() >= 1; }, "the driver looked");
  done = true;
  rig.progress.completion_happened();
  driver.join();
  EXPECT_TRUE(finished);
  EXPECT_LT(returned_at, deadline) << "the driver slept until its deadline";
}

}  // namespace
}  // namespace pulseloco::transport::tcp
