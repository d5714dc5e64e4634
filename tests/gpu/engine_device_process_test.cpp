// Ranks as processes sharing the one GPU, over TCP on loopback: groups of device ranks, and a
// group of two device ranks and one host rank, keep identical digests window after window (the
// engine also compares them every window and fails on a difference). Workers report on a pipe;
// the test reads their lines under a deadline, never sleeps. Skips without a CUDA device.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "transport/child_process.h"
#include "transport/loopback_group.h"

namespace pulseloco {
namespace {

using Clock = std::chrono::steady_clock;
constexpr const char* kWorker = PULSELOCO_ENGINE_DEVICE_WORKER;
constexpr auto kDeadline = std::chrono::seconds(240);

struct GroupResult {
  std::vector<int> status;
  std::vector<std::vector<std::string>> lines;
};

// Runs one worker per entry of `locations` ("device" or "host") as one TCP group.
GroupResult run_group(const std::vector<std::string>& locations, const std::string& mode,
                      const std::string& dtype, int windows) {
  const int world = static_cast<int>(locations.size());
  const std::uint16_t port = transport::testing::pick_free_port();
  std::vector<std::unique_ptr<testing::Child>> workers;
  for (int rank = 0; rank < world; ++rank) {
    workers.push_back(std::make_unique<testing::Child>(
        std::vector<std::string>{kWorker, "--location", locations[static_cast<std::size_t>(rank)],
                                 "--mode", mode, "--dtype", dtype, "--windows",
                                 std::to_string(windows)},
        std::map<std::string, std::string>{{"PULSELOCO_TRANSPORT", "tcp"},
                                           {"PULSELOCO_RENDEZVOUS", "env"},
                                           {"RANK", std::to_string(rank)},
                                           {"WORLD_SIZE", std::to_string(world)},
                                           {"MASTER_ADDR", "127.0.0.1"},
                                           {"MASTER_PORT", std::to_string(port)},
                                           {"PULSELOCO_LISTEN_ADDR", "127.0.0.1"},
                                           {"PULSELOCO_SECRET", "device process test"},
                                           {"PULSELOCO_CONNECT_TIMEOUT_MS", "60000"}},
        /*report_to_stdout=*/true));
  }
  GroupResult result;
  const auto deadline = Clock::now() + kDeadline;
  for (auto& worker : workers) {
    const int status = worker->wait_exit(deadline);  // reads every line until the exit
    result.status.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    result.lines.push_back(worker->lines());
  }
  return result;
}

// The digest lines of one worker, in order.
std::vector<std::string> digests_of(const std::vector<std::string>& lines) {
  std::vector<std::string> digests;
  for (const std::string& line : lines) {
    if (line.rfind("window=", 0) == 0) digests.push_back(line.substr(line.find("digest=") + 7));
  }
  return digests;
}

void expect_one_set_of_bits(const GroupResult& group, const std::vector<std::string>& locations,
                            int windows) {
  ASSERT_EQ(group.status.size(), locations.size());
  for (std::size_t r = 0; r < locations.size(); ++r) {
    std::string all;
    for (const auto& line : group.lines[r])
      all += line + "\n";
    ASSERT_EQ(group.status[r], 0) << "rank " << r << ":\n" << all;
    ASSERT_FALSE(group.lines[r].empty());
    const std::string expected =
        locations[r] == "device" ? "ready location=cuda:0" : "ready location=host";
    EXPECT_EQ(group.lines[r].front(), expected) << "rank " << r;
    EXPECT_EQ(digests_of(group.lines[r]).size(), static_cast<std::size_t>(windows));
    EXPECT_EQ(digests_of(group.lines[r]), digests_of(group.lines[0])) << "rank " << r;
  }
}

TEST(EngineDeviceProcesses, DeviceRanksOverTcpKeepIdenticalDigests) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  for (const std::string mode : {"pulse", "diloco"}) {
    const std::vector<std::string> locations{"device", "device"};
    const GroupResult group = run_group(locations, mode, "f32", 4);
    expect_one_set_of_bits(group, locations, 4);
  }
}

TEST(EngineDeviceProcesses, TwoDeviceRanksAndAHostRankKeepIdenticalDigestsForFiveWindows) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  for (const std::string dtype : {"f32", "bf16"}) {
    const std::vector<std::string> locations{"device", "host", "device"};
    const GroupResult mixed = run_group(locations, "pulse", dtype, 5);
    expect_one_set_of_bits(mixed, locations, 5);
    // And the same digests as a group that keeps all its state in host memory.
    const std::vector<std::string> hosts{"host", "host", "host"};
    const GroupResult host = run_group(hosts, "pulse", dtype, 5);
    expect_one_set_of_bits(host, hosts, 5);
    EXPECT_EQ(digests_of(mixed.lines[0]), digests_of(host.lines[0])) << dtype;
  }
}

}  // namespace
}  // namespace pulseloco
