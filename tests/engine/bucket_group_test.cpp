// A group exchanging through a bucket of a real S3-compatible server (Swift with s3api,
// tests/io/s3_test_server.h; engine/bucket_transport.h): four ranks stay bit-identical to the
// same job over TCP, window by window; a rank killed in the middle of a window is named by the
// others within 2x the timeout; dense modes run through it; overlapped windows are refused; forged
// and replayed objects are refused naming the object and the rank; each rank removes its objects
// two windows after writing them.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/bucket_transport.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/io/s3_client.h>
#include <pulseloco/io/sealed_object.h>
#include <pulseloco/transport/native_collectives.h>
#include "collectives/test_groups.h"
#include "engine/engine_test_util.h"
#include "io/s3_test_server.h"

namespace pulseloco::testing {
namespace {

constexpr const char* kSecret = "bucket-group-test-secret";

class BucketGroup : public testing::BucketPrefixTest {
 protected:
  void SetUp() override { attach(S3TestServer::instance(), "exchange"); }

  void expect_killed_rank_named(const std::string& phase);

  [[nodiscard]] BucketGroupOptions options(int rank, int world, const std::string& job) const {
    BucketGroupOptions options;
    options.address = url_;
    options.job_id = job;
    options.secret = kSecret;
    options.rank = rank;
    options.world_size = world;
    options.form_timeout = std::chrono::milliseconds(20'000);
    options.settings = server_->settings();
    return options;
  }

  // One transport per rank of job `job`, formed together.
  [[nodiscard]] std::vector<std::unique_ptr<transport::Transport>> group(int world,
                                                                         const std::string& job) {
    std::vector<std::unique_ptr<transport::Transport>> transports(static_cast<std::size_t>(world));
    rethrow_first(run_ranks(world, [&](int r) {
      transports[static_cast<std::size_t>(r)] = join_bucket_group(options(r, world, job));
    }));
    return transports;
  }
};

struct JobRun {
  std::vector<std::vector<Digest>> digests;  // per window, per rank
  std::vector<LocalModel> models;
};

// Ten windows of a four-rank job over `transports`, with the same local training every time.
JobRun run_job(std::vector<std::unique_ptr<transport::Transport>> transports) {
  const int world = static_cast<int>(transports.size());
  JobRun run;
  for (int r = 0; r < world; ++r)
    run.models.push_back(make_model({0, 1, 37, 3000, 4097}, DType::float32, r == 0 ? 7 : 1000 + r));
  EngineOptions options = small_options();
  options.exchange = Exchange::allgather;
  std::vector<std::unique_ptr<Engine>> engines(static_cast<std::size_t>(world));
  rethrow_first(run_ranks(world, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    engines[i] =
        std::make_unique<Engine>(views_of(run.models[i]), options, std::move(transports[i]));
  }));
  for (int window = 0; window < 10; ++window) {
    for (int r = 0; r < world; ++r) {
      local_training(run.models[static_cast<std::size_t>(r)], 3e-5f, 4,
                     static_cast<std::uint32_t>(100 * window + r));
    }
    std::vector<Digest> digests(static_cast<std::size_t>(world));
    rethrow_first(run_ranks(world, [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      const WindowReport report = engines[i]->run_window();
      EXPECT_EQ(report.window, static_cast<std::uint64_t>(window));
      EXPECT_TRUE(report.replicas_identical);
      digests[i] = report.digest;
    }));
    run.digests.push_back(digests);
  }
  return run;
}

TEST_F(BucketGroup, FourRanksStayBitIdenticalToTcpForTenWindows) {
  const JobRun tcp = run_job(make_test_group("tcp", 4));
  const JobRun bucket = run_job(group(4, "job-identical"));
  ASSERT_EQ(bucket.digests.size(), 10u);
  for (std::size_t window = 0; window < 10; ++window)
    EXPECT_EQ(bucket.digests[window], tcp.digests[window]) << "window " << window;
  for (std::size_t r = 0; r < 4; ++r) {
    for (std::size_t t = 0; t < tcp.models[r].size(); ++t)
      EXPECT_EQ(bucket.models[r][t].f32, tcp.models[r][t].f32) << "rank " << r << " tensor " << t;
  }
  // Each rank removed what it wrote before window 8: the hellos and windows 8 and 9 remain.
  for (const std::string& name : object_names()) {
    EXPECT_TRUE(name.starts_with("job-identical/hello/") ||
                name.starts_with("job-identical/w0000000008/") ||
                name.starts_with("job-identical/w0000000009/"))
        << name;
  }
  EXPECT_EQ(object_names().count("job-identical/hello/r3"), 1u);
}

// Rank 2 of four is a process of its own, which SIGKILLs itself at `phase` of window 1
// (PULSELOCO_FAULT): the three others fail within 2x the timeout, naming it.
void BucketGroup::expect_killed_rank_named(const std::string& phase) {
  constexpr int kWorld = 4;
  constexpr int kKilled = 2;
  const std::string job = "job-killed-" + phase;
  EngineOptions engine_options = small_options();
  engine_options.timeout = std::chrono::milliseconds(3'000);
  const auto model_of = [](int r) {
    return make_model({3000}, DType::float32, r == 0 ? 7 : 1000 + static_cast<std::uint32_t>(r));
  };
  // Forked before this process starts any thread.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 3;  // the fault did not fire
    try {
      const std::string fault = "window=1,phase=" + phase + ",action=kill";
      ::setenv("PULSELOCO_FAULT", fault.c_str(), 1);
      LocalModel model = model_of(kKilled);
      Engine engine(views_of(model), engine_options,
                    join_bucket_group(options(kKilled, kWorld, job)));
      for (int window = 0; window < 2; ++window) {
        local_training(model, 3e-5f, 4, static_cast<std::uint32_t>(10 * window + kKilled));
        (void)engine.run_window();
      }
    } catch (...) {
      code = 4;
    }
    ::_exit(code);
  }
  // The bound runs from the child's death, not from the survivors' window start: they wait for
  // the child at the gate (and, at "exchange", for its message), so that start would add the
  // time the child took to reach the fault.
  int status = 0;
  pid_t reaped = -1;
  std::chrono::steady_clock::time_point died;
  std::jthread reaper([&] {
    reaped = ::waitpid(child, &status, 0);
    died = std::chrono::steady_clock::now();
  });
  std::vector<LocalModel> models(kWorld);
  std::vector<std::unique_ptr<Engine>> engines(kWorld);
  std::vector<std::chrono::steady_clock::time_point> failed_at(kWorld);
  const auto errors = run_ranks(kWorld, [&](int r) {
    if (r == kKilled) return;
    const auto i = static_cast<std::size_t>(r);
    models[i] = model_of(r);
    engines[i] = std::make_unique<Engine>(views_of(models[i]), engine_options,
                                          join_bucket_group(options(r, kWorld, job)));
    local_training(models[i], 3e-5f, 4, static_cast<std::uint32_t>(r));
    (void)engines[i]->run_window();
    local_training(models[i], 3e-5f, 4, static_cast<std::uint32_t>(10 + r));
    try {
      (void)engines[i]->run_window();
      ADD_FAILURE() << "rank " << r << " finished window 1 without rank " << kKilled;
    } catch (const Error& error) {
      failed_at[i] = std::chrono::steady_clock::now();
      EXPECT_EQ(error.kind(), ErrorKind::timeout) << error.what();
      EXPECT_EQ(error.context().peer, kKilled) << error.what();
    }
  });
  reaper.join();
  ASSERT_EQ(reaped, child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
  for (int r = 0; r < kWorld; ++r) {
    const auto failed = failed_at[static_cast<std::size_t>(r)];
    if (r == kKilled || failed == std::chrono::steady_clock::time_point{}) continue;
    EXPECT_LT(failed - died, 2 * engine_options.timeout) << "rank " << r;
  }
  rethrow_first(errors);
}

// Killed before it wrote its window message: the others wait for that object.
TEST_F(BucketGroup, ARankKilledBeforeItsMessageIsNamedWithinTwiceTheTimeout) {
  expect_killed_rank_named("gate");
}

// Killed in the middle of the exchange, its message written: the others wait for its vote.
TEST_F(BucketGroup, ARankKilledMidExchangeIsNamedWithinTwiceTheTimeout) {
  expect_killed_rank_named("exchange");
}

TEST_F(BucketGroup, ARankThatNeverJoinsIsNamed) {
  auto errors = run_ranks(2, [&](int r) {
    BucketGroupOptions o = options(r, 3, "job-absent");
    o.form_timeout = std::chrono::milliseconds(1'000);
    (void)join_bucket_group(o);
  });
  for (const auto& error : errors) {
    try {
      ASSERT_TRUE(error);
      std::rethrow_exception(error);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::timeout) << e.what();
      EXPECT_EQ(e.context().peer, 2) << e.what();
    }
  }
}

// Rank 1 joins with another world size: rank 0, which has every hello it waits for, names it;
// rank 1 waits for a rank 2 that does not come.
TEST_F(BucketGroup, ARankWithAnotherWorldSizeIsNamed) {
  auto errors = run_ranks(2, [&](int r) {
    BucketGroupOptions o = options(r, r == 0 ? 2 : 3, "job-world-sizes");
    o.form_timeout = std::chrono::milliseconds(r == 0 ? 20'000 : 1'000);
    (void)join_bucket_group(o);
  });
  ASSERT_TRUE(errors[0]);
  try {
    std::rethrow_exception(errors[0]);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::invalid_argument) << e.what();
    EXPECT_EQ(e.context().peer, 1) << e.what();
    EXPECT_NE(std::string(e.what()).find("world size 3"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(errors[1]);
}

// A group on a server of this test's own, which it stops.
class FailingBucketGroup : public BucketGroup {
 protected:
  void SetUp() override { attach(S3TestServer::own(), "failing"); }
};

// A bucket that answers every request with a 5xx ends a collective at its deadline: the
// client's retries (here enough for minutes) stop there.
TEST_F(FailingBucketGroup, ACollectiveEndsAtItsDeadlineWhileTheBucketFails) {
  std::vector<std::unique_ptr<transport::Transport>> transports(2);
  rethrow_first(run_ranks(2, [&](int r) {
    BucketGroupOptions o = options(r, 2, "job-failing");
    o.settings->max_attempts = 1000;
    o.settings->first_backoff = std::chrono::milliseconds(50);
    o.settings->max_backoff = std::chrono::milliseconds(50);
    transports[static_cast<std::size_t>(r)] = join_bucket_group(o);
  }));
  server_->stop("object");
  std::vector<std::byte> mine(8), other(8);
  const std::vector<std::span<std::byte>> out{mine, other};
  try {
    (void)transport::native_collectives(*transports[0])
        ->allgather_into(std::span(mine), out,
                         transport::deadline_after(std::chrono::milliseconds(1'000)));
    FAIL() << "a collective through a failing bucket succeeded";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::timeout) << error.what();
    EXPECT_NE(error.message().find("deadline"), std::string::npos) << error.what();
  }
  server_->start("object");
}

TEST_F(BucketGroup, AForgedHelloIsRefusedNamingTheObjectAndTheRank) {
  // Rank 1's hello, written by someone without the job's secret.
  const std::string name = "job-forged/hello/r1";
  const std::vector<std::byte> payload(16, std::byte{2});
  client_->put_object(address_.bucket, address_.key(name),
                      io::seal_object("not-the-secret", address_.key(name), payload));
  BucketGroupOptions mine = options(0, 2, "job-forged");
  try {
    (void)join_bucket_group(mine);
    FAIL() << "a forged hello was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::protocol) << error.what();
    EXPECT_EQ(error.context().peer, 1) << error.what();
    EXPECT_NE(error.message().find(address_.url(name)), std::string::npos) << error.what();
  }
}

TEST_F(BucketGroup, ObjectsReplayedFromAnotherJobOrWindowAreRefused) {
  // Job A: two ranks all-gather once in window 0.
  auto a = group(2, "job-a");
  rethrow_first(run_ranks(2, [&](int r) {
    std::vector<std::byte> mine(8, std::byte(r)), other(8);
    std::vector<std::span<std::byte>> out{mine, other};
    if (r == 1) std::swap(out[0], out[1]);
    ASSERT_TRUE(transport::native_collectives(*a[static_cast<std::size_t>(r)])
                    ->allgather_into(mine, out,
                                     transport::deadline_after(std::chrono::milliseconds(10'000))));
  }));
  const auto copy = [&](const std::string& from, const std::string& to) {
    const auto bytes = client_->get_bytes(address_.bucket, address_.key(from), 1 << 20);
    ASSERT_TRUE(bytes.has_value()) << from;
    client_->put_object(address_.bucket, address_.key(to), *bytes);
  };
  // Job B: rank 1's authentic hello of job A, replayed.
  copy("job-a/hello/r1", "job-b/hello/r1");
  try {
    (void)join_bucket_group(options(0, 2, "job-b"));
    FAIL() << "a hello replayed from another job was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::protocol) << error.what();
    EXPECT_EQ(error.context().peer, 1) << error.what();
  }
  // Job A, window 1: rank 1's object of window 0's first collective, replayed as its object of
  // the next collective in window 1, is refused by rank 0.
  const std::set<std::string> before = object_names();
  std::string window0;
  for (const std::string& name : before)
    if (name.starts_with("job-a/w0000000000/c") && name.ends_with("-r1")) window0 = name;
  ASSERT_FALSE(window0.empty());
  label_bucket_window(*a[0], 1);
  std::string next;
  for (int c = 0; c < 100 && next.empty(); ++c) {
    const std::string candidate = "job-a/w0000000000/c" + std::to_string(c) + "-r1";
    if (!before.contains(candidate)) next = "job-a/w0000000001/c" + std::to_string(c) + "-r1";
  }
  copy(window0, next);
  auto* native = transport::native_collectives(*a[0]);
  ASSERT_NE(native, nullptr);
  std::vector<std::byte> slot0(8), slot1(8);
  const std::vector<std::span<std::byte>> out{slot0, slot1};
  try {
    (void)native->allgather_into(std::span(slot0), out,
                                 transport::deadline_after(std::chrono::milliseconds(10'000)));
    FAIL() << "an object replayed from another window was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::protocol) << error.what();
    EXPECT_EQ(error.context().peer, 1) << error.what();
    EXPECT_NE(error.message().find(address_.url(next)), std::string::npos) << error.what();
  }
}

TEST_F(BucketGroup, AJobIdUsedBeforeIsRefused) {
  (void)group(1, "job-used");
  try {
    (void)join_bucket_group(options(0, 1, "job-used"));
    FAIL() << "a job id used before was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::invalid_argument) << error.what();
  }
}

TEST_F(BucketGroup, DilocoWindowsRunThroughTheBucket) {
  constexpr int kWorld = 3;
  auto transports = group(kWorld, "job-diloco");
  std::vector<LocalModel> models;
  for (int r = 0; r < kWorld; ++r)
    models.push_back(make_model({3000, 10}, DType::float32, r == 0 ? 7 : 1000 + r));
  const EngineOptions options = small_options(Mode::diloco);
  std::vector<std::unique_ptr<Engine>> engines(kWorld);
  rethrow_first(run_ranks(kWorld, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    engines[i] = std::make_unique<Engine>(views_of(models[i]), options, std::move(transports[i]));
  }));
  for (int window = 0; window < 2; ++window) {
    rethrow_first(run_ranks(kWorld, [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      local_training(models[i], 3e-5f, 4, static_cast<std::uint32_t>(10 * window + r));
      const WindowReport report = engines[i]->run_window();
      EXPECT_TRUE(report.replicas_identical);
    }));
  }
  for (int r = 1; r < kWorld; ++r)
    EXPECT_EQ(models[static_cast<std::size_t>(r)][0].f32, models[0][0].f32);
}

TEST_F(BucketGroup, DdpAveragesGradientsThroughTheBucket) {
  constexpr int kWorld = 3;
  auto transports = group(kWorld, "job-ddp");
  std::vector<LocalModel> models;
  for (int r = 0; r < kWorld; ++r)
    models.push_back(make_model({3000, 10}, DType::float32, 300 + r));
  EngineOptions options = small_options(Mode::ddp);
  options.steps_per_window = 1;
  std::vector<std::unique_ptr<Engine>> engines(kWorld);
  rethrow_first(run_ranks(kWorld, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    engines[i] = std::make_unique<Engine>(views_of(models[i]), options, std::move(transports[i]));
  }));
  rethrow_first(run_ranks(kWorld, [&](int r) {
    std::vector<std::vector<float>> grads;
    std::vector<TensorView> views;
    for (const auto& t : models[static_cast<std::size_t>(r)])
      grads.emplace_back(t.numel(), static_cast<float>(r + 1) * 0.25f);
    for (auto& g : grads)
      views.push_back({g.data(), g.size(), DType::float32, Device{}});
    engines[static_cast<std::size_t>(r)]->average_gradients(views);
    for (const auto& g : grads)
      for (const float v : g)
        ASSERT_EQ(v, 0.5f);  // (0.25 + 0.5 + 0.75) / 3, exact
    (void)engines[static_cast<std::size_t>(r)]->after_optimizer_step();
  }));
}

TEST_F(BucketGroup, OverlappedWindowsAreRefusedNamingTheOption) {
  auto transports = group(1, "job-overlap");
  std::vector<LocalModel> models{make_model({10}, DType::float32, 7)};
  EngineOptions options = small_options();
  options.overlap = Overlap::delayed;
  try {
    Engine engine(views_of(models[0]), options, std::move(transports[0]));
    FAIL() << "overlap delayed was accepted through a bucket";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::invalid_argument) << error.what();
    EXPECT_NE(error.message().find("overlap"), std::string::npos) << error.what();
  }
}

TEST_F(BucketGroup, TheOwnerReductionIsRefusedNamingTheOption) {
  constexpr int kWorld = 2;
  auto transports = group(kWorld, "job-reduction");
  std::vector<LocalModel> models;
  for (int r = 0; r < kWorld; ++r)
    models.push_back(make_model({3000}, DType::float32, 7));
  EngineOptions options = small_options();
  options.exchange = Exchange::reduction;
  options.timeout = std::chrono::milliseconds(5'000);
  std::vector<std::unique_ptr<Engine>> engines(kWorld);
  rethrow_first(run_ranks(kWorld, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    engines[i] = std::make_unique<Engine>(views_of(models[i]), options, std::move(transports[i]));
  }));
  rethrow_first(run_ranks(kWorld, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    local_training(models[i], 3e-5f, 4, static_cast<std::uint32_t>(r));
    try {
      (void)engines[i]->run_window();
      ADD_FAILURE() << "exchange reduction ran through a bucket";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::invalid_argument) << error.what();
      EXPECT_NE(error.message().find("exchange=reduction"), std::string::npos) << error.what();
    }
  }));
}

}  // namespace
}  // namespace pulseloco::testing
