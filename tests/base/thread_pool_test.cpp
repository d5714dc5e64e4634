#include <pulseloco/base/thread_pool.h>

#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <vector>

namespace pulseloco {
namespace {

class ThreadPoolSizes : public ::testing::TestWithParam<std::size_t> {};

TEST_P(ThreadPoolSizes, RunsEveryIndexExactlyOnce) {
  ThreadPool pool(GetParam());
  for (std::size_t count : {0u, 1u, 2u, 3u, 100u, 10000u}) {
    std::vector<std::atomic<int>> hits(count);
    pool.parallel_for(count, [&](std::size_t i) { hits[i].fetch_add(1); });
    for (std::size_t i = 0; i < count; ++i)
      ASSERT_EQ(hits[i].load(), 1) << i;
  }
}

TEST_P(ThreadPoolSizes, RethrowsTheLowestFailingIndex) {
  ThreadPool pool(GetParam());
  for (int round = 0; round < 20; ++round) {
    try {
      pool.parallel_for(64, [](std::size_t i) {
        if (i % 10 == 7) throw std::runtime_error(std::to_string(i));
      });
      FAIL() << "no exception";
    } catch (const std::runtime_error& e) {
      EXPECT_STREQ(e.what(), "7");
    }
  }
}

TEST_P(ThreadPoolSizes, SubmitRunsTheTask) {
  ThreadPool pool(GetParam());
  std::atomic<int> value{0};
  auto done = pool.submit([&] { value = 5; });
  done.get();
  EXPECT_EQ(value.load(), 5);
}

INSTANTIATE_TEST_SUITE_P(Threads, ThreadPoolSizes, ::testing::Values(1, 2, 4),
                         [](const auto& param_info) {
                           return std::to_string(param_info.param) + "_threads";
                         });

}  // namespace
}  // namespace pulseloco

namespace pulseloco {
namespace {

TEST(ThreadPoolNesting, NestedParallelForDoesNotDeadlock) {
  ThreadPool pool(2);
  std::atomic<int> total{0};
  // Every worker is busy in an outer task that itself calls parallel_for.
  pool.parallel_for(
      8, [&](std::size_t) { pool.parallel_for(100, [&](std::size_t) { total.fetch_add(1); }); });
  EXPECT_EQ(total.load(), 800);
}

}  // namespace
}  // namespace pulseloco
