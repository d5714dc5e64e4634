// ElasticEngine in one process: a Coordinator and several workers on threads, each with its own
// TCP data plane over loopback. A worker leaving mid-run and a worker joining mid-run; every
// window's digests agree and the survivors end identical. (Process-level faults: elastic_test.py.)
#include <pulseloco/elastic/elastic_engine.h>

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/unique_fd.h>
#include <pulseloco/elastic/coordinator.h>
#include "elastic/joiner_signal.h"
#include "engine/engine_test_util.h"

namespace pulseloco {
namespace {

EngineOptions worker_options(Exchange exchange = Exchange::automatic) {
  EngineOptions options;
  options.exchange = exchange;
  options.steps_per_window = 2;
  options.chunk_elements = 1024;
  options.bucket_elements = 4096;
  options.threads = 1;
  options.timeout = std::chrono::milliseconds(5000);
  return options;
}

// A coordinator on loopback admitting at every boundary.
elastic::CoordinatorOptions coordinator_options(int initial_workers, int min_workers) {
  return {.host = "127.0.0.1",
          .initial_workers = initial_workers,
          .min_workers = min_workers,
          .join_every_windows = 1,
          .regroup_timeout = std::chrono::milliseconds(15'000),
          .secret = "elastic-test"};
}

ElasticOptions elastic_options(std::uint16_t port, const std::string& worker) {
  ElasticOptions elastic;
  elastic.coordinator = fmt::format("127.0.0.1:{}", port);
  elastic.worker_id = worker;
  elastic.transport.tcp.listen_addr = "127.0.0.1";
  elastic.transport.tcp.connections_per_peer = 1;
  elastic.transport.connect_timeout = std::chrono::milliseconds(20'000);
  elastic.transport.tcp.secret = "elastic-test";
  elastic.admission_timeout = std::chrono::milliseconds(60'000);
  return elastic;
}

// Reports of every worker, by window, and the events the workers wait on.
struct Reports {
  std::mutex mutex;
  std::condition_variable changed;
  std::map<std::uint64_t, std::vector<WindowReport>> by_window;
  std::map<std::string, Digest> final_digest;
  testing::JoinerSignal joiner;

  void add(const WindowReport& report) {
    const std::lock_guard lock(mutex);
    by_window[report.window].push_back(report);
    changed.notify_all();
  }
  // Bounded waits on the events above; false on timeout.
  bool wait_for_window(std::uint64_t window) {
    std::unique_lock lock(mutex);
    return changed.wait_for(lock, std::chrono::seconds(120),
                            [&] { return by_window.count(window) > 0; });
  }
};

// Runs a worker until the group has committed `windows` windows, or `leave_after` of them.
// `hold_at`: before that window's inner steps, wait until the joiner has registered.
void run_worker(std::uint16_t port, const std::string& id, std::uint32_t seed,
                std::uint64_t windows, std::optional<std::uint64_t> leave_after,
                std::optional<std::uint64_t> hold_at, Reports& reports,
                std::function<void()> on_registered = {}, Exchange exchange = Exchange::automatic) {
  testing::LocalModel model = testing::make_model({0, 5, 3000, 2049}, DType::float32, 7);
  ElasticOptions elastic = elastic_options(port, id);
  elastic.on_registered = std::move(on_registered);
  ElasticEngine sync(testing::views_of(model), worker_options(exchange), elastic);
  // The loop sees only the interface it shares with Engine.
  WindowRunner& runner = sync;
  std::uint32_t step = 0;
  bool held = false;
  while (runner.engine().committed_windows() < windows) {
    if (hold_at && !held && runner.engine().committed_windows() == *hold_at) {
      held = true;
      if (!reports.joiner.wait_until_waiting())
        throw TimeoutError("the joiner never asked to join");
    }
    testing::local_training(model, 3e-5f, 1, seed + 1000 * step++);
    if (auto report = runner.after_optimizer_step()) {
      reports.add(*report);
      if (leave_after && runner.engine().committed_windows() >= *leave_after) {
        sync.leave();
        return;
      }
    }
  }
  const std::lock_guard lock(reports.mutex);
  reports.final_digest[id] = runner.engine().state_digest();
}

// Every exchange kind across regroups: the owner ranges follow each generation's size.
class ElasticExchange : public ::testing::TestWithParam<Exchange> {};

TEST_P(ElasticExchange, AWorkerLeavesAndAnotherJoinsAndTheReplicasStayIdentical) {
  const Exchange exchange = GetParam();
  elastic::Coordinator coordinator(coordinator_options(3, 2));
  const std::uint16_t port = coordinator.port();
  Reports reports;
  reports.joiner.coordinator = &coordinator;
  constexpr std::uint64_t kWindows = 7;
  std::vector<std::exception_ptr> errors(4);
  std::vector<std::thread> threads;
  for (int w = 0; w < 3; ++w) {
    threads.emplace_back([&, w] {
      try {
        // w2 leaves once window 1 has committed (its engine is destroyed mid-run).
        // w0 and w1 hold before window 4 until the coordinator has w3's request to join, so
        // that the boundary after window 4 admits it.
        run_worker(port, fmt::format("w{}", w), 10 + static_cast<std::uint32_t>(w), kWindows,
                   w == 2 ? std::optional<std::uint64_t>(2) : std::nullopt,
                   w == 2 ? std::nullopt : std::optional<std::uint64_t>(4), reports, {}, exchange);
      } catch (...) {
        errors[static_cast<std::size_t>(w)] = std::current_exception();
      }
    });
  }
  // w3 starts once window 3 has committed (an event, not a delay).
  const bool window_3 = reports.wait_for_window(3);
  threads.emplace_back([&] {
    try {
      run_worker(
          port, "w3", 13, kWindows, std::nullopt, std::nullopt, reports,
          [&] { reports.joiner.registered(); }, exchange);
    } catch (...) {
      errors[3] = std::current_exception();
    }
  });
  for (auto& thread : threads)
    thread.join();
  ASSERT_TRUE(window_3) << "window 3 never committed";
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
  coordinator.wait();

  for (std::uint64_t window = 0; window < kWindows; ++window) {
    const auto& list = reports.by_window[window];
    ASSERT_FALSE(list.empty()) << "window " << window;
    for (const auto& report : list) {
      EXPECT_EQ(report.digest, list.front().digest) << "window " << window;
      EXPECT_TRUE(report.replicas_identical);
      if (exchange != Exchange::automatic) {
        EXPECT_EQ(report.exchange, exchange_name(exchange)) << "window " << window;
      }
    }
    if (window < 2) {
      EXPECT_EQ(list.front().world_size, 3) << "window " << window;
    } else if (window <= 4) {
      EXPECT_EQ(list.front().world_size, 2) << "window " << window;
    }
  }
  // Admitted at the boundary after window 4: windows 5.. have w0, w1 and w3.
  for (const auto& report : reports.by_window[5]) {
    EXPECT_EQ(report.world_size, 3);
    // The survivors keep their relative order (which of w0 and w1 registered first is a race);
    // the new worker comes last.
    ASSERT_EQ(report.members.size(), 3u);
    EXPECT_EQ(std::set<std::string>(report.members.begin(), report.members.begin() + 2),
              (std::set<std::string>{"w0", "w1"}));
    EXPECT_EQ(report.members[2], "w3");
  }
  ASSERT_EQ(reports.final_digest.size(), 3u);
  for (const auto& [id, digest] : reports.final_digest)
    EXPECT_EQ(digest, reports.final_digest.begin()->second) << id;
}

INSTANTIATE_TEST_SUITE_P(Kinds, ElasticExchange,
                         ::testing::Values(Exchange::allgather, Exchange::reduction),
                         [](const ::testing::TestParamInfo<Exchange>& kind) {
                           return std::string(exchange_name(kind.param));
                         });

// Whether another socket can bind and listen on 127.0.0.1:port (as another process picking
// that port would, SO_REUSEADDR included).
bool another_socket_can_listen_on(std::uint16_t port) {
  const UniqueFd socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  const int one = 1;
  (void)::setsockopt(socket.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return ::bind(socket.get(), reinterpret_cast<const sockaddr*>(&address), sizeof(address)) == 0 &&
         ::listen(socket.get(), 1) == 0;
}

TEST(ElasticEngine, TheDataPortStaysTakenFromOneGenerationToTheNext) {
  // A group of one has no data listener: before the second worker arrives, the port this worker
  // registered is held only by its own socket. Another process that took it then would break
  // the next generation ("Address already in use").
  elastic::Coordinator coordinator(coordinator_options(1, 1));
  const std::uint16_t port = coordinator.port();
  Reports reports;
  reports.joiner.coordinator = &coordinator;
  constexpr std::uint64_t kWindows = 3;
  testing::LocalModel model = testing::make_model({0, 5, 3000, 2049}, DType::float32, 7);
  ElasticEngine sync(testing::views_of(model), worker_options(), elastic_options(port, "w0"));
  ASSERT_EQ(sync.group().size(), 1);
  EXPECT_FALSE(another_socket_can_listen_on(sync.data_port()));

  std::exception_ptr joiner_error;
  std::thread joiner([&] {
    try {
      run_worker(port, "w1", 11, kWindows, std::nullopt, std::nullopt, reports,
                 [&] { reports.joiner.registered(); });
    } catch (...) {
      joiner_error = std::current_exception();
    }
  });
  std::uint32_t step = 0;
  bool held = false;
  try {
    while (sync.engine().committed_windows() < kWindows) {
      if (!held && sync.engine().committed_windows() == 1) {
        held = true;
        // A joiner that asked during window 0 was admitted at the boundary after it; otherwise
        // this worker, the group's only member, holds until the joiner waits, so that the
        // boundary after window 1 admits it (no boundary passes while it holds).
        if (sync.group().size() == 1 && !reports.joiner.wait_until_waiting())
          throw TimeoutError("the joiner never asked to join");
      }
      testing::local_training(model, 3e-5f, 1, 10 + 1000 * step++);
      if (auto report = sync.after_optimizer_step()) reports.add(*report);
    }
  } catch (...) {
    sync.leave();
    joiner.join();
    throw;
  }
  joiner.join();
  if (joiner_error) std::rethrow_exception(joiner_error);
  EXPECT_EQ(sync.groups_joined(), 2);
  ASSERT_EQ(reports.by_window[2].size(), 2u);
  for (const auto& report : reports.by_window[2]) {
    EXPECT_EQ(report.world_size, 2);
    EXPECT_EQ(report.digest, reports.by_window[2].front().digest);
  }
  EXPECT_EQ(reports.final_digest.at("w1"), sync.engine().state_digest());
  sync.leave();
  coordinator.wait();
}

TEST(ElasticEngine, RefusesTransportsThatCannotChangeMembership) {
  testing::LocalModel model = testing::make_model({10}, DType::float32, 1);
  ElasticOptions elastic = elastic_options(1, "w");
  elastic.transport.backend = transport::Backend::mpi;
  EXPECT_THROW(ElasticEngine(testing::views_of(model), worker_options(), elastic), InvalidArgument);
  elastic.transport.backend = transport::Backend::tcp;
  elastic.coordinator.clear();
  EXPECT_THROW(ElasticEngine(testing::views_of(model), worker_options(), elastic), InvalidArgument);
}

// Refused in the constructor, before anything connects: nothing listens at either address.
TEST(ElasticEngine, RefusesOverlappedWindowsForAWorkerOfSeveralRanks) {
  testing::LocalModel model = testing::make_model({10}, DType::float32, 1);
  ElasticOptions elastic = elastic_options(1, "w");
  elastic.ranks_per_worker = 2;
  elastic.worker_link = "127.0.0.1:1";
  EngineOptions options = worker_options();
  options.overlap = Overlap::delayed;
  try {
    ElasticEngine refused(testing::views_of(model), options, elastic);
    ADD_FAILURE() << "a worker of two ranks accepted overlapped windows";
  } catch (const InvalidArgument& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("a worker of several ranks runs blocking windows only"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("overlap is 'delayed'"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace pulseloco
