// The Listener every TCP server of pulseloco accepts through: an accept error makes it pause
// (longer each time) rather than spin and is logged once per interval, connections still in their
// handshake are capped with the oldest dropped for a new one, and descriptors near the limit are
// kept free. The tests run the io_context on the test thread, so that they can look at the
// listener between handlers.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <pulseloco/transport/tcp/listener.h>
#include "base/log_capture.h"

namespace pulseloco::transport::tcp {
namespace {

using namespace std::chrono_literals;

// Counts the lines of `text` that contain `what`.
int count_lines(const std::string& text, const std::string& what) {
  int count = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1))
    ++count;
  return count;
}

// Runs `io` until `done` or 10 s pass.
template <typename Done>
bool run_until(asio::io_context& io, Done done) {
  const auto give_up = Clock::now() + 10s;
  while (!done() && Clock::now() < give_up) {
    io.restart();
    io.run_one_for(10ms);
  }
  return done();
}

// Lowers the soft descriptor limit to `limit` and holds every descriptor below `keep_free`
// under it (all of them when 0); gives them back, and the limit, when destroyed.
class ScarceDescriptors {
 public:
  ScarceDescriptors(std::size_t limit, std::size_t keep_free) {
    ::getrlimit(RLIMIT_NOFILE, &saved_);
    rlimit lowered = saved_;
    lowered.rlim_cur = static_cast<rlim_t>(limit);
    ::setrlimit(RLIMIT_NOFILE, &lowered);
    for (;;) {
      const int fd = ::open("/dev/null", O_RDONLY);
      if (fd < 0) break;
      if (static_cast<std::size_t>(fd) + keep_free >= limit) {
        ::close(fd);
        break;
      }
      taken_.push_back(fd);
    }
  }
  ~ScarceDescriptors() {
    for (const int fd : taken_)
      ::close(fd);
    ::setrlimit(RLIMIT_NOFILE, &saved_);
  }
  ScarceDescriptors(const ScarceDescriptors&) = delete;
  ScarceDescriptors& operator=(const ScarceDescriptors&) = delete;

 private:
  rlimit saved_{};
  std::vector<int> taken_;
};

// The lowest free descriptor now.
std::size_t lowest_free_descriptor() {
  const int probe = ::open("/dev/null", O_RDONLY);
  ::close(probe);
  return static_cast<std::size_t>(probe);
}

using testing::LogCapture;

Endpoint loopback(std::uint16_t port) {
  return Endpoint(asio::ip::make_address("127.0.0.1"), port);
}

// A server that passes every connection at once and counts it in `served`.
Listener::Serve count_into(int& served) {
  return [&served](PendingConnection connection) -> asio::awaitable<void> {
    connection.handshake_done();
    ++served;
    co_return;
  };
}

// Whether the server closed `client` (a read sees the end of the stream or a reset).
bool closed_by_server(Socket& client) {
  std::array<char, 1> byte{};
  boost::system::error_code error;
  client.read_some(asio::buffer(byte), error);
  return error == asio::error::eof || error == asio::error::connection_reset;
}

TEST(Listener, AnAcceptErrorPausesTheLoopLongerEachTimeAndIsLoggedOncePerInterval) {
  const LogCapture log;
  asio::io_context io;
  Listener listener(io, io.get_executor(), "test listener", "127.0.0.1", 0);
  int served = 0;
  listener.start(count_into(served));
  // A connection waits in the backlog; accepting it fails while no descriptor is free.
  Socket client(io);
  client.connect(loopback(listener.port()));
  constexpr auto kRun = 630ms;
  {
    const ScarceDescriptors exhausted(lowest_free_descriptor() + 4, 0);
    io.run_for(kRun);
  }
  // The pauses double from kFirstAcceptPause: tries at 0, 10, 30, 70, 150, 310 and 630 ms at
  // the most (a loop that spins on EMFILE makes thousands in this time).
  const std::size_t failures = listener.accept_failures();
  EXPECT_GE(failures, 1u);
  EXPECT_LE(failures, 7u);
  // One line per interval of the throttle (kRun is shorter than one).
  EXPECT_EQ(count_lines(log.text(), "test listener: accept failed"), 1) << log.text();
  EXPECT_EQ(served, 0);
  // Once descriptors are free again, the waiting connection is accepted.
  EXPECT_TRUE(run_until(io, [&] { return served == 1; }));
  listener.close();
}

TEST(Listener, TheOldestConnectionInItsHandshakeIsDroppedWhenEveryPlaceIsTaken) {
  // A limit of 64 descriptors gives 16 places (one of them for the accept under way).
  const ScarceDescriptors limited(64, 64);
  const DescriptorBudget budget = descriptor_budget();
  ASSERT_EQ(budget.max_pending, 16u);
  asio::io_context io;
  Listener listener(io, io.get_executor(), "test listener", "127.0.0.1", 0);
  // Each connection is authenticated by sending one byte; strangers send nothing.
  int authenticated = 0;
  int dropped_for_room = 0;
  std::size_t most_pending = 0;
  listener.start([&](PendingConnection connection) -> asio::awaitable<void> {
    most_pending = std::max(most_pending, pending_connections());
    std::array<char, 1> byte{};
    boost::system::error_code error;
    co_await asio::async_read(*connection.socket(), asio::buffer(byte),
                              asio::redirect_error(asio::use_awaitable, error));
    if (!error) {
      connection.handshake_done();
      ++authenticated;
    } else if (connection.dropped_for_room()) {
      ++dropped_for_room;
    }
  });
  constexpr std::size_t kStrangers = 20;
  std::vector<std::unique_ptr<Socket>> strangers;
  for (std::size_t i = 0; i < kStrangers; ++i) {
    strangers.push_back(std::make_unique<Socket>(io));
    strangers.back()->connect(loopback(listener.port()));
  }
  // The strangers take every place; the oldest ones are dropped as newer ones arrive.
  ASSERT_TRUE(run_until(io, [&] {
    return dropped_for_room == static_cast<int>(kStrangers - (budget.max_pending - 1));
  }));
  // A real peer arriving now still gets in: the oldest stranger left makes room for it.
  Socket peer(io);
  peer.connect(loopback(listener.port()));
  asio::write(peer, asio::buffer("x", 1));
  EXPECT_TRUE(run_until(io, [&] { return authenticated == 1; }));
  EXPECT_LE(most_pending, budget.max_pending);
  EXPECT_LE(pending_connections(), budget.max_pending);
  // The first stranger was among the dropped ones; the newest is still waiting.
  EXPECT_TRUE(closed_by_server(*strangers.front()));
  strangers.back()->non_blocking(true);
  std::array<char, 1> byte{};
  boost::system::error_code still_open;
  strangers.back()->read_some(asio::buffer(byte), still_open);
  EXPECT_EQ(still_open, asio::error::would_block);
  listener.close();
  strangers.clear();
  EXPECT_TRUE(run_until(io, [&] { return pending_connections() == 0; }));
}

TEST(Listener, AConnectionThatWouldUseTheReservedDescriptorsIsClosedAtOnce) {
  const LogCapture log;
  asio::io_context io;
  Listener listener(io, io.get_executor(), "test listener", "127.0.0.1", 0);
  int served = 0;
  listener.start(count_into(served));
  Socket client(io);
  client.connect(loopback(listener.port()));
  {
    // 256 descriptors, all taken but the top 20: the accepted socket would leave fewer than
    // 256 / 8 free.
    const ScarceDescriptors scarce(256, 20);
    ASSERT_TRUE(run_until(io, [&] { return listener.accept_failures() >= 1; }));
    EXPECT_TRUE(closed_by_server(client));
    // The descriptors the listener left free are there for files.
    const int file = ::open("/dev/null", O_RDONLY);
    EXPECT_GE(file, 0);
    ::close(file);
  }
  EXPECT_EQ(served, 0);
  EXPECT_NE(log.text().find("file descriptors are free"), std::string::npos) << log.text();
  // With descriptors free again, a new connection is served.
  Socket again(io);
  again.connect(loopback(listener.port()));
  EXPECT_TRUE(run_until(io, [&] { return served == 1; }));
  listener.close();
}

}  // namespace
}  // namespace pulseloco::transport::tcp
