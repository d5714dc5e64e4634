// `pulseloco coordinator` as a process: it announces where it listens, serves workers, and exits
// 0 when the run is over or 1 with the reason when the group fell below the minimum. The test
// synchronises on the announced line and on the workers' replies, never on sleeps.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/elastic/membership_client.h>

namespace pulseloco::elastic {
namespace {

using namespace std::chrono_literals;
using transport::deadline_after;
using transport::PeerAddress;

constexpr const char* kPulseloco = PULSELOCO_CLI;
constexpr auto kTimeout = 30s;
constexpr const char* kSecret = "coordinator command secret";

// `pulseloco coordinator ARGS` with PULSELOCO_SECRET set, its stdout and stderr on pipes.
class CoordinatorProcess {
 public:
  explicit CoordinatorProcess(const std::vector<std::string>& args) {
    std::vector<std::string> argv_strings = {kPulseloco, "coordinator"};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& s : argv_strings)
      argv.push_back(s.data());
    argv.push_back(nullptr);
    int out[2];
    int err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
      throw std::runtime_error("pipe2 failed");
    ::setenv("PULSELOCO_SECRET", kSecret, 1);  // inherited; set before fork
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      ::execv(argv[0], argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    stdout_fd_ = out[0];
    stderr_fd_ = err[0];
  }
  ~CoordinatorProcess() {
    if (!reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    ::close(stdout_fd_);
    ::close(stderr_fd_);
  }
  CoordinatorProcess(const CoordinatorProcess&) = delete;
  CoordinatorProcess& operator=(const CoordinatorProcess&) = delete;

  // The port from "coordinator listening on HOST:PORT"; nullopt when the line did not come.
  std::optional<std::uint16_t> listening_port() {
    const std::string prefix = "coordinator listening on 127.0.0.1:";
    while (out_.find('\n') == std::string::npos)
      if (!read_more(stdout_fd_, out_)) return std::nullopt;
    const std::string line = out_.substr(0, out_.find('\n'));
    if (line.rfind(prefix, 0) != 0) return std::nullopt;
    return static_cast<std::uint16_t>(std::stoi(line.substr(prefix.size())));
  }

  // Waits (bounded) for the exit; returns the exit status, -1 when killed for overrunning.
  int wait_exit() {
    while (read_more(stdout_fd_, out_)) {
    }
    while (read_more(stderr_fd_, err_)) {
    }
    int status = 0;
    if (!eof_) ::kill(pid_, SIGKILL);
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  [[nodiscard]] const std::string& out() const { return out_; }
  [[nodiscard]] const std::string& err() const { return err_; }

 private:
  bool read_more(int fd, std::string& into) {
    pollfd p{fd, POLLIN, 0};
    eof_ = false;
    if (::poll(&p, 1, static_cast<int>(std::chrono::milliseconds(kTimeout).count())) <= 0)
      return false;
    char chunk[4096];
    const auto n = ::read(fd, chunk, sizeof chunk);
    if (n <= 0) {
      eof_ = true;
      return false;
    }
    into.append(chunk, static_cast<std::size_t>(n));
    return true;
  }

  pid_t pid_ = -1;
  int stdout_fd_ = -1;
  int stderr_fd_ = -1;
  std::string out_;
  std::string err_;
  bool eof_ = false;
  bool reaped_ = false;
};

std::unique_ptr<MembershipClient> connect(std::uint16_t port, const std::string& id) {
  MembershipClientOptions options;
  options.coordinator = "127.0.0.1:" + std::to_string(port);
  options.worker_id = id;
  options.data_address = PeerAddress{"127.0.0.1", 9};
  options.secret = kSecret;
  options.connect_timeout = kTimeout;
  return std::make_unique<MembershipClient>(options);
}

// Workers "a" and "b" join the coordinator listening on `port`; returns them once both are
// placed in generation 1.
std::pair<std::unique_ptr<MembershipClient>, std::unique_ptr<MembershipClient>> form_first_group(
    std::uint16_t port) {
  auto a = connect(port, "a");
  auto b = connect(port, "b");
  auto placed = std::async(std::launch::async,
                           [&] { return a->next_group("join", deadline_after(kTimeout)); });
  EXPECT_EQ(b->next_group("join", deadline_after(kTimeout)).generation, 1u);
  EXPECT_EQ(placed.get().generation, 1u);
  return {std::move(a), std::move(b)};
}

std::vector<std::string> arguments() {
  return {"--host",
          "127.0.0.1",
          "--port",
          "0",
          "--initial-workers",
          "2",
          "--min-workers",
          "2",
          "--regroup-timeout-ms",
          "30000"};
}

TEST(CoordinatorCommand, RunsUntilEveryMemberHasLeft) {
  CoordinatorProcess coordinator(arguments());
  const auto port = coordinator.listening_port();
  ASSERT_TRUE(port) << coordinator.out();
  auto [a, b] = form_first_group(*port);
  a->leave();
  b->leave();
  EXPECT_EQ(coordinator.wait_exit(), 0) << coordinator.err();
  EXPECT_NE(coordinator.out().find("the run has finished after 1 generation"), std::string::npos)
      << coordinator.out();
}

TEST(CoordinatorCommand, ExitsWithTheReasonWhenTheGroupFallsBelowTheMinimum) {
  CoordinatorProcess coordinator(arguments());
  const auto port = coordinator.listening_port();
  ASSERT_TRUE(port) << coordinator.out();
  auto [a, b] = form_first_group(*port);
  b.reset();
  EXPECT_THROW((void)a->next_group("peer lost", deadline_after(kTimeout)), MembershipError);
  EXPECT_EQ(coordinator.wait_exit(), 1) << coordinator.err();
  EXPECT_NE(coordinator.err().find("below the minimum 2"), std::string::npos) << coordinator.err();
}

TEST(CoordinatorCommand, RejectsImpossibleOptions) {
  CoordinatorProcess coordinator({"--initial-workers", "2", "--min-workers", "3"});
  EXPECT_EQ(coordinator.wait_exit(), 1);
  EXPECT_NE(coordinator.err().find("min_workers"), std::string::npos) << coordinator.err();
}

}  // namespace
}  // namespace pulseloco::elastic
