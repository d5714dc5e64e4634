// Collectives across real processes joined by the environment rendezvous (MASTER_ADDR,
// MASTER_PORT, RANK, WORLD_SIZE), and real faults: SIGKILL of one rank during a small and
// during a large collective, SIGSTOP of one rank, a frame corrupted in flight. Every survivor
// must fail within a bound of the fault (kFailsWithin) naming the culprit. The victim tells this
// driver through a pipe when its collective is under way; nothing waits on sleeps.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <pulseloco/group/rendezvous_server.h>

extern char** environ;

namespace pulseloco {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr std::chrono::milliseconds kTimeout = 1500ms;
// The latest a survivor may fail after the fault: its own wait, timeout / 2 following the
// suspicion chain and timeout / 4 letting its notices out (docs/collectives.md), plus slack for a
// loaded machine. It stays far below kKillTimeout, so a survivor of a SIGKILL must have noticed
// the closed connections rather than waited out its deadline.
constexpr std::chrono::milliseconds kFailsWithin = kTimeout * 7 / 4 + 10s;

// An owned file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  [[nodiscard]] int get() const noexcept { return fd_; }
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct Pipe {
  Fd read;
  Fd write;
};
Pipe make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  return {Fd(fds[0]), Fd(fds[1])};
}

// One worker process. Its stdout goes to a pipe read after it exits; fds given in `extra` are
// dup2'ed to 3, 4, ... in the child.
class Worker {
 public:
  Worker(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
         const std::vector<int>& extra) {
    Pipe out = make_pipe();
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, out.write.get(), STDOUT_FILENO);
    for (std::size_t i = 0; i < extra.size(); ++i) {
      posix_spawn_file_actions_adddup2(&actions, extra[i], 3 + static_cast<int>(i));
    }
    std::vector<std::string> environment;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry(*e);
      if (!env.contains(entry.substr(0, entry.find('=')))) environment.push_back(entry);
    }
    for (const auto& [key, value] : env)
      environment.push_back(key + "=" + value);
    std::vector<char*> argv;
    for (const auto& arg : args)
      argv.push_back(const_cast<char*>(arg.c_str()));
    argv.push_back(nullptr);
    std::vector<char*> envp;
    for (auto& entry : environment)
      envp.push_back(entry.data());
    envp.push_back(nullptr);
    const int status = posix_spawn(&pid_, argv[0], &actions, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    if (status != 0) throw std::runtime_error(std::string("posix_spawn: ") + std::strerror(status));
    pidfd_ = Fd(static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0)));
    if (pidfd_.get() < 0) throw std::runtime_error("pidfd_open failed");
    stdout_ = std::move(out.read);
  }
  ~Worker() {
    if (!exit_code_) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  void signal(int sig) const { ::kill(pid_, sig); }

  // Waits until the process exits or `deadline`; returns whether it exited.
  bool wait(Clock::time_point deadline) {
    if (exit_code_) return true;
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd p{.fd = pidfd_.get(), .events = POLLIN, .revents = 0};
    if (::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(0, left.count()))) <= 0) {
      return false;
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::string text;
    char buffer[4096];
    ssize_t got = 0;
    while ((got = ::read(stdout_.get(), buffer, sizeof buffer)) > 0) {
      text.append(buffer, static_cast<std::size_t>(got));
    }
    output_ = text;
    return true;
  }

  [[nodiscard]] std::optional<int> exit_code() const { return exit_code_; }
  [[nodiscard]] const std::string& output() const { return output_; }

  // "key=value" fields of the output's first line.
  [[nodiscard]] std::string field(const std::string& key) const {
    std::istringstream in(output_.substr(0, output_.find('\n')));
    std::string word;
    while (in >> word) {
      if (word.starts_with(key + "=")) return word.substr(key.size() + 1);
    }
    return {};
  }

 private:
  pid_t pid_ = -1;
  Fd pidfd_;
  Fd stdout_;
  std::optional<int> exit_code_;
  std::string output_;
};

// A group of worker processes joined by a rendezvous server in this process.
class ProcessGroup {
 public:
  ProcessGroup(int world, const std::vector<std::string>& args, int victim = -1,
               const std::map<std::string, std::string>& victim_env = {})
      : server_("127.0.0.1", 0, world, transport::TcpOptions{}, transport::deadline_after(60s)),
        event_(make_pipe()),
        block_(make_pipe()) {
    for (int rank = 0; rank < world; ++rank) {
      std::map<std::string, std::string> env = {
          {"RANK", std::to_string(rank)},         {"WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "127.0.0.1"},           {"MASTER_PORT", std::to_string(server_.port())},
          {"PULSELOCO_RENDEZVOUS", "env"},        {"PULSELOCO_RENDEZVOUS_EXTERNAL", "1"},
          {"PULSELOCO_LISTEN_ADDR", "127.0.0.1"}, {"PULSELOCO_TRANSPORT", "tcp"},
      };
      std::vector<std::string> argv = {PULSELOCO_COLLECTIVES_WORKER, "--bootstrap", "env"};
      argv.insert(argv.end(), args.begin(), args.end());
      std::vector<int> extra;
      if (rank == victim) {
        for (const auto& [key, value] : victim_env)
          env[key] = value;
        argv.insert(argv.end(),
                    {"--victim", std::to_string(victim), "--event-fd", "3", "--block-fd", "4"});
        extra = {event_.write.get(), block_.read.get()};
      }
      workers_.push_back(std::make_unique<Worker>(argv, env, extra));
    }
    event_.write.reset();  // only the victim writes
    block_.read.reset();
    server_.wait();
  }

  Worker& operator[](int rank) { return *workers_[static_cast<std::size_t>(rank)]; }
  [[nodiscard]] int size() const { return static_cast<int>(workers_.size()); }

  // Blocks until the victim reports that its collective is under way.
  [[nodiscard]] bool wait_for_progress(Clock::time_point deadline) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd p{.fd = event_.read.get(), .events = POLLIN, .revents = 0};
    if (::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(0, left.count()))) <= 0) {
      return false;
    }
    char buffer[16];
    return ::read(event_.read.get(), buffer, sizeof buffer) > 0;
  }
  // Lets a victim blocked in its callback continue.
  void release_victim() { block_.write.reset(); }

  void wait_all(Clock::time_point deadline) {
    for (auto& worker : workers_) {
      EXPECT_TRUE(worker->wait(deadline)) << "a worker did not finish in time";
    }
  }

 private:
  group::RendezvousServer server_;
  Pipe event_;
  Pipe block_;
  std::vector<std::unique_ptr<Worker>> workers_;
};

// Every rank but `culprit` failed with `kind` naming `culprit`, within kFailsWithin of `fault`.
void expect_survivors_blame(ProcessGroup& group, int culprit, const std::string& kind,
                            Clock::time_point fault) {
  for (int rank = 0; rank < group.size(); ++rank) {
    if (rank == culprit) continue;
    Worker& worker = group[rank];
    ASSERT_TRUE(worker.wait(fault + kFailsWithin + 20s)) << "rank " << rank << " hangs";
    EXPECT_EQ(worker.exit_code(), 3) << "rank " << rank << ": " << worker.output();
    EXPECT_EQ(worker.field("kind"), kind) << "rank " << rank << ": " << worker.output();
    EXPECT_EQ(worker.field("peer"), std::to_string(culprit))
        << "rank " << rank << ": " << worker.output();
    const std::string time = worker.field("time_ns");
    ASSERT_FALSE(time.empty()) << worker.output();
    const auto failed_at = Clock::time_point(std::chrono::nanoseconds(std::stoll(time)));
    const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(failed_at - fault);
    EXPECT_LE(took, kFailsWithin) << "rank " << rank << " failed " << took.count()
                                  << " ms after the fault: " << worker.output();
  }
}

std::vector<std::string> single(const std::string& op, std::size_t bytes,
                                const std::string& algorithm, std::size_t chunk,
                                std::chrono::milliseconds timeout = kTimeout) {
  return {"--op",         op,
          "--bytes",      std::to_string(bytes),
          "--algorithm",  algorithm,
          "--chunk",      std::to_string(chunk),
          "--timeout-ms", std::to_string(timeout.count())};
}

// The ranks' timeout in the SIGKILL tests: a kill is noticed when the connections close, and the
// victim, blocked, sends nothing meanwhile; a minute keeps the survivors' deadlines from running
// out first however late this process gets to send the signal. They must still notice within
// kFailsWithin of it.
constexpr std::chrono::milliseconds kKillTimeout = 60s;

class EnvRendezvous : public ::testing::TestWithParam<int> {};

TEST_P(EnvRendezvous, EveryCollectiveDeliversTheExpectedBytes) {
  ProcessGroup group(GetParam(), {"--op", "suite"});
  group.wait_all(Clock::now() + 600s);
  for (int rank = 0; rank < group.size(); ++rank) {
    EXPECT_EQ(group[rank].exit_code(), 0) << "rank " << rank << ": " << group[rank].output();
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, EnvRendezvous, ::testing::Values(2, 3, 4),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "_ranks";
                         });

TEST(SigKill, DuringASmallAllGather) {
  // The victim stops inside its callback, mid-call, until it is killed.
  ProcessGroup group(4, single("allgather", 1000, "ring", 100, kKillTimeout), 2);
  ASSERT_TRUE(group.wait_for_progress(Clock::now() + 60s));
  const auto fault = Clock::now();
  group[2].signal(SIGKILL);
  expect_survivors_blame(group, 2, "peer_lost", fault);
}

TEST(SigKill, DuringALargeAllGather) {
  ProcessGroup group(
      4, single("allgather", std::size_t{64} << 20, "ring", std::size_t{1} << 20, kKillTimeout), 1);
  ASSERT_TRUE(group.wait_for_progress(Clock::now() + 120s));
  const auto fault = Clock::now();
  group[1].signal(SIGKILL);
  expect_survivors_blame(group, 1, "peer_lost", fault);
}

TEST(SigKill, OfARankThatNeverJoinsAnAllReduce) {
  // The victim reports and blocks just before the call; the others (whose inputs are small, so
  // they are inside the call by then) wait for it there.
  ProcessGroup group(3, single("allreduce", 64 << 10, "automatic", 16 << 10, kKillTimeout), 0);
  ASSERT_TRUE(group.wait_for_progress(Clock::now() + 120s));
  const auto fault = Clock::now();
  group[0].signal(SIGKILL);
  expect_survivors_blame(group, 0, "peer_lost", fault);
}

TEST(SigStop, DuringAnAllGather) {
  ProcessGroup group(4, single("allgather", std::size_t{16} << 20, "ring", std::size_t{1} << 20),
                     3);
  ASSERT_TRUE(group.wait_for_progress(Clock::now() + 120s));
  const auto fault = Clock::now();
  group[3].signal(SIGSTOP);
  expect_survivors_blame(group, 3, "timeout", fault);
  group[3].signal(SIGKILL);
}

TEST(SigStop, DuringASmallAllGather) {
  ProcessGroup group(3, single("allgather", 100, "direct", 4096), 1);
  ASSERT_TRUE(group.wait_for_progress(Clock::now() + 60s));
  const auto fault = Clock::now();
  group[1].signal(SIGSTOP);
  expect_survivors_blame(group, 1, "timeout", fault);
  group[1].signal(SIGKILL);
}

TEST(Corruption, OfAFrameInFlightIsBlamedOnItsSender) {
  // Rank 1's transport flips a bit in its 10th outgoing data frame (the test hook of the TCP
  // transport): after the worker's barrier (a header and a completion notice to each of the 2
  // peers) and the all-gather's 2 headers, the 4th frame of the all-gather's payload. The
  // receiver's checksum catches it.
  ProcessGroup group(3, single("allgather", 100'000, "ring", 10'000), 1,
                     {{"PULSELOCO_TEST_CORRUPT_FRAME", "9"}});
  group.release_victim();
  const auto start = Clock::now();
  expect_survivors_blame(group, 1, "protocol", start);
  ASSERT_TRUE(group[1].wait(Clock::now() + 30s));
  EXPECT_EQ(group[1].exit_code(), 3) << group[1].output();
}

}  // namespace
}  // namespace pulseloco
