// The collectives with every rank a thread of this process: results against independently
// computed expectations, for world sizes 1, 2, 3, 4 and 7, payloads from 0 bytes to 64 MiB,
// both all-gather algorithms, and every backend of test_groups.h (the all-gather and the
// all-reduce also over the order-matching double).
#include <pulseloco/collectives/collectives.h>

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>
#include <set>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/detail/call.h>
#include <pulseloco/transport/tcp/tcp_transport.h>
#include "collective_reference.h"
#include "rank_harness.h"
#include "test_groups.h"

namespace pulseloco::collectives {
namespace {

using pulseloco::testing::describe;
using pulseloco::testing::make_test_group;
using pulseloco::testing::order_sensitive_value;
using pulseloco::testing::pattern_bytes;
using pulseloco::testing::plain_rank_order_sum;
using pulseloco::testing::RankOutcome;
using pulseloco::testing::reference_allreduce;
using pulseloco::testing::run_ranks;
using transport::Transport;

void expect_all_succeeded(const std::vector<RankOutcome>& outcomes) {
  for (std::size_t rank = 0; rank < outcomes.size(); ++rank) {
    EXPECT_FALSE(outcomes[rank].error) << "rank " << rank << ": " << describe(outcomes[rank]);
  }
}

// ---------------------------------------------------------------------------------------------
// Sparse all-gather

enum class Sizes { empty, one_byte, odd_different, some_empty, skewed, large_64mib };

std::string_view sizes_name(Sizes sizes) {
  switch (sizes) {
    case Sizes::empty:
      return "empty";
    case Sizes::one_byte:
      return "one_byte";
    case Sizes::odd_different:
      return "odd_different";
    case Sizes::some_empty:
      return "some_empty";
    case Sizes::skewed:
      return "skewed";
    case Sizes::large_64mib:
      return "large_64MiB";
  }
  return "?";
}

std::size_t message_size(Sizes sizes, int rank) {
  const auto r = static_cast<std::size_t>(rank);
  switch (sizes) {
    case Sizes::empty:
      return 0;
    case Sizes::one_byte:
      return 1;
    case Sizes::odd_different:
      return 1 + 2 * (r * 1009 + r * r * 37);  // odd, and different on every rank
    case Sizes::some_empty:
      return r % 2 == 0 ? 0 : 777 * r + 3;
    case Sizes::skewed:
      return rank == 0 ? (std::size_t{1} << 20) + 3 : 17 + r;
    case Sizes::large_64mib:
      return (std::size_t{64} << 20) + r;  // 64 MiB, different on every rank
  }
  return 0;
}

// Small chunks make even small messages travel in many pipelined pieces.
std::size_t chunk_for(Sizes sizes) {
  switch (sizes) {
    case Sizes::odd_different:
      return 100;
    case Sizes::some_empty:
      return 128;
    case Sizes::skewed:
      return std::size_t{64} << 10;
    default:
      return std::size_t{4} << 20;
  }
}

struct AllGatherCase {
  std::string backend;
  int world = 1;
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::automatic;
  Sizes sizes = Sizes::empty;
};

std::string case_name(const ::testing::TestParamInfo<AllGatherCase>& info) {
  return fmt::format("{}_world{}_{}_{}", info.param.backend, info.param.world,
                     algorithm_name(info.param.algorithm), sizes_name(info.param.sizes));
}

class SparseAllGather : public ::testing::TestWithParam<AllGatherCase> {};

TEST_P(SparseAllGather, EveryRankReceivesEveryMessageExactlyAndInRankOrder) {
  const AllGatherCase& c = GetParam();
  auto group = make_test_group(c.backend, c.world);
  const CollectiveOptions options{.timeout = std::chrono::seconds(60),
                                  .algorithm = c.algorithm,
                                  .pipeline_chunk_bytes = chunk_for(c.sizes)};
  std::vector<std::vector<std::byte>> expected(static_cast<std::size_t>(c.world));
  for (int rank = 0; rank < c.world; ++rank) {
    expected[static_cast<std::size_t>(rank)] = pattern_bytes(message_size(c.sizes, rank), rank, 42);
  }
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const int r = t.rank();
    const std::vector<std::byte> mine = expected[static_cast<std::size_t>(r)];
    std::vector<int> callback_order;
    std::vector<Digest> seen_in_callback(static_cast<std::size_t>(c.world));
    const auto result = sparse_allgather(t, mine, options, [&](int rank, auto message) {
      callback_order.push_back(rank);
      seen_in_callback[static_cast<std::size_t>(rank)] = digest_bytes(message);
    });
    if (result != expected) throw std::runtime_error("result differs from the messages sent");
    for (int rank = 0; rank < c.world; ++rank) {
      if (seen_in_callback[static_cast<std::size_t>(rank)] !=
          digest_bytes(expected[static_cast<std::size_t>(rank)])) {
        throw std::runtime_error("the callback saw other bytes than the result holds");
      }
    }
    std::vector<int> sorted = callback_order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int> all(static_cast<std::size_t>(c.world));
    std::iota(all.begin(), all.end(), 0);
    if (sorted != all) throw std::runtime_error("callback did not run exactly once per rank");
    if (callback_order.front() != r) throw std::runtime_error("own message was not first");
    if (mine != expected[static_cast<std::size_t>(r)]) throw std::runtime_error("input changed");
  });
  expect_all_succeeded(outcomes);
}

std::vector<AllGatherCase> all_gather_cases() {
  std::vector<AllGatherCase> cases;
  for (const std::string& backend : pulseloco::testing::test_backends_with_ordered()) {
    for (const int world : {1, 2, 3, 4, 7}) {
      for (const auto algorithm : {CollectiveAlgorithm::automatic, CollectiveAlgorithm::ring,
                                   CollectiveAlgorithm::direct}) {
        for (const auto sizes : {Sizes::empty, Sizes::one_byte, Sizes::odd_different,
                                 Sizes::some_empty, Sizes::skewed}) {
          cases.push_back({backend, world, algorithm, sizes});
        }
      }
    }
    // 64 MiB per rank: both algorithms on four ranks, automatic on two.
    cases.push_back({backend, 4, CollectiveAlgorithm::ring, Sizes::large_64mib});
    cases.push_back({backend, 4, CollectiveAlgorithm::direct, Sizes::large_64mib});
    cases.push_back({backend, 2, CollectiveAlgorithm::automatic, Sizes::large_64mib});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, SparseAllGather, ::testing::ValuesIn(all_gather_cases()),
                         case_name);

TEST(SparseAllGatherInto, WritesIntoTheCallersBuffersAndChecksTheirSizes) {
  auto group = make_test_group("inproc", 3);
  const auto outcomes = run_ranks(group, [](Transport& t) {
    const auto mine = pattern_bytes(10 + static_cast<std::size_t>(t.rank()), t.rank());
    std::vector<std::byte> arena(100);
    std::size_t used = 0;
    std::vector<std::span<std::byte>> where(3);
    sparse_allgather_into(t, mine,
                          [&](int rank, std::size_t bytes) {
                            where[static_cast<std::size_t>(rank)] =
                                std::span(arena).subspan(used, bytes);
                            used += bytes;
                            return where[static_cast<std::size_t>(rank)];
                          },
                          {});
    for (int rank = 0; rank < 3; ++rank) {
      const auto expected = pattern_bytes(10 + static_cast<std::size_t>(rank), rank);
      const auto got = where[static_cast<std::size_t>(rank)];
      if (!std::equal(got.begin(), got.end(), expected.begin(), expected.end())) {
        throw std::runtime_error("wrong bytes in the arena");
      }
    }
  });
  expect_all_succeeded(outcomes);
}

// The documented order of `buffer_for`: the left neighbour's first (its receives are posted as
// soon as its header is in), then the others in rank order once every header is; whichever
// algorithm runs.
TEST(SparseAllGatherInto, AsksForTheLeftNeighboursBufferFirstThenTheOthersInRankOrder) {
  struct Case {
    std::size_t bytes;
    CollectiveAlgorithm algorithm;
  };
  const std::vector<Case> cases = {
      {64 << 10, CollectiveAlgorithm::automatic},  // the ring
      {100, CollectiveAlgorithm::ring},
      {100, CollectiveAlgorithm::automatic},  // `direct`
      {64 << 10, CollectiveAlgorithm::direct},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(fmt::format("{} bytes, {}", c.bytes, algorithm_name(c.algorithm)));
    auto group = make_test_group("tcp", 4);
    std::vector<std::vector<int>> asked(4);
    const auto outcomes = run_ranks(group, [&](Transport& t) {
      const auto mine = pattern_bytes(c.bytes, t.rank());
      std::vector<std::vector<std::byte>> storage(4);
      sparse_allgather_into(t, mine,
                            [&](int rank, std::size_t bytes) {
                              asked[static_cast<std::size_t>(t.rank())].push_back(rank);
                              auto& buffer = storage[static_cast<std::size_t>(rank)];
                              buffer.resize(bytes);
                              return std::span(buffer);
                            },
                            {.timeout = std::chrono::seconds(10), .algorithm = c.algorithm});
      for (int rank = 0; rank < 4; ++rank) {
        if (storage[static_cast<std::size_t>(rank)] != pattern_bytes(c.bytes, rank))
          throw std::runtime_error(fmt::format("wrong bytes for rank {}", rank));
      }
    });
    expect_all_succeeded(outcomes);
    for (int r = 0; r < 4; ++r) {
      std::vector<int> expected = {(r + 3) % 4};
      for (int rank = 0; rank < 4; ++rank) {
        if (rank != expected.front()) expected.push_back(rank);
      }
      EXPECT_EQ(asked[static_cast<std::size_t>(r)], expected) << "rank " << r;
    }
  }
}

TEST(SparseAllGatherInto, AWrongSizedBufferFailsTheCallOnEveryRank) {
  auto group = make_test_group("inproc", 3);
  const auto outcomes = run_ranks(group, [](Transport& t) {
    const std::vector<std::byte> mine(5);
    std::vector<std::vector<std::byte>> storage(3, std::vector<std::byte>(5));
    sparse_allgather_into(t, mine,
                          [&](int rank, std::size_t bytes) {
                            // Rank 1 hands out one byte too few for rank 2's message.
                            return std::span(storage[static_cast<std::size_t>(rank)])
                                .first(t.rank() == 1 && rank == 2 ? bytes - 1 : bytes);
                          },
                          {.timeout = std::chrono::seconds(10)});
  });
  const auto one = pulseloco::testing::caught_error(outcomes[1]);
  ASSERT_TRUE(one) << describe(outcomes[1]);
  EXPECT_EQ(one->kind, ErrorKind::invalid_argument);
  for (const int rank : {0, 2}) {
    const auto error = pulseloco::testing::caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << describe(outcomes[static_cast<std::size_t>(rank)]);
    EXPECT_EQ(error->context.peer, 1) << error->what;
  }
}

TEST(AlgorithmChoice, FollowsTheDocumentedRule) {
  const std::uint64_t kib = 1 << 10;
  const std::uint64_t mib = 1 << 20;
  const auto choose = [](std::vector<std::uint64_t> sizes) {
    return choose_allgather_algorithm(sizes);
  };
  EXPECT_EQ(choose({5}), CollectiveAlgorithm::direct);
  // Two ranks: the same traffic either way.
  EXPECT_EQ(choose({64 * mib, 64 * mib}), CollectiveAlgorithm::direct);
  // Latency-bound: one hop.
  EXPECT_EQ(choose(std::vector<std::uint64_t>(7, 1000)), CollectiveAlgorithm::direct);
  EXPECT_EQ(choose({32 * kib, 0, 32 * kib, 17}), CollectiveAlgorithm::direct);
  // Bandwidth-bound: the ring.
  EXPECT_EQ(choose({32 * kib + 1, 0, 0, 0}), CollectiveAlgorithm::ring);
  EXPECT_EQ(choose(std::vector<std::uint64_t>(4, mib)), CollectiveAlgorithm::ring);
  EXPECT_EQ(choose({64 * mib, 1, 1, 1}), CollectiveAlgorithm::ring);
  EXPECT_EQ(choose(std::vector<std::uint64_t>(7, 8 * mib)), CollectiveAlgorithm::ring);
}

// ---------------------------------------------------------------------------------------------
// All-reduce

struct AllReduceCase {
  std::string backend;
  int world = 1;
  std::size_t count = 0;
  std::size_t chunk_bytes = 0;
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::automatic;
};

class AllReduce : public ::testing::TestWithParam<AllReduceCase> {};

TEST_P(AllReduce, EveryRankGetsTheSameBitsInTheDocumentedSummationOrder) {
  const AllReduceCase& c = GetParam();
  auto group = make_test_group(c.backend, c.world);
  std::vector<std::vector<float>> inputs(static_cast<std::size_t>(c.world));
  for (int rank = 0; rank < c.world; ++rank) {
    auto& input = inputs[static_cast<std::size_t>(rank)];
    input.resize(c.count);
    for (std::size_t e = 0; e < c.count; ++e)
      input[e] = order_sensitive_value(rank, e);
  }
  // Over the order-matching double the transport's own all-reduce runs, which adds in plain
  // rank order (NCCL's would add in its own order).
  const std::vector<float> expected =
      c.backend == "ordered" ? plain_rank_order_sum(inputs) : reference_allreduce(inputs);
  std::vector<std::vector<float>> outputs(static_cast<std::size_t>(c.world));
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const auto& input = inputs[static_cast<std::size_t>(t.rank())];
    const std::vector<float> before = input;
    auto& output = outputs[static_cast<std::size_t>(t.rank())];
    output.assign(c.count, std::numeric_limits<float>::quiet_NaN());
    allreduce_sum(t, input, output,
                  {.algorithm = c.algorithm, .pipeline_chunk_bytes = c.chunk_bytes});
    if (std::memcmp(before.data(), input.data(), before.size() * sizeof(float)) != 0) {
      throw std::runtime_error("input changed");
    }
  });
  expect_all_succeeded(outcomes);
  for (int rank = 0; rank < c.world; ++rank) {
    const auto& output = outputs[static_cast<std::size_t>(rank)];
    ASSERT_EQ(output.size(), c.count);
    EXPECT_EQ(std::memcmp(output.data(), expected.data(), c.count * sizeof(float)), 0)
        << "rank " << rank << " differs from the documented summation order";
  }
  if (c.backend != "ordered" && c.world >= 3 && c.count >= 1000) {
    // The inputs are order-sensitive: summing in plain rank order gives other bits somewhere,
    // so the identical bytes above are not a coincidence of the data.
    std::size_t differing = 0;
    for (std::size_t e = 0; e < c.count; ++e) {
      float naive = inputs[0][e];
      for (int k = 1; k < c.world; ++k)
        naive = naive + inputs[static_cast<std::size_t>(k)][e];
      if (std::memcmp(&naive, &expected[e], sizeof(float)) != 0) ++differing;
    }
    EXPECT_GT(differing, 0U);
  }
}

std::vector<AllReduceCase> all_reduce_cases() {
  std::vector<AllReduceCase> cases;
  for (const std::string& backend : pulseloco::testing::test_backends_with_ordered()) {
    for (const int world : {1, 2, 3, 4, 7}) {
      for (const std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{5},
                                      std::size_t{1000}, (std::size_t{1} << 20) + 3}) {
        for (const std::size_t chunk : {std::size_t{4}, std::size_t{100}, std::size_t{4} << 20}) {
          if (chunk == 4 && count > 1000) continue;  // a million one-element messages: slow
          // Both algorithms must give the documented bits (`automatic` picks one of them).
          for (const auto algorithm : {CollectiveAlgorithm::ring, CollectiveAlgorithm::direct})
            cases.push_back({backend, world, count, chunk, algorithm});
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, AllReduce, ::testing::ValuesIn(all_reduce_cases()),
                         [](const ::testing::TestParamInfo<AllReduceCase>& param_info) {
                           const AllReduceCase& c = param_info.param;
                           return fmt::format("{}_world{}_count{}_chunk{}_{}", c.backend, c.world,
                                              c.count, c.chunk_bytes, algorithm_name(c.algorithm));
                         });

class AllReduceSpecialValues : public ::testing::TestWithParam<CollectiveAlgorithm> {};

TEST_P(AllReduceSpecialValues, NaNInfinityAndSignedZeroGiveIdenticalBitsEverywhere) {
  constexpr int kWorld = 4;
  auto group = make_test_group("inproc", kWorld);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<std::vector<float>> outputs(kWorld);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const int r = t.rank();
    const std::vector<float> input = {r == 1 ? nan : 1.0F, r == 2 ? inf : (r == 3 ? -inf : 0.0F),
                                      -0.0F, r == 0 ? -nan : 2.0F, r == 2 ? inf : 1.0F};
    auto& output = outputs[static_cast<std::size_t>(r)];
    output.resize(input.size());
    allreduce_sum(t, input, output, {.algorithm = GetParam(), .pipeline_chunk_bytes = 4});
  });
  expect_all_succeeded(outcomes);
  for (int rank = 1; rank < kWorld; ++rank) {
    EXPECT_EQ(std::memcmp(outputs[0].data(), outputs[static_cast<std::size_t>(rank)].data(),
                          outputs[0].size() * sizeof(float)),
              0);
  }
  EXPECT_TRUE(std::isnan(outputs[0][0]));
  EXPECT_TRUE(std::isnan(outputs[0][1]));  // inf + -inf
  EXPECT_EQ(outputs[0][2], 0.0F);
  EXPECT_TRUE(std::signbit(outputs[0][2]));  // -0 + -0 + -0 + -0
  EXPECT_TRUE(std::isnan(outputs[0][3]));
  EXPECT_TRUE(std::isinf(outputs[0][4]));
}

INSTANTIATE_TEST_SUITE_P(Algorithms, AllReduceSpecialValues,
                         ::testing::Values(CollectiveAlgorithm::ring, CollectiveAlgorithm::direct),
                         [](const auto& param_info) {
                           return std::string(algorithm_name(param_info.param));
                         });

TEST(AllReduceAlgorithm, AutomaticTakesDirectForLatencyBoundVectorsAndRingForLargeOnes) {
  constexpr std::size_t kKiB = 1024;
  // Two ranks: the algorithms are the same exchange.
  EXPECT_EQ(choose_allreduce_algorithm(16, 2), CollectiveAlgorithm::ring);
  EXPECT_EQ(choose_allreduce_algorithm(0, 4), CollectiveAlgorithm::direct);
  EXPECT_EQ(choose_allreduce_algorithm(kKiB, 4), CollectiveAlgorithm::direct);
  EXPECT_EQ(choose_allreduce_algorithm(256 * kKiB / 4, 7), CollectiveAlgorithm::direct);
  EXPECT_EQ(kAllReduceDirectMaxBytes, 4 * kKiB * kKiB);
  EXPECT_EQ(choose_allreduce_algorithm(4 * kKiB * kKiB / 4, 4), CollectiveAlgorithm::direct);
  EXPECT_EQ(choose_allreduce_algorithm(4 * kKiB * kKiB / 4 + 1, 4), CollectiveAlgorithm::ring);
  EXPECT_EQ(choose_allreduce_algorithm(64 * kKiB * kKiB / 4, 4), CollectiveAlgorithm::ring);
}

TEST(AllReduceArguments, AreCheckedBeforeAnythingIsSentAndTheTransportStaysUsable) {
  auto group = make_test_group("inproc", 2);
  const auto outcomes = run_ranks(group, [](Transport& t) {
    std::vector<float> buffer(8, 1.0F);
    std::vector<float> short_output(7);
    bool threw = false;
    try {
      allreduce_sum(t, buffer, short_output, {});
    } catch (const InvalidArgument&) {
      threw = true;
    }
    if (!threw) throw std::runtime_error("size mismatch accepted");
    threw = false;
    try {
      allreduce_sum(t, std::span<const float>(buffer).first(5), std::span(buffer).subspan(3), {});
    } catch (const InvalidArgument&) {
      threw = true;
    }
    if (!threw) throw std::runtime_error("overlap accepted");
    threw = false;
    try {
      barrier(t, {.tag = kTagLimit});
    } catch (const InvalidArgument&) {
      threw = true;
    }
    if (!threw) throw std::runtime_error("tag out of range accepted");
    std::vector<float> output(8);
    allreduce_sum(t, buffer, output, {});
    if (output != std::vector<float>(8, 2.0F)) throw std::runtime_error("wrong sum");
  });
  expect_all_succeeded(outcomes);
}

// The all-reduce posts its first sends and its receives while the headers travel: a peer with
// another length or algorithm must still be reported as a disagreement (not as the size
// mismatch or the timeout its early messages would cause), on every backend and algorithm.
struct DisagreementCase {
  std::string backend;
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::ring;
  std::size_t elements = 8;
};

class AllReduceDisagreement : public ::testing::TestWithParam<DisagreementCase> {};

void expect_all_fail_naming_the_odd_rank(const std::vector<RankOutcome>& outcomes, int odd) {
  for (int rank = 0; rank < static_cast<int>(outcomes.size()); ++rank) {
    const auto error = pulseloco::testing::caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << "rank " << rank << ": "
                       << describe(outcomes[static_cast<std::size_t>(rank)]);
    EXPECT_EQ(error->kind, ErrorKind::invalid_argument) << error->what;
    if (rank == odd) {
      // The odd one out names a peer of the majority (or one that reported it).
      EXPECT_TRUE(error->context.peer && *error->context.peer != odd) << error->what;
    } else {
      EXPECT_EQ(error->context.peer, odd) << error->what;
    }
  }
}

// Every rank of a `world`-rank group all-reduces `c.elements` elements, rank `odd` `extra` more.
std::vector<RankOutcome> allreduce_with_an_odd_length(const DisagreementCase& c, int world, int odd,
                                                      std::size_t extra) {
  auto group = make_test_group(c.backend, world);
  return run_ranks(group, [&](Transport& t) {
    std::vector<float> input(t.rank() == odd ? c.elements + extra : c.elements, 1.0F);
    std::vector<float> output(input.size());
    allreduce_sum(t, input, output,
                  {.timeout = std::chrono::seconds(10),
                   .algorithm = c.algorithm,
                   .pipeline_chunk_bytes = 64});
  });
}

TEST_P(AllReduceDisagreement, RanksWithDifferentLengthsAllFailNamingAPeer) {
  expect_all_fail_naming_the_odd_rank(allreduce_with_an_odd_length(GetParam(), 3, 2, 1), 2);
}

// Four ranks: rank 0 is neither neighbour of rank 2, so it never sees rank 2's header; under
// `direct` it receives rank 2's segment, of the wrong size, and must still report the
// disagreement (rank 3 saw the odd header and says so), not a protocol error.
TEST_P(AllReduceDisagreement, ARankThatNeverSeesTheOddHeaderStillReportsTheDisagreement) {
  expect_all_fail_naming_the_odd_rank(allreduce_with_an_odd_length(GetParam(), 4, 2, 4), 2);
}

TEST_P(AllReduceDisagreement, RanksWithDifferentAlgorithmsAllFailNamingAPeer) {
  const DisagreementCase c = GetParam();
  auto group = make_test_group(c.backend, 3);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const std::vector<float> input(c.elements, 1.0F);
    std::vector<float> output(input.size());
    const CollectiveAlgorithm other = c.algorithm == CollectiveAlgorithm::ring
                                          ? CollectiveAlgorithm::direct
                                          : CollectiveAlgorithm::ring;
    allreduce_sum(t, input, output,
                  {.timeout = std::chrono::seconds(10),
                   .algorithm = t.rank() == 0 ? other : c.algorithm,
                   .pipeline_chunk_bytes = 64});
  });
  expect_all_fail_naming_the_odd_rank(outcomes, 0);
}

// Under `automatic`, lengths on either side of the direct/ring boundary give one rank the ring
// (which exchanges headers with its left neighbour only) and the others direct (which exchange
// them with every peer): the disagreement must still be found and named on every rank.
TEST(AllReduceDisagreementAcrossTheAlgorithmBoundary, AllRanksFailNamingThePeerWithTheRing) {
  constexpr std::size_t kDirectLimit = kAllReduceDirectMaxBytes / sizeof(float);
  for (const std::string& backend : pulseloco::testing::test_backends()) {
    for (const int odd : {0, 1, 2}) {
      SCOPED_TRACE(fmt::format("{}: rank {} takes the ring", backend, odd));
      auto group = make_test_group(backend, 3);
      const auto outcomes = run_ranks(group, [&](Transport& t) {
        std::vector<float> input(t.rank() == odd ? kDirectLimit + 1 : kDirectLimit, 1.0F);
        std::vector<float> output(input.size());
        ASSERT_EQ(choose_allreduce_algorithm(input.size(), t.size()),
                  t.rank() == odd ? CollectiveAlgorithm::ring : CollectiveAlgorithm::direct);
        allreduce_sum(t, input, output, {.timeout = std::chrono::seconds(10)});
      });
      expect_all_fail_naming_the_odd_rank(outcomes, odd);
    }
  }
}

std::vector<DisagreementCase> disagreement_cases() {
  std::vector<DisagreementCase> cases;
  for (const std::string& backend : pulseloco::testing::test_backends())
    for (const CollectiveAlgorithm algorithm :
         {CollectiveAlgorithm::ring, CollectiveAlgorithm::direct})
      for (const std::size_t elements : {std::size_t{8}, std::size_t{1000}})
        cases.push_back({backend, algorithm, elements});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, AllReduceDisagreement, ::testing::ValuesIn(disagreement_cases()),
                         [](const auto& param_info) {
                           const DisagreementCase& c = param_info.param;
                           return fmt::format("{}_{}_{}", c.backend, algorithm_name(c.algorithm),
                                              c.elements);
                         });

// The all-gather sends its first step (this rank's message to its right neighbour) while the
// headers travel, and posts the left neighbour's receives once that one header is in: a rank
// with another chunk size or algorithm must still be reported as a disagreement on every rank.
class AllGatherDisagreement : public ::testing::TestWithParam<DisagreementCase> {};

TEST_P(AllGatherDisagreement, RanksWithDifferentChunkSizesAllFailNamingAPeer) {
  const DisagreementCase c = GetParam();
  auto group = make_test_group(c.backend, 3);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const auto mine = pattern_bytes(c.elements, t.rank());
    (void)sparse_allgather(t, mine,
                           {.timeout = std::chrono::seconds(10),
                            .algorithm = c.algorithm,
                            .pipeline_chunk_bytes = t.rank() == 2 ? 96U : 64U});
  });
  expect_all_fail_naming_the_odd_rank(outcomes, 2);
}

TEST_P(AllGatherDisagreement, RanksWithDifferentAlgorithmsAllFailNamingAPeer) {
  const DisagreementCase c = GetParam();
  auto group = make_test_group(c.backend, 3);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const auto mine = pattern_bytes(c.elements, t.rank());
    const CollectiveAlgorithm other = c.algorithm == CollectiveAlgorithm::ring
                                          ? CollectiveAlgorithm::direct
                                          : CollectiveAlgorithm::ring;
    (void)sparse_allgather(t, mine,
                           {.timeout = std::chrono::seconds(10),
                            .algorithm = t.rank() == 0 ? other : c.algorithm,
                            .pipeline_chunk_bytes = 64});
  });
  expect_all_fail_naming_the_odd_rank(outcomes, 0);
}

INSTANTIATE_TEST_SUITE_P(Cases, AllGatherDisagreement, ::testing::ValuesIn(disagreement_cases()),
                         [](const auto& param_info) {
                           const DisagreementCase& c = param_info.param;
                           return fmt::format("{}_{}_{}", c.backend, algorithm_name(c.algorithm),
                                              c.elements);
                         });

// ---------------------------------------------------------------------------------------------
// Broadcast, barrier, all-gather of 64-bit values

struct BroadcastCase {
  int world = 1;
  int root = 0;
  std::size_t bytes = 0;
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::automatic;
};

class Broadcast : public ::testing::TestWithParam<BroadcastCase> {};

TEST_P(Broadcast, EveryRankGetsTheRootsBytes) {
  const BroadcastCase& c = GetParam();
  auto group = make_test_group("inproc", c.world);
  const auto expected = pattern_bytes(c.bytes, c.root, 7);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    std::vector<std::byte> data =
        t.rank() == c.root ? expected : std::vector<std::byte>(c.bytes, std::byte{0x5A});
    broadcast(t, c.root, data,
              {.algorithm = c.algorithm, .pipeline_chunk_bytes = std::size_t{64} << 10});
    if (data != expected) throw std::runtime_error("broadcast delivered other bytes");
  });
  expect_all_succeeded(outcomes);
}

std::vector<BroadcastCase> broadcast_cases() {
  std::vector<BroadcastCase> cases;
  for (const int world : {1, 2, 3, 4, 7}) {
    for (const int root : std::set<int>{0, world - 1}) {
      for (const std::size_t bytes :
           {std::size_t{0}, std::size_t{1}, std::size_t{1001}, std::size_t{300'001}}) {
        for (const auto algorithm : {CollectiveAlgorithm::automatic, CollectiveAlgorithm::ring,
                                     CollectiveAlgorithm::direct}) {
          cases.push_back({world, root, bytes, algorithm});
        }
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, Broadcast, ::testing::ValuesIn(broadcast_cases()),
                         [](const ::testing::TestParamInfo<BroadcastCase>& param_info) {
                           const BroadcastCase& c = param_info.param;
                           return fmt::format("world{}_root{}_{}bytes_{}", c.world, c.root, c.bytes,
                                              algorithm_name(c.algorithm));
                         });

TEST(Barrier, NoRankLeavesBeforeEveryRankHasArrived) {
  constexpr int kWorld = 7;
  constexpr int kRounds = 30;
  auto group = make_test_group("inproc", kWorld);
  std::vector<std::atomic<int>> arrived(kRounds);
  std::atomic<int> early_leaves{0};
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    for (int round = 0; round < kRounds; ++round) {
      arrived[static_cast<std::size_t>(round)].fetch_add(1);
      barrier(t, {});
      if (arrived[static_cast<std::size_t>(round)].load() != kWorld) early_leaves.fetch_add(1);
    }
  });
  expect_all_succeeded(outcomes);
  EXPECT_EQ(early_leaves.load(), 0);
}

TEST(AllGatherU64, ReturnsEveryRanksValueInRankOrder) {
  for (const int world : {1, 2, 3, 4, 7}) {
    auto group = make_test_group("inproc", world);
    const auto outcomes = run_ranks(group, [&](Transport& t) {
      for (std::uint64_t round = 0; round < 5; ++round) {
        const auto values = allgather_u64(
            t, round * 1000 + static_cast<std::uint64_t>(t.rank()) + (std::uint64_t{1} << 63), {});
        for (int rank = 0; rank < world; ++rank) {
          if (values[static_cast<std::size_t>(rank)] !=
              round * 1000 + static_cast<std::uint64_t>(rank) + (std::uint64_t{1} << 63)) {
            throw std::runtime_error("wrong value");
          }
        }
      }
    });
    expect_all_succeeded(outcomes);
  }
}

// ---------------------------------------------------------------------------------------------
// Sparse all-to-all

// Rank `from`'s message for rank `to`: empty for some pairs, several chunks for others.
std::vector<std::byte> alltoall_message(int from, int to, int world) {
  const std::size_t size = (from + 2 * to) % 3 == 0 ? 0 : 1000 * (1 + from) + 37 * to * world;
  return pattern_bytes(size, from, static_cast<std::uint64_t>(to) + 1);
}

class SparseAllToAll : public ::testing::TestWithParam<std::string> {};

TEST_P(SparseAllToAll, EveryRankReceivesExactlyWhatEachRankMeantForIt) {
  for (const int world : {1, 2, 3, 4, 7}) {
    auto group = make_test_group(GetParam(), world);
    const auto outcomes = run_ranks(group, [&](Transport& t) {
      const int n = t.size();
      std::vector<std::vector<std::byte>> mine;
      std::vector<std::span<const std::byte>> to_rank;
      for (int to = 0; to < n; ++to)
        mine.push_back(alltoall_message(t.rank(), to, n));
      for (const auto& message : mine)
        to_rank.emplace_back(message);
      std::vector<std::vector<std::byte>> got(static_cast<std::size_t>(n));
      std::vector<int> delivered(static_cast<std::size_t>(n), 0);
      sparse_alltoall(
          t, to_rank,
          [&](int from, std::size_t bytes) {
            got[static_cast<std::size_t>(from)].resize(bytes);
            return std::span<std::byte>(got[static_cast<std::size_t>(from)]);
          },
          {.pipeline_chunk_bytes = 4096},
          [&](int from, std::span<const std::byte> bytes) {
            ++delivered[static_cast<std::size_t>(from)];
            if (bytes.size() != alltoall_message(from, t.rank(), n).size())
              throw std::runtime_error("callback with the wrong size");
          });
      for (int from = 0; from < n; ++from) {
        if (got[static_cast<std::size_t>(from)] != alltoall_message(from, t.rank(), n))
          throw std::runtime_error(fmt::format("wrong message from rank {}", from));
        if (delivered[static_cast<std::size_t>(from)] != 1)
          throw std::runtime_error(fmt::format("callback ran {} times for rank {}",
                                               delivered[static_cast<std::size_t>(from)], from));
      }
    });
    expect_all_succeeded(outcomes);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, SparseAllToAll, ::testing::ValuesIn(testing::test_backends()),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param;
                         });

TEST(SparseAllToAllArguments, AreCheckedBeforeAnythingIsSent) {
  auto group = make_test_group("inproc", 3);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const std::vector<std::byte> one(10);
    const std::vector<std::span<const std::byte>> two(2, std::span<const std::byte>(one));
    try {
      sparse_alltoall(t, two, [](int, std::size_t) { return std::span<std::byte>(); }, {});
    } catch (const InvalidArgument&) {
      // The transport is still usable: a barrier goes through.
      barrier(t, {});
      return;
    }
    throw std::runtime_error("two messages for three ranks were accepted");
  });
  expect_all_succeeded(outcomes);
}

TEST(SparseAllToAllArguments, AnOrderMatchingTransportIsRefused) {
  auto group = make_test_group("ordered", 2);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const std::vector<std::span<const std::byte>> empty(2);
    sparse_alltoall(t, empty, [](int, std::size_t) { return std::span<std::byte>(); }, {});
  });
  for (const auto& outcome : outcomes) {
    ASSERT_TRUE(outcome.error);
    EXPECT_THROW(std::rethrow_exception(outcome.error), InvalidArgument);
  }
}

// ---------------------------------------------------------------------------------------------
// Tags, sequencing, mismatched calls

// Two threads of every rank run collectives at the same time on one transport (over TCP both
// drive its io_context at once, transport/tcp/progress.h).
class ConcurrentCalls : public ::testing::TestWithParam<std::string> {};

TEST_P(ConcurrentCalls, UnderDifferentBaseTagsDoNotMix) {
  constexpr int kWorld = 4;
  auto group = make_test_group(GetParam(), kWorld);
  const auto outcomes = run_ranks(group, [](Transport& t) {
    std::exception_ptr second_error;
    std::jthread second([&] {
      try {
        for (int round = 0; round < 20; ++round) {
          std::vector<float> input(1000, static_cast<float>(t.rank() + round));
          std::vector<float> output(1000);
          allreduce_sum(t, input, output, {.pipeline_chunk_bytes = 256, .tag = 2});
          const float expected = static_cast<float>(0 + 1 + 2 + 3 + 4 * round);
          if (output != std::vector<float>(1000, expected)) {
            throw std::runtime_error("allreduce under tag 2 got foreign data");
          }
        }
      } catch (...) {
        second_error = std::current_exception();
      }
    });
    for (int round = 0; round < 20; ++round) {
      const auto mine = pattern_bytes(500 + static_cast<std::size_t>(t.rank()), t.rank(),
                                      static_cast<std::uint64_t>(round));
      const auto all = sparse_allgather(t, mine, {.pipeline_chunk_bytes = 64, .tag = 1});
      for (int rank = 0; rank < kWorld; ++rank) {
        if (all[static_cast<std::size_t>(rank)] !=
            pattern_bytes(500 + static_cast<std::size_t>(rank), rank,
                          static_cast<std::uint64_t>(round))) {
          throw std::runtime_error("all-gather under tag 1 got foreign data");
        }
      }
    }
    second.join();
    if (second_error) std::rethrow_exception(second_error);
  });
  expect_all_succeeded(outcomes);
}

INSTANTIATE_TEST_SUITE_P(Backends, ConcurrentCalls,
                         ::testing::ValuesIn(pulseloco::testing::test_backends()),
                         [](const auto& param_info) { return param_info.param; });

TEST(Tags, SuccessiveCallsUseDisjointTagsAndIgnoreAnEarlierCallsStragglers) {
  auto faults = std::make_shared<transport::inproc::FaultInjector>();
  std::mutex mutex;
  std::vector<transport::Tag> tags;
  faults->set_hook([&](const transport::inproc::MessageEvent& m) {
    const std::lock_guard lock(mutex);
    tags.push_back(m.tag);
    return transport::inproc::FaultAction::deliver;
  });
  auto group = transport::inproc::make_group(3, {.faults = faults});
  const CollectiveOptions options{.tag = 5};
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    for (int call = 0; call < 3; ++call) {
      if (call == 2 && t.rank() == 1) {
        // A straggler of call #1: a message under that call's payload tag, arriving when the
        // peers are already in call #2.
        const auto junk = pattern_bytes(10, 99);
        t.send(0, detail::make_tag(5, 1, detail::Phase::payload), junk,
               transport::deadline_after(std::chrono::seconds(5)));
      }
      const auto mine = pattern_bytes(10, t.rank(), static_cast<std::uint64_t>(call));
      const auto all = sparse_allgather(t, mine, options);
      for (int rank = 0; rank < 3; ++rank) {
        if (all[static_cast<std::size_t>(rank)] !=
            pattern_bytes(10, rank, static_cast<std::uint64_t>(call))) {
          throw std::runtime_error("a call received another call's data");
        }
      }
      barrier(t, {.tag = 6});  // separates the calls' traffic in `tags`
    }
  });
  expect_all_succeeded(outcomes);
  std::set<std::uint64_t> sequences;
  for (const transport::Tag tag : tags) {
    EXPECT_TRUE(tag >> 63) << tag;  // collective traffic
    const transport::Tag base = (tag >> 40) & (kTagLimit - 1);
    EXPECT_TRUE(base == 5 || base == 6) << tag;
    if (base == 5) sequences.insert((tag >> 8) & 0xFFFF'FFFF);
  }
  EXPECT_EQ(sequences, (std::set<std::uint64_t>{0, 1, 2}));
}

// Every call uses tags of its own; the TCP transport keeps message counters per tag, which a
// finished call retires (Transport::retire_tag), so that they do not grow with every call.
TEST(Tags, AFinishedCallLeavesNoTagCountersInTheTcpTransport) {
  auto group = make_test_group("tcp", 3);
  std::vector<std::vector<std::size_t>> counters(3);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const auto& tcp = dynamic_cast<const transport::TcpTransport&>(t);
    const std::vector<float> input(1000, 1.0F);
    std::vector<float> output(input.size());
    for (int call = 0; call < 10; ++call) {
      (void)sparse_allgather(t, pattern_bytes(5000, t.rank()), {.pipeline_chunk_bytes = 1024});
      allreduce_sum(t, input, output, {});
      barrier(t, {});
      counters[static_cast<std::size_t>(t.rank())].push_back(tcp.tag_counters());
    }
  });
  expect_all_succeeded(outcomes);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(counters[static_cast<std::size_t>(rank)], std::vector<std::size_t>(10, 0))
        << "rank " << rank;
  }
}

TEST(Tags, SequenceNumbersAreKeptPerBaseTag) {
  auto group = make_test_group("inproc", 2);
  EXPECT_EQ(group[0]->next_sequence(5), 0U);
  EXPECT_EQ(group[0]->next_sequence(5), 1U);
  EXPECT_EQ(group[0]->next_sequence(6), 0U);
}

TEST(Mismatch, RanksInDifferentCollectivesFailNamingAPeer) {
  auto group = make_test_group("inproc", 3);
  const auto outcomes = run_ranks(group, [](Transport& t) {
    const CollectiveOptions options{.timeout = std::chrono::seconds(10)};
    if (t.rank() == 1) {
      barrier(t, options);
    } else {
      (void)allgather_u64(t, 1, options);
    }
  });
  for (int rank = 0; rank < 3; ++rank) {
    const auto error = pulseloco::testing::caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << describe(outcomes[static_cast<std::size_t>(rank)]);
    EXPECT_EQ(error->kind, ErrorKind::protocol) << error->what;
    ASSERT_TRUE(error->context.peer) << error->what;
    if (rank != 1) {
      EXPECT_EQ(error->context.peer, 1) << error->what;
    }
  }
}

// The ring all-reduce sends its header to its right neighbour only; the other collectives send
// theirs to every peer. A rank in another collective must be named whichever side it is on.
TEST(Mismatch, ARankOutsideTheRingAllReduceIsNamedByEveryRank) {
  for (const std::string backend : {"inproc", "tcp"}) {
    for (const int odd : {0, 1, 2, 3}) {
      SCOPED_TRACE(fmt::format("{}: rank {} calls allgather_u64", backend, odd));
      auto group = make_test_group(backend, 4);
      const auto outcomes = run_ranks(group, [&](Transport& t) {
        const CollectiveOptions options{.timeout = std::chrono::seconds(10),
                                        .algorithm = CollectiveAlgorithm::ring};
        if (t.rank() == odd) {
          (void)allgather_u64(t, 1, options);
          return;
        }
        const std::vector<float> input(1000, 1.0F);
        std::vector<float> output(input.size());
        allreduce_sum(t, input, output, options);
      });
      for (int rank = 0; rank < 4; ++rank) {
        const auto error =
            pulseloco::testing::caught_error(outcomes[static_cast<std::size_t>(rank)]);
        ASSERT_TRUE(error) << "rank " << rank << ": "
                           << describe(outcomes[static_cast<std::size_t>(rank)]);
        EXPECT_EQ(error->kind, ErrorKind::protocol) << error->what;
        ASSERT_TRUE(error->context.peer) << error->what;
        if (rank != odd) {
          EXPECT_EQ(error->context.peer, odd) << error->what;
        }
      }
    }
  }
}

// Every rank but `broadcaster` all-gathers `gathered` bytes over TCP while `broadcaster`
// broadcasts from itself (same options, so only the operation tells the headers apart), and
// every rank fails. What the protocol guarantees, however the failure races with the headers:
// - every rank fails with a protocol error, and every rank but the broadcaster names it;
// - no rank is given a buffer for the broadcaster's message (its header is of another
//   collective), nor any buffer but its left neighbour's before every header has been checked
//   (the full check fails here, so the left neighbour's, asked for early, is the only one);
// - a requested buffer has the size the peer's header announced.
// Whether a rank asks for its left neighbour's buffer before the failure reaches it is a race
// (a peer's notice may come first): it is allowed, never required.
void expect_no_buffer_beyond_matching_left_neighbours(int world, int broadcaster,
                                                      std::size_t gathered) {
  auto group = make_test_group("tcp", world);
  std::vector<std::vector<std::pair<int, std::size_t>>> asked(static_cast<std::size_t>(world));
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const CollectiveOptions options{.timeout = std::chrono::seconds(10)};
    if (t.rank() == broadcaster) {
      // Its header announces this size, which is not the size of a message to gather.
      std::vector<std::byte> data(gathered + 999);
      broadcast(t, broadcaster, data, options);
      return;
    }
    const auto mine = pattern_bytes(gathered, t.rank());
    std::vector<std::vector<std::byte>> storage(static_cast<std::size_t>(world));
    sparse_allgather_into(
        t, mine,
        [&](int rank, std::size_t bytes) {
          asked[static_cast<std::size_t>(t.rank())].emplace_back(rank, bytes);
          auto& buffer = storage[static_cast<std::size_t>(rank)];
          buffer.resize(bytes);
          return std::span(buffer);
        },
        options);
  });
  for (int rank = 0; rank < world; ++rank) {
    const auto error = pulseloco::testing::caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << "rank " << rank << ": "
                       << describe(outcomes[static_cast<std::size_t>(rank)]);
    EXPECT_EQ(error->kind, ErrorKind::protocol) << error->what;
    if (rank != broadcaster) {
      EXPECT_EQ(error->context.peer, broadcaster) << error->what;
    }
    const auto& requests = asked[static_cast<std::size_t>(rank)];
    const int left = (rank - 1 + world) % world;
    const std::size_t allowed = rank == broadcaster || left == broadcaster ? 0 : 1;
    EXPECT_LE(requests.size(), allowed) << "rank " << rank;
    for (const auto& [peer, bytes] : requests) {
      EXPECT_NE(peer, broadcaster) << "rank " << rank;
      EXPECT_EQ(peer, left) << "rank " << rank;
      EXPECT_EQ(bytes, gathered) << "rank " << rank << " asked for rank " << peer;
    }
  }
}

TEST(Mismatch, ThePeerOfAnotherCollectiveIsGivenNoBufferByTheAllGather) {
  // Three ranks with small messages: rank 1 broadcasts. Rank 2, whose left neighbour it is,
  // asks for nothing; rank 0 at most for rank 2's buffer.
  expect_no_buffer_beyond_matching_left_neighbours(3, 1, 10);
}

TEST(Mismatch, NoBufferBeyondTheLeftNeighboursIsGivenBeforeEveryHeaderIsChecked) {
  // Four ranks, messages above the latency bound (the ring): rank 2 broadcasts. Ranks 0 and 1
  // ask at most for the buffers of ranks 3 and 0, rank 3 for nothing.
  expect_no_buffer_beyond_matching_left_neighbours(4, 2, 64 << 10);
}

TEST(Mismatch, DifferentOptionsAreReportedAsInvalidArguments) {
  auto group = make_test_group("inproc", 2);
  const auto outcomes = run_ranks(group, [](Transport& t) {
    const std::vector<std::byte> mine(10);
    (void)sparse_allgather(t, mine,
                           {.timeout = std::chrono::seconds(10),
                            .pipeline_chunk_bytes = t.rank() == 0 ? 4096U : 8192U});
  });
  for (int rank = 0; rank < 2; ++rank) {
    const auto error = pulseloco::testing::caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << describe(outcomes[static_cast<std::size_t>(rank)]);
    EXPECT_EQ(error->kind, ErrorKind::invalid_argument) << error->what;
    EXPECT_EQ(error->context.peer, 1 - rank) << error->what;
  }
}

TEST(Mismatch, AnAnnouncedSizeAboveTheLimitIsAProtocolViolation) {
  auto group = make_test_group("inproc", 2);
  const auto outcomes = run_ranks(group, [](Transport& t) {
    const std::vector<std::byte> mine(t.rank() == 0 ? 2000 : 10);
    // Rank 1 accepts at most 1000 bytes from a peer; rank 0 allows its own 2000.
    (void)sparse_allgather(
        t, mine,
        {.timeout = std::chrono::seconds(10), .max_message_bytes = t.rank() == 1 ? 1000U : 4000U});
  });
  const auto error = pulseloco::testing::caught_error(outcomes[1]);
  ASSERT_TRUE(error) << describe(outcomes[1]);
  EXPECT_EQ(error->kind, ErrorKind::protocol) << error->what;
  EXPECT_EQ(error->context.peer, 0);
  EXPECT_TRUE(outcomes[0].error);
}

}  // namespace
}  // namespace pulseloco::collectives
