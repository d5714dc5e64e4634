// A flood of idle connections against a rank's data listener, in a process limited to 256 file
// descriptors: more than four times as many strangers connect as the process may hold
// descriptors, before the group forms and again while the rank saves files. The rank must stay
// usable (the real peer gets in, a message goes both ways), its saves must succeed, the
// descriptors strangers hold and the lines it logs must stay bounded (transport/tcp/listener.h).
//
// The rank under attack is a fork of this test process (forked before any thread exists, so it
// may run the transport); rank 0 runs here. Every step waits on a report line or a connection,
// never on a sleep.
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "transport/loopback_group.h"

#include <pulseloco/transport/tcp/listener.h>

namespace pulseloco::transport {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr rlim_t kVictimDescriptors = 256;
constexpr int kStrangersPerWave = 1100;
constexpr int kSavedFiles = 8;
constexpr std::size_t kMessageBytes = std::size_t{1} << 20;
constexpr auto kTestDeadline = 120s;

std::size_t open_descriptors() {
  std::size_t count = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (const dirent* entry = ::readdir(dir))
      if (entry->d_name[0] != '.') ++count;
    ::closedir(dir);
  }
  return count - 1;  // the directory's own descriptor
}

void write_line(int fd, const std::string& line) {
  const std::string text = line + "\n";
  [[maybe_unused]] const auto written = ::write(fd, text.data(), text.size());
}

// Writes kSavedFiles files of 1 MiB, all open at once, each synced: what a checkpoint save needs.
void save_files(const std::filesystem::path& dir) {
  std::vector<int> files;
  const std::vector<char> bytes(kMessageBytes, 'c');
  for (int i = 0; i < kSavedFiles; ++i) {
    const auto path = dir / ("part-" + std::to_string(i));
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
      throw std::runtime_error("cannot open " + path.string() + ": " + std::strerror(errno));
    files.push_back(fd);
    if (::write(fd, bytes.data(), bytes.size()) != static_cast<ssize_t>(bytes.size()) ||
        ::fsync(fd) != 0)
      throw std::runtime_error("cannot write " + path.string() + ": " + std::strerror(errno));
  }
  for (const int fd : files)
    ::close(fd);
}

// The rank under attack (rank 1): joins, echoes one message, saves when told to (a byte on
// `go`), reports, and exits. Never returns.
[[noreturn]] void run_victim(const std::vector<std::string>& peers, int report, int go,
                             const std::filesystem::path& dir) {
  const auto start = Clock::now();
  int status = 1;
  try {
    const rlimit limit{kVictimDescriptors, kVictimDescriptors};
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0) throw std::runtime_error("setrlimit failed");
    write_line(report, "started fds=" + std::to_string(open_descriptors()));
    auto transport = group::make_transport(testing::peer_list_options(peers, 1, "flood", 60s));
    std::vector<std::byte> message(kMessageBytes);
    transport->recv(0, 1, message, deadline_after(60s));
    transport->send(0, 2, message, deadline_after(60s));
    write_line(report, "echoed");
    char byte = 0;
    if (::read(go, &byte, 1) != 1) throw std::runtime_error("the test did not say when to save");
    save_files(dir);
    write_line(report, "saved fds=" + std::to_string(open_descriptors()));
    transport->send(0, 3, std::span<const std::byte>(message.data(), 1), deadline_after(60s));
    const auto elapsed =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
    write_line(report, "ok elapsed_ms=" + std::to_string(elapsed.count()));
    status = 0;
  } catch (const std::exception& error) {
    write_line(report, std::string("error ") + error.what());
  }
  std::fflush(nullptr);
  ::_exit(status);
}

// Reads the victim's report lines under a deadline.
class Reports {
 public:
  explicit Reports(int fd) : fd_(fd) {}
  // The next line, or nullopt when the victim exits or the deadline passes.
  std::optional<std::string> next(Clock::time_point deadline) {
    for (;;) {
      if (const auto end = buffer_.find('\n'); end != std::string::npos) {
        std::string line = buffer_.substr(0, end);
        buffer_.erase(0, end + 1);
        return line;
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd ready{fd_, POLLIN, 0};
      if (::poll(&ready, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[256];
      const auto n = ::read(fd_, chunk, sizeof chunk);
      if (n <= 0) return std::nullopt;
      buffer_.append(chunk, static_cast<std::size_t>(n));
    }
  }

 private:
  int fd_;
  std::string buffer_;
};

// The number after "<key>=" in `line`.
std::size_t value_of(const std::string& line, const std::string& key) {
  const auto at = line.find(key + "=");
  return at == std::string::npos ? 0 : std::stoul(line.substr(at + key.size() + 1));
}

sockaddr_in loopback_address(std::uint16_t port) {
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  return address;
}

// Opens `count` idle connections to `port` and waits until the kernel completed them (they sit
// in the listener's backlog or its handshake); returns how many did.
int flood(std::uint16_t port, int count, std::vector<int>& sockets, Clock::time_point deadline) {
  const sockaddr_in address = loopback_address(port);
  std::vector<pollfd> connecting;
  for (int i = 0; i < count; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) break;
    sockets.push_back(fd);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0 ||
        errno == EINPROGRESS)
      connecting.push_back({fd, POLLOUT, 0});
  }
  int connected = 0;
  while (!connecting.empty() && Clock::now() < deadline) {
    if (::poll(connecting.data(), connecting.size(), 100) <= 0) continue;
    std::vector<pollfd> still;
    for (const pollfd& entry : connecting) {
      if (entry.revents == 0) {
        still.push_back({entry.fd, POLLOUT, 0});
        continue;
      }
      int error = 0;
      socklen_t length = sizeof error;
      ::getsockopt(entry.fd, SOL_SOCKET, SO_ERROR, &error, &length);
      if (error == 0) ++connected;
    }
    connecting.swap(still);
  }
  return connected;
}

// Waits until `port` accepts a connection (the victim's data listener is bound).
bool wait_for_listener(std::uint16_t port, Clock::time_point deadline) {
  const sockaddr_in address = loopback_address(port);
  while (Clock::now() < deadline) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool up = ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0;
    ::close(fd);
    if (up) return true;
    std::this_thread::sleep_for(10ms);  // retried until the port is bound: no event to wait on
  }
  return false;
}

std::uint16_t port_of(const std::string& peer) {
  return static_cast<std::uint16_t>(std::stoul(peer.substr(peer.rfind(':') + 1)));
}

TEST(StrangerFlood, IdleConnectionsBeyondTheDescriptorLimitLeaveTheRankUsableAndItsSavesWorking) {
  // This process holds two waves of strangers.
  rlimit own{};
  ::getrlimit(RLIMIT_NOFILE, &own);
  const rlim_t needed = 2 * kStrangersPerWave + 256;
  if (own.rlim_max != RLIM_INFINITY && own.rlim_max < needed)
    GTEST_SKIP() << "the hard descriptor limit " << own.rlim_max << " is below " << needed;
  own.rlim_cur = std::max(own.rlim_cur, needed);
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &own), 0);

  const auto dir =
      std::filesystem::temp_directory_path() / ("pulseloco-flood-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto log_path = dir / "victim.log";
  const auto peers = testing::free_peer_list(2);
  int report[2];
  int go[2];
  ASSERT_EQ(::pipe2(report, O_CLOEXEC), 0);
  ASSERT_EQ(::pipe2(go, O_CLOEXEC), 0);
  const int log_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(log_fd, 0);
  const pid_t victim = ::fork();
  ASSERT_GE(victim, 0);
  if (victim == 0) {
    ::dup2(log_fd, STDERR_FILENO);
    run_victim(peers, report[1], go[0], dir);
  }
  ::close(log_fd);
  ::close(report[1]);
  ::close(go[0]);
  Reports reports(report[0]);
  const auto deadline = Clock::now() + kTestDeadline;
  std::vector<int> strangers;

  const auto started = reports.next(deadline);
  ASSERT_TRUE(started && started->rfind("started", 0) == 0) << started.value_or("<no report>");
  const std::size_t baseline = value_of(*started, "fds");
  const std::uint16_t victim_port = port_of(peers[1]);
  ASSERT_TRUE(wait_for_listener(victim_port, deadline));
  // Wave 1, before the group forms: the real peer connects behind all of them.
  EXPECT_GE(flood(victim_port, kStrangersPerWave, strangers, deadline), 4 * 256);
  {
    auto transport = group::make_transport(testing::peer_list_options(peers, 0, "flood", 60s));
    const auto sent = testing::payload(7, kMessageBytes);
    std::vector<std::byte> echoed(kMessageBytes);
    auto receive = transport->irecv(1, 2, echoed);
    transport->send(1, 1, sent, deadline_after(60s));
    receive->wait(deadline_after(60s));
    EXPECT_EQ(echoed, sent);
    const auto echo_line = reports.next(deadline);
    ASSERT_EQ(echo_line.value_or("<no report>"), "echoed");

    // Wave 2, then the save while the listener works through it.
    EXPECT_GE(flood(victim_port, kStrangersPerWave, strangers, deadline), 4 * 256);
    ASSERT_EQ(::write(go[1], "s", 1), 1);
    const auto saved = reports.next(deadline);
    ASSERT_TRUE(saved && saved->rfind("saved", 0) == 0) << saved.value_or("<no report>");
    // Strangers held at most a quarter of the limit; the transport, the saved files and the
    // descriptors the process had at the start account for the rest.
    const auto budget_pending = static_cast<std::size_t>(kVictimDescriptors / 4);
    EXPECT_LE(value_of(*saved, "fds"), baseline + budget_pending + 16) << *saved;
    std::vector<std::byte> last(1);
    transport->recv(1, 3, last, deadline_after(60s));
  }
  const auto ok = reports.next(deadline);
  ASSERT_TRUE(ok && ok->rfind("ok", 0) == 0) << ok.value_or("<no report>");
  // The victim exits after "ok", closing its end of the report pipe.
  while (reports.next(deadline)) {
  }
  ASSERT_LT(Clock::now(), deadline) << "the victim did not exit after reporting ok";
  int status = -1;
  ASSERT_EQ(::waitpid(victim, &status, 0), victim);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (const int fd : strangers)
    ::close(fd);
  ::close(report[0]);
  ::close(go[1]);

  // The log stays bounded: a few lines per throttle interval, however many strangers came.
  std::ifstream log(log_path);
  std::string line;
  std::size_t lines = 0;
  while (std::getline(log, line))
    ++lines;
  const auto intervals = value_of(*ok, "elapsed_ms") / 5000 + 1;
  EXPECT_LE(lines, 10 + 2 * 6 * intervals) << "the victim logged " << lines << " lines";
  for (int i = 0; i < kSavedFiles; ++i)
    EXPECT_EQ(std::filesystem::file_size(dir / ("part-" + std::to_string(i))), kMessageBytes);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace pulseloco::transport
