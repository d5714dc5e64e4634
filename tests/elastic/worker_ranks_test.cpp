// Elastic workers of several ranks in one process (ElasticOptions::ranks_per_worker): a
// Coordinator, and workers of two local ranks whose ranks run on threads, each local rank over
// its own share of the model. A worker joins as a whole at a boundary, each share's group stays
// bit-identical, and a worker whose layout differs is refused naming both. (A local rank killed
// in a real process: elastic_test.py, scenario kill-local-rank.)
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <utility>

#include <pulseloco/base/errors.h>
#include <pulseloco/elastic/coordinator.h>
#include <pulseloco/elastic/elastic_engine.h>
#include <pulseloco/group/rendezvous_server.h>
#include "elastic/joiner_signal.h"
#include "engine/engine_test_util.h"

namespace pulseloco {
namespace {

constexpr int kRanksPerWorker = 2;
// Local rank j's share of the model (tensor sizes).
const std::vector<std::vector<std::uint64_t>> kShares = {{3000, 5}, {2049}};

EngineOptions window_options() {
  EngineOptions options;
  options.steps_per_window = 2;
  options.chunk_elements = 1024;
  options.bucket_elements = 4096;
  options.threads = 1;
  options.timeout = std::chrono::milliseconds(5000);
  return options;
}

elastic::CoordinatorOptions coordinator_options(int initial_workers) {
  return {.host = "127.0.0.1",
          .initial_workers = initial_workers,
          .min_workers = 1,
          .join_every_windows = 1,
          .regroup_timeout = std::chrono::milliseconds(15'000),
          .secret = "worker-ranks-test"};
}

// Local rank `local_rank` of worker `worker`, whose ranks link up through the rendezvous server
// at 127.0.0.1:`link_port` (LinkServer).
ElasticOptions local_rank_options(std::uint16_t coordinator, const std::string& worker,
                                  int local_rank, int ranks, std::uint16_t link_port) {
  ElasticOptions elastic;
  elastic.transport.external_rendezvous_server = true;
  elastic.coordinator = fmt::format("127.0.0.1:{}", coordinator);
  // Only local rank 0's id names the worker; the others' are overridden by it.
  elastic.worker_id = local_rank == 0 ? worker : fmt::format("{}-local{}", worker, local_rank);
  elastic.transport.tcp.listen_addr = "127.0.0.1";
  elastic.transport.tcp.connections_per_peer = 1;
  elastic.transport.connect_timeout = std::chrono::milliseconds(20'000);
  elastic.transport.tcp.secret = "worker-ranks-test";
  elastic.admission_timeout = std::chrono::milliseconds(60'000);
  elastic.local_rank = local_rank;
  elastic.ranks_per_worker = ranks;
  elastic.worker_link = fmt::format("127.0.0.1:{}", link_port);
  elastic.worker_link_timeout = std::chrono::milliseconds(60'000);
  return elastic;
}

// The rendezvous of one worker's link, on a free port the test does not have to guess.
std::unique_ptr<group::RendezvousServer> link_server(int ranks) {
  return std::make_unique<group::RendezvousServer>(
      "127.0.0.1", 0, ranks, local_rank_options(0, "any", 0, ranks, 0).transport.tcp,
      transport::deadline_after(std::chrono::seconds(60)));
}

struct Reports {
  std::mutex mutex;
  std::condition_variable changed;
  // (local rank, window) -> every worker's report of that share's window.
  std::map<std::pair<int, std::uint64_t>, std::vector<WindowReport>> by_share_window;
  std::map<std::pair<std::string, int>, Digest> final_digest;  // (worker, local rank)
  std::map<std::pair<std::string, int>, std::string> worker_ids;
  testing::JoinerSignal joiner;

  void add(int local_rank, const WindowReport& report) {
    const std::lock_guard lock(mutex);
    by_share_window[{local_rank, report.window}].push_back(report);
    changed.notify_all();
  }
  bool wait_for_window(int local_rank, std::uint64_t window) {
    std::unique_lock lock(mutex);
    return changed.wait_for(lock, std::chrono::seconds(120), [&] {
      return by_share_window.count({local_rank, window}) > 0;
    });
  }
};

// One local rank's training loop until its share's group has committed `windows` windows.
// `hold_at`: before that window's inner steps, wait until the joiner is waiting.
void run_local_rank(ElasticOptions elastic, const std::string& worker, std::uint32_t seed,
                    std::uint64_t windows, std::optional<std::uint64_t> hold_at, Reports& reports) {
  const int local_rank = elastic.local_rank;
  testing::LocalModel model = testing::make_model(kShares[static_cast<std::size_t>(local_rank)],
                                                  DType::float32, 7 + local_rank);
  ElasticEngine sync(testing::views_of(model), window_options(), std::move(elastic));
  std::uint32_t step = 0;
  bool held = false;
  while (sync.engine().committed_windows() < windows) {
    if (hold_at && !held && sync.engine().committed_windows() == *hold_at) {
      held = true;
      if (!reports.joiner.wait_until_waiting())
        throw TimeoutError("the joiner never asked to join");
    }
    testing::local_training(model, 3e-5f, 1, seed + 1000 * step++);
    if (auto report = sync.after_optimizer_step()) reports.add(local_rank, *report);
  }
  const std::lock_guard lock(reports.mutex);
  reports.final_digest[{worker, local_rank}] = sync.engine().state_digest();
  reports.worker_ids[{worker, local_rank}] = sync.worker_id();
}

// Runs every local rank of `worker` on threads (their errors go to `errors`); `link` is the
// worker's link rendezvous.
std::vector<std::thread> start_worker(std::uint16_t coordinator, const std::string& worker,
                                      std::uint32_t seed, std::uint64_t windows,
                                      std::optional<std::uint64_t> hold_at, Reports& reports,
                                      std::vector<std::exception_ptr>& errors,
                                      const group::RendezvousServer& link,
                                      bool signals_registration = false) {
  const std::uint16_t link_port = link.port();
  std::vector<std::thread> threads;
  for (int j = 0; j < kRanksPerWorker; ++j) {
    ElasticOptions elastic = local_rank_options(coordinator, worker, j, kRanksPerWorker, link_port);
    if (signals_registration && j == 0)
      elastic.on_registered = [&reports] { reports.joiner.registered(); };
    errors.emplace_back();
    threads.emplace_back([&, elastic = std::move(elastic), worker, seed, windows, hold_at,
                          slot = errors.size() - 1]() mutable {
      try {
        run_local_rank(std::move(elastic), worker, seed, windows, hold_at, reports);
      } catch (...) {
        errors[slot] = std::current_exception();
      }
    });
  }
  return threads;
}

// Every share's window `window` was reported by `workers` workers with one digest.
void expect_every_share_identical(Reports& reports, std::uint64_t window, std::size_t workers) {
  for (int j = 0; j < kRanksPerWorker; ++j) {
    const auto& list = reports.by_share_window[{j, window}];
    ASSERT_EQ(list.size(), workers) << "local rank " << j << ", window " << window;
    for (const auto& report : list) {
      EXPECT_EQ(report.digest, list.front().digest) << "local rank " << j << ", window " << window;
      EXPECT_EQ(report.world_size, static_cast<int>(workers));
      EXPECT_EQ(report.parameters, j == 0 ? 3005u : 2049u);
    }
  }
}

TEST(ElasticWorkerRanks, AWorkerJoinsAsAWholeAndEveryShareStaysIdenticalAcrossWorkers) {
  elastic::Coordinator coordinator(coordinator_options(2));
  Reports reports;
  reports.joiner.coordinator = &coordinator;
  constexpr std::uint64_t kWindows = 5;
  std::vector<std::exception_ptr> errors;
  errors.reserve(3 * kRanksPerWorker);  // the threads keep slots' addresses
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<group::RendezvousServer>> links;
  for (int w = 0; w < 3; ++w)
    links.push_back(link_server(kRanksPerWorker));
  // a and b hold before window 2 until c waits, so that the boundary after window 2 admits it.
  for (const auto& [worker, seed, link] :
       {std::tuple<std::string, std::uint32_t, int>{"a", 10, 0}, {"b", 20, 1}}) {
    auto started =
        start_worker(coordinator.port(), worker, seed, kWindows, 2, reports, errors, *links[link]);
    for (auto& thread : started)
      threads.push_back(std::move(thread));
  }
  // c starts once window 1 has committed (an event, not a delay).
  const bool window_1 = reports.wait_for_window(0, 1);
  auto joiner = start_worker(coordinator.port(), "c", 30, kWindows, std::nullopt, reports, errors,
                             *links[2], true);
  for (auto& thread : joiner)
    threads.push_back(std::move(thread));
  for (auto& thread : threads)
    thread.join();
  ASSERT_TRUE(window_1) << "window 1 never committed";
  for (const auto& error : errors)
    if (error) std::rethrow_exception(error);
  coordinator.wait();

  for (std::uint64_t window = 0; window < kWindows; ++window) {
    expect_every_share_identical(reports, window, window <= 2 ? 2 : 3);
    // The worker is the unit of membership: both shares' groups are the same generation of the
    // same workers.
    const auto& first = reports.by_share_window[{0, window}].front();
    for (const auto& report : reports.by_share_window[{1, window}]) {
      EXPECT_EQ(report.generation, first.generation) << "window " << window;
      EXPECT_EQ(report.members, first.members) << "window " << window;
    }
  }
  const auto& last = reports.by_share_window[{0, kWindows - 1}].front();
  ASSERT_EQ(last.members.size(), 3u);
  EXPECT_EQ(last.members[2], "c");  // the joiner after the survivors, named by its local rank 0
  for (const std::string worker : {"a", "b", "c"}) {
    for (int j = 0; j < kRanksPerWorker; ++j) {
      EXPECT_EQ(reports.worker_ids.at({worker, j}), worker) << "local rank " << j;
      EXPECT_EQ(reports.final_digest.at({worker, j}), reports.final_digest.at({"a", j}))
          << "worker " << worker << ", local rank " << j;
    }
  }
  EXPECT_NE(reports.final_digest.at({"a", 0}), reports.final_digest.at({"a", 1}));
}

TEST(ElasticWorkerRanks, AWorkerThatLeavesLeavesEveryShareAndTheOthersRegroupWithoutIt) {
  elastic::Coordinator coordinator(coordinator_options(3));
  Reports reports;
  reports.joiner.coordinator = &coordinator;
  constexpr std::uint64_t kWindows = 4;
  std::vector<std::exception_ptr> errors;
  errors.reserve(3 * kRanksPerWorker);
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<group::RendezvousServer>> links;
  // c leaves after window 1: its local ranks' engines are destroyed, local rank 0 tells the
  // coordinator. a's and b's next window fails in both shares; they regroup together.
  for (const auto& [worker, seed, windows] :
       {std::tuple<std::string, std::uint32_t, std::uint64_t>{"a", 10, kWindows},
        {"b", 20, kWindows},
        {"c", 30, 2}}) {
    links.push_back(link_server(kRanksPerWorker));
    auto started = start_worker(coordinator.port(), worker, seed, windows, std::nullopt, reports,
                                errors, *links.back());
    for (auto& thread : started)
      threads.push_back(std::move(thread));
  }
  for (auto& thread : threads)
    thread.join();
  for (const auto& error : errors)
    if (error) std::rethrow_exception(error);
  coordinator.wait();

  for (std::uint64_t window = 0; window < kWindows; ++window)
    expect_every_share_identical(reports, window, window < 2 ? 3 : 2);
  const auto& after = reports.by_share_window[{1, kWindows - 1}].front();
  // (Which of a and b registered first, and so ranks first, is a race.)
  EXPECT_EQ(std::set<std::string>(after.members.begin(), after.members.end()),
            (std::set<std::string>{"a", "b"}));
  for (int j = 0; j < kRanksPerWorker; ++j)
    EXPECT_EQ(reports.final_digest.at({"a", j}), reports.final_digest.at({"b", j})) << j;
}

TEST(ElasticWorkerRanks, AWorkerOfAnotherLayoutIsRefusedOnEveryLocalRankNamingBoth) {
  elastic::Coordinator coordinator(coordinator_options(1));
  Reports reports;
  reports.joiner.coordinator = &coordinator;
  std::vector<std::exception_ptr> errors;
  errors.reserve(kRanksPerWorker);
  // Worker a (two ranks) forms the run and stays in it while the others try to register.
  const auto a_link = link_server(kRanksPerWorker);
  const std::uint16_t link_port = a_link->port();
  std::vector<std::unique_ptr<ElasticEngine>> a(kRanksPerWorker);
  std::vector<testing::LocalModel> a_models;
  for (int j = 0; j < kRanksPerWorker; ++j)
    a_models.push_back(
        testing::make_model(kShares[static_cast<std::size_t>(j)], DType::float32, 7));
  {
    std::vector<std::thread> threads;
    for (int j = 0; j < kRanksPerWorker; ++j) {
      errors.emplace_back();
      threads.emplace_back([&, j] {
        try {
          a[static_cast<std::size_t>(j)] = std::make_unique<ElasticEngine>(
              testing::views_of(a_models[static_cast<std::size_t>(j)]), window_options(),
              local_rank_options(coordinator.port(), "a", j, kRanksPerWorker, link_port));
        } catch (...) {
          errors[static_cast<std::size_t>(j)] = std::current_exception();
        }
      });
    }
    for (auto& thread : threads)
      thread.join();
    for (const auto& error : errors)
      if (error) std::rethrow_exception(error);
  }

  // A worker of one rank.
  testing::LocalModel solo = testing::make_model({10}, DType::float32, 1);
  ElasticOptions single = local_rank_options(coordinator.port(), "solo", 0, 1, 0);
  single.worker_link.clear();
  try {
    ElasticEngine refused(testing::views_of(solo), window_options(), single);
    ADD_FAILURE() << "a worker of one rank joined a run of workers of two";
  } catch (const ProtocolError& error) {
    EXPECT_NE(std::string(error.what())
                  .find("worker layouts differ: worker solo has 1 rank; the run's workers have 2 "
                        "(worker a registered first with that many)"),
              std::string::npos)
        << error.what();
  }

  // A worker of three ranks: every local rank fails with local rank 0's refusal.
  const auto trio_server = link_server(3);
  const std::uint16_t trio_link = trio_server->port();
  std::vector<std::string> messages(3);
  std::vector<std::thread> trio;
  std::vector<testing::LocalModel> trio_models;
  for (int j = 0; j < 3; ++j)
    trio_models.push_back(testing::make_model({10}, DType::float32, 1));
  for (int j = 0; j < 3; ++j) {
    trio.emplace_back([&, j] {
      try {
        ElasticEngine refused(testing::views_of(trio_models[static_cast<std::size_t>(j)]),
                              window_options(),
                              local_rank_options(coordinator.port(), "trio", j, 3, trio_link));
        messages[static_cast<std::size_t>(j)] = "joined";
      } catch (const ProtocolError& error) {
        messages[static_cast<std::size_t>(j)] = error.what();
      } catch (const std::exception& error) {
        messages[static_cast<std::size_t>(j)] = std::string("another error: ") + error.what();
      }
    });
  }
  for (auto& thread : trio)
    thread.join();
  for (int j = 0; j < 3; ++j) {
    EXPECT_NE(messages[static_cast<std::size_t>(j)].find(
                  "worker trio has 3 ranks; the run's workers have 2 (worker a registered first"),
              std::string::npos)
        << "local rank " << j << ": " << messages[static_cast<std::size_t>(j)];
  }
  EXPECT_NE(messages[1].find("worker trio (from its local rank 0)"), std::string::npos)
      << messages[1];

  for (auto& engine : a)
    engine->leave();
  coordinator.wait();
}

}  // namespace
}  // namespace pulseloco
