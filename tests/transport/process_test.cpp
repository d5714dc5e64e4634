// Transports between real processes: workers joined by the environment rendezvous or started by
// mpirun, and the faults a survivor must turn into a prompt error naming the peer: SIGKILL
// during a small and during a large transfer, SIGSTOP, a wrong secret, a corrupted frame.
// Workers report progress over a pipe; the test acts on those reports, never on sleeps.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "transport/child_process.h"
#include "transport/loopback_group.h"

namespace pulseloco::transport {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using pulseloco::testing::Child;

constexpr const char* kWorker = PULSELOCO_TRANSPORT_WORKER;
constexpr auto kOpTimeout = 4000ms;  // the survivors' operation deadline in the fault tests
// How late a survivor's error report may come after its cause (a kill, or the deadline after a
// stop) on a loaded machine: a report that waits for a minute-long deadline still fails.
constexpr auto kReportSlack = 20s;
constexpr auto kTestDeadline = 120s;

// The value of "key=value" in a report line ("" when absent).
std::string field(const std::string& line, const std::string& key) {
  const auto at = line.find(key + "=");
  if (at == std::string::npos) return {};
  const auto begin = at + key.size() + 1;
  if (key == "what") return line.substr(begin);
  return line.substr(begin, line.find(' ', begin) - begin);
}

std::map<std::string, std::string> env_for(int rank, int world_size, std::uint16_t port,
                                           const std::string& secret = "process test secret") {
  return {{"PULSELOCO_TRANSPORT", "tcp"},
          {"PULSELOCO_RENDEZVOUS", "env"},
          {"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world_size)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)},
          {"PULSELOCO_LISTEN_ADDR", "127.0.0.1"},
          {"PULSELOCO_SECRET", secret},
          {"PULSELOCO_CONNECT_TIMEOUT_MS", "60000"}};
}

std::vector<std::string> worker_args(const std::string& scenario,
                                     std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {kWorker,
                                   "--scenario",
                                   scenario,
                                   "--report-fd",
                                   "3",
                                   "--timeout-ms",
                                   std::to_string(kOpTimeout.count())};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// Starts a group of workers (rank r runs scenarios[r]); retries with a new port when the
// rendezvous port was taken meanwhile. Returns once every worker reported "ready" or, with
// `error_counts_as_started`, an error instead (a worker may detect a peer's fault while its
// own transport is still starting: a peer that is up sends at once).
std::vector<std::unique_ptr<Child>> start_group(
    const std::vector<std::vector<std::string>>& args,
    const std::function<void(int, std::map<std::string, std::string>&)>& adjust = {},
    bool error_counts_as_started = false) {
  const int n = static_cast<int>(args.size());
  for (int attempt = 0;; ++attempt) {
    const auto port = testing::pick_free_port();
    std::vector<std::unique_ptr<Child>> children;
    for (int rank = 0; rank < n; ++rank) {
      auto env = env_for(rank, n, port);
      if (adjust) adjust(rank, env);
      children.push_back(std::make_unique<Child>(args[static_cast<std::size_t>(rank)], env));
    }
    const auto deadline = Clock::now() + kTestDeadline;
    bool port_taken = false;
    std::string problems;
    for (auto& child : children) {
      const auto line = child->next_line(deadline);
      if (line && line->rfind("ready", 0) == 0) continue;
      const bool cannot_listen = line && line->find("cannot listen") != std::string::npos;
      if (line && error_counts_as_started && !cannot_listen && line->rfind("error", 0) == 0)
        continue;
      port_taken = port_taken || cannot_listen;
      problems += line.value_or("<no report>") + "\n";
    }
    if (problems.empty()) return children;
    if (!port_taken || attempt >= 3) {
      ADD_FAILURE() << "workers did not get ready:\n" << problems;
      return {};
    }
  }
}

TEST(Processes, EnvironmentRendezvousExchange) {
  for (int n : {2, 4}) {
    // 64 MiB messages between two ranks; all the other sizes among four.
    std::vector<std::string> extra = {"--timeout-ms", "60000"};
    if (n == 2) extra.push_back("--large");
    std::vector<std::vector<std::string>> args(static_cast<std::size_t>(n),
                                               worker_args("exchange", extra));
    auto children = start_group(args);
    ASSERT_EQ(children.size(), static_cast<std::size_t>(n));
    for (auto& child : children) {
      const auto ok = child->expect("ok", Clock::now() + kTestDeadline);
      EXPECT_FALSE(ok.empty()) << "worker failed: "
                               << (child->lines().empty() ? "" : child->lines().back());
      EXPECT_EQ(child->wait_exit(Clock::now() + kTestDeadline), 0);
    }
  }
}

// Runs `mpirun -np n worker --scenario exchange ...`; returns the output and the exit status.
std::pair<std::string, int> run_mpirun(int n, const std::vector<std::string>& worker_extra) {
  std::vector<std::string> args = {PULSELOCO_MPIEXEC, "--allow-run-as-root",
                                   "--oversubscribe", "-np",
                                   std::to_string(n), kWorker};
  args.insert(args.end(), worker_extra.begin(), worker_extra.end());
  // OpenMPI's plug-ins leak at exit and are unloaded by then, so LeakSanitizer (debug preset)
  // cannot even name them: leak checking is off for the ranks mpirun starts.
  const char* asan = std::getenv("ASAN_OPTIONS");
  Child mpirun(args,
               {{"PULSELOCO_SECRET", "mpirun secret"},
                {"PULSELOCO_MPI_PART_BYTES", "1M"},
                {"ASAN_OPTIONS", std::string(asan ? asan : "") + ":detect_leaks=0"}},
               /*report_to_stdout=*/true);
  std::string output;
  const auto deadline = Clock::now() + kTestDeadline;
  while (auto line = mpirun.next_line(deadline))
    output += *line + "\n";
  const int status = mpirun.wait_exit(deadline);
  return {output, status};
}

class Mpirun : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(Mpirun, Exchange) {
  if (std::string_view(PULSELOCO_MPIEXEC).empty()) GTEST_SKIP() << "no mpirun in this build";
  const auto& [backend, n] = GetParam();
  std::vector<std::string> extra = {"--scenario", "exchange", "--backend", backend};
  if (n == 2) extra.push_back("--large");
  // MPI splits messages into parts of at most PULSELOCO_MPI_PART_BYTES (1 GiB by default);
  // 1 MiB parts make the 64 MiB messages exercise it.
  const auto [output, status] = run_mpirun(n, extra);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
  int ok = 0;
  for (std::size_t at = output.find("ok rank="); at != std::string::npos;
       at = output.find("ok rank=", at + 1))
    ++ok;
  EXPECT_EQ(ok, n) << output;
  EXPECT_NE(output.find("backend=" + backend), std::string::npos) << output;
}

INSTANTIATE_TEST_SUITE_P(Processes, Mpirun,
                         ::testing::Combine(::testing::Values("tcp", "mpi"),
                                            ::testing::Values(2, 3, 4)),
                         [](const auto& param_info) {
                           return std::get<0>(param_info.param) + "_np" +
                                  std::to_string(std::get<1>(param_info.param));
                         });

// Checks a survivor's error report: the kind, the peer named, and the time since `since`.
void expect_survivor_error(Child& survivor, const std::string& kind, int peer,
                           Clock::time_point since, std::chrono::milliseconds within) {
  const auto line = survivor.expect("error", since + within + 10s);
  const auto arrived = Clock::now();
  ASSERT_FALSE(line.empty()) << "the survivor reported no error; its last report: "
                             << (survivor.lines().empty() ? "" : survivor.lines().back());
  EXPECT_EQ(field(line, "kind"), kind) << line;
  EXPECT_EQ(field(line, "peer"), std::to_string(peer)) << line;
  EXPECT_NE(field(line, "what").find("peer " + std::to_string(peer)), std::string::npos) << line;
  EXPECT_LT(arrived - since, within) << line;
}

TEST(Faults, SigkillDuringASmallTransfer) {
  // The survivors' own deadline is a minute, so that the kill (noticed when the connection
  // closes) lands before it however late this process gets to send it.
  const auto survivor = worker_args("survivor-small", {"--timeout-ms", "60000"});
  auto children = start_group({survivor, worker_args("victim-idle"), survivor});
  ASSERT_EQ(children.size(), 3U);
  for (int rank : {0, 2})
    ASSERT_EQ(
        children[static_cast<std::size_t>(rank)]->expect("waiting", Clock::now() + kTestDeadline),
        "waiting");
  children[1]->signal(SIGKILL);
  const auto killed = Clock::now();
  for (int rank : {0, 2})
    expect_survivor_error(*children[static_cast<std::size_t>(rank)], "peer_lost", 1, killed,
                          kOpTimeout + kReportSlack);
}

TEST(Faults, SigkillDuringALargeTransfer) {
  auto children = start_group(
      {worker_args("survivor-large"), worker_args("victim-stream"), worker_args("survivor-large")});
  ASSERT_EQ(children.size(), 3U);
  // Each survivor has received a whole 64 MiB message and is in the middle of the next one.
  for (int rank : {0, 2})
    ASSERT_EQ(
        children[static_cast<std::size_t>(rank)]->expect("received", Clock::now() + kTestDeadline),
        "received n=1");
  children[1]->signal(SIGKILL);
  const auto killed = Clock::now();
  for (int rank : {0, 2})
    expect_survivor_error(*children[static_cast<std::size_t>(rank)], "peer_lost", 1, killed,
                          kOpTimeout + kReportSlack);
}

TEST(Faults, SigstopOfAPeerEndsInATimeoutNamingIt) {
  // The victim streams to both survivors until it is stopped: the stop, not an idle peer, is
  // what leaves a survivor's receive without data, its connection open.
  auto children = start_group(
      {worker_args("survivor-large"), worker_args("victim-stream"), worker_args("survivor-large")});
  ASSERT_EQ(children.size(), 3U);
  for (int rank : {0, 2})
    ASSERT_EQ(
        children[static_cast<std::size_t>(rank)]->expect("received", Clock::now() + kTestDeadline),
        "received n=1");
  children[1]->signal(SIGSTOP);
  const auto stopped = Clock::now();
  for (int rank : {0, 2}) {
    expect_survivor_error(*children[static_cast<std::size_t>(rank)], "timeout", 1, stopped,
                          kOpTimeout + kReportSlack);
    // The deadline is honoured, not cut short.
    const auto& line = children[static_cast<std::size_t>(rank)]->lines().back();
    EXPECT_GE(std::stoll(field(line, "elapsed_ms")), kOpTimeout.count()) << line;
  }
  children[1]->signal(SIGKILL);
}

TEST(Faults, TheIoTimeoutCatchesAStoppedReceiverBeforeTheOperationDeadline) {
  // The sender's own deadline is a minute; io_timeout (1 s) ends the stalled connection first.
  constexpr auto kIoTimeout = 1000ms;
  auto children = start_group(
      {worker_args("survivor-send", {"--timeout-ms", "60000"}), worker_args("victim-idle")},
      [&](int, std::map<std::string, std::string>& env) {
        env["PULSELOCO_IO_TIMEOUT_MS"] = std::to_string(kIoTimeout.count());
      });
  ASSERT_EQ(children.size(), 2U);
  ASSERT_EQ(children[0]->expect("sent", Clock::now() + kTestDeadline), "sent n=1");
  children[1]->signal(SIGSTOP);
  const auto stopped = Clock::now();
  // The kernel buffers fill within milliseconds; then the connection makes no progress. The
  // bound leaves a loaded machine slack yet stays far below the sender's 60 s deadline, which
  // would otherwise end the send; the message names the io_timeout check.
  expect_survivor_error(*children[0], "timeout", 1, stopped, kIoTimeout + kReportSlack);
  const auto& line = children[0]->lines().back();
  EXPECT_NE(line.find("made no progress sending"), std::string::npos) << line;
  children[1]->signal(SIGKILL);
}

TEST(Faults, AWrongSecretIsRefusedAndTheGroupFormsAnyway) {
  for (int attempt = 0;; ++attempt) {
    const auto port = testing::pick_free_port();
    Child rank0(worker_args("exchange"), env_for(0, 2, port));
    // The intruder claims rank 1 with the wrong secret; the rendezvous server refuses it.
    Child intruder(worker_args("join"), env_for(1, 2, port, "a guessed secret"));
    const auto refused = intruder.expect("error", Clock::now() + kTestDeadline);
    if (refused.find("cannot listen") != std::string::npos && attempt < 3) continue;
    EXPECT_EQ(field(refused, "kind"), "protocol_violation") << refused;
    EXPECT_NE(refused.find("authentication failed"), std::string::npos) << refused;
    const int status = intruder.wait_exit(Clock::now() + kTestDeadline);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 1) << status;
    // The real rank 1 joins and the group works.
    Child rank1(worker_args("exchange"), env_for(1, 2, port));
    for (Child* child : {&rank0, &rank1}) {
      const auto ok = child->expect("ok", Clock::now() + kTestDeadline);
      EXPECT_FALSE(ok.empty()) << (child->lines().empty() ? "" : child->lines().back());
      EXPECT_EQ(child->wait_exit(Clock::now() + kTestDeadline), 0);
    }
    break;
  }
}

class CorruptedFrame : public ::testing::TestWithParam<std::string> {};

TEST_P(CorruptedFrame, IsDetectedByTheReceiverAndBothNameTheirPeer) {
  // Rank 0 flips a bit in its first outgoing frame (the test hook). It sends that frame as soon
  // as its transport is up, which may be before rank 1's is: rank 1 then reports the corruption
  // instead of "ready".
  auto children = start_group(
      {worker_args("exchange", {"--rounds", "3"}), worker_args("exchange", {"--rounds", "3"})},
      [&](int rank, std::map<std::string, std::string>& env) {
        if (rank == 0) env["PULSELOCO_TEST_CORRUPT_FRAME"] = "0" + GetParam();
      },
      /*error_counts_as_started=*/true);
  ASSERT_EQ(children.size(), 2U);
  const auto now = Clock::now();
  const auto detected = children[1]->seen_or_expect("error", now + kTestDeadline);
  EXPECT_EQ(field(detected, "kind"), "protocol_violation") << detected;
  EXPECT_EQ(field(detected, "peer"), "0") << detected;
  EXPECT_NE(detected.find(GetParam() == ":header" ? "header checksum mismatch"
                                                  : "payload checksum mismatch"),
            std::string::npos)
      << detected;
  const auto told = children[0]->seen_or_expect("error", now + kTestDeadline);
  EXPECT_EQ(field(told, "kind"), "peer_lost") << told;
  EXPECT_EQ(field(told, "peer"), "1") << told;
}

INSTANTIATE_TEST_SUITE_P(Faults, CorruptedFrame, ::testing::Values(":payload", ":header"),
                         [](const auto& param_info) { return param_info.param.substr(1); });

}  // namespace
}  // namespace pulseloco::transport
