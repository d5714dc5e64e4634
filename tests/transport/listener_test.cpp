// The Listener every TCP server of pulseloco accepts through: an accept error makes it pause
// rather than spin, and connections still in their handshake are capped. Both tests run the
// io_context on the test thread, so that they can look at the listener between handlers.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <spdlog/sinks/ostream_sink.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <pulseloco/base/log.h>
#include <pulseloco/transport/tcp/listener.h>

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

// Takes every file descriptor below the soft limit, which it lowers to just above the highest
// one in use; gives them back (and the limit) when destroyed.
class NoFreeDescriptors {
 public:
  NoFreeDescriptors() {
    ::getrlimit(RLIMIT_NOFILE, &saved_);
    const int probe = ::open("/dev/null", O_RDONLY);
    ::close(probe);
    rlimit lowered = saved_;
    lowered.rlim_cur = static_cast<rlim_t>(probe) + 4;
    ::setrlimit(RLIMIT_NOFILE, &lowered);
    for (;;) {
      const int fd = ::open("/dev/null", O_RDONLY);
      if (fd < 0) break;
      taken_.push_back(fd);
    }
  }
  ~NoFreeDescriptors() {
    for (const int fd : taken_)
      ::close(fd);
    ::setrlimit(RLIMIT_NOFILE, &saved_);
  }
  NoFreeDescriptors(const NoFreeDescriptors&) = delete;
  NoFreeDescriptors& operator=(const NoFreeDescriptors&) = delete;

 private:
  rlimit saved_{};
  std::vector<int> taken_;
};

TEST(Listener, AnAcceptErrorPausesTheLoopInsteadOfSpinning) {
  std::ostringstream lines;
  logger().sinks().push_back(std::make_shared<spdlog::sinks::ostream_sink_mt>(lines));
  asio::io_context io;
  Listener listener(io, io.get_executor(), "test listener", "127.0.0.1", 0);
  int served = 0;
  listener.start([&served](PendingConnection connection) -> asio::awaitable<void> {
    connection.handshake_done();
    ++served;
    co_return;
  });
  // A connection waits in the backlog; accepting it fails while no descriptor is free.
  Socket client(io);
  client.connect(Endpoint(asio::ip::make_address("127.0.0.1"), listener.port()));
  constexpr auto kRun = 550ms;
  {
    const NoFreeDescriptors exhausted;
    io.run_for(kRun);
  }
  const int failures = count_lines(lines.str(), "test listener: accept failed");
  EXPECT_GE(failures, 1) << lines.str();
  // Every failed accept is followed by a pause: at most one try per pause (a loop that spins
  // on EMFILE makes thousands in this time).
  EXPECT_LE(failures, static_cast<int>(kRun / kAcceptErrorPause) + 1) << lines.str();
  EXPECT_EQ(served, 0);
  // Once descriptors are free again, the waiting connection is accepted.
  EXPECT_TRUE(run_until(io, [&] { return served == 1; }));
  listener.close();
  logger().sinks().pop_back();
}

TEST(Listener, ConnectionsInTheirHandshakeAreCapped) {
  asio::io_context io;
  Listener listener(io, io.get_executor(), "test listener", "127.0.0.1", 0);
  std::vector<PendingConnection> pending;  // served, their handshake not done
  listener.start([&pending](PendingConnection connection) -> asio::awaitable<void> {
    pending.push_back(std::move(connection));
    co_return;
  });
  // One connection more than the cap, all in the backlog before the listener runs.
  std::vector<std::unique_ptr<Socket>> clients;
  for (std::size_t i = 0; i <= kMaxPendingConnections; ++i) {
    clients.push_back(std::make_unique<Socket>(io));
    clients.back()->connect(Endpoint(asio::ip::make_address("127.0.0.1"), listener.port()));
  }
  ASSERT_TRUE(run_until(io, [&] { return pending.size() == kMaxPendingConnections; }));
  // Every handler that is ready has run: the last connection waits for a place.
  io.restart();
  while (io.poll() > 0) {
  }
  EXPECT_EQ(pending.size(), kMaxPendingConnections);
  pending.front().handshake_done();
  EXPECT_TRUE(run_until(io, [&] { return pending.size() == kMaxPendingConnections + 1; }));
  listener.close();
}

}  // namespace
}  // namespace pulseloco::transport::tcp
