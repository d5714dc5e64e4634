// The collectives over a transport with NCCL's semantics (transport/inproc/ordered.h: tags
// ignored, messages matched by order with sizes checked, groups that complete as a whole on one
// stream, rendezvous sends), for world sizes 1 to 5 and every algorithm option; and the double's
// own strictness, so that a collective that posts in the wrong order fails here rather than
// hangs on a GPU.
#include <pulseloco/collectives/collectives.h>

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <ostream>
#include <set>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/inproc/ordered.h>
#include "collective_reference.h"
#include "rank_harness.h"

namespace pulseloco::collectives {
namespace {

using pulseloco::testing::caught_error;
using pulseloco::testing::describe;
using pulseloco::testing::order_sensitive_value;
using pulseloco::testing::pattern_bytes;
using pulseloco::testing::RankOutcome;
using pulseloco::testing::run_ranks;
using transport::Transport;
using transport::inproc::make_ordered_group;

void expect_all_succeeded(const std::vector<RankOutcome>& outcomes) {
  for (std::size_t rank = 0; rank < outcomes.size(); ++rank)
    EXPECT_FALSE(outcomes[rank].error) << "rank " << rank << ": " << describe(outcomes[rank]);
}

constexpr CollectiveAlgorithm kAlgorithms[] = {
    CollectiveAlgorithm::automatic, CollectiveAlgorithm::ring, CollectiveAlgorithm::direct};

struct Case {
  int world = 1;
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::automatic;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "world " << c.world << ", " << algorithm_name(c.algorithm);
}

std::vector<Case> cases() {
  std::vector<Case> all;
  for (int world = 1; world <= 5; ++world)
    for (const auto algorithm : kAlgorithms)
      all.push_back({world, algorithm});
  return all;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return fmt::format("world{}_{}", info.param.world, algorithm_name(info.param.algorithm));
}

class OrderedTransport : public ::testing::TestWithParam<Case> {
 protected:
  [[nodiscard]] CollectiveOptions options(std::size_t chunk = std::size_t{1} << 20) const {
    return {.timeout = std::chrono::seconds(20),
            .algorithm = GetParam().algorithm,
            .pipeline_chunk_bytes = chunk};
  }
};

// Sizes that cover empty, one-byte, odd and skewed messages (rank 0 large).
std::size_t message_size(int pattern, int rank) {
  const auto r = static_cast<std::size_t>(rank);
  switch (pattern) {
    case 0:
      return 0;
    case 1:
      return 1;
    case 2:
      return 1 + 2 * (r * 1009 + r * r * 37);
    case 3:
      return r % 2 == 0 ? 0 : 777 * r + 3;
    default:
      return rank == 0 ? (std::size_t{1} << 20) + 3 : 17 + r;
  }
}

TEST_P(OrderedTransport, SparseAllGatherDeliversEveryMessageWithItsCallbacks) {
  const int world = GetParam().world;
  auto group = make_ordered_group(world);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    // Several calls in a row, so that every call's messages must stay in turn.
    for (int pattern = 0; pattern < 5; ++pattern) {
      std::vector<std::vector<std::byte>> expected;
      for (int rank = 0; rank < world; ++rank)
        expected.push_back(pattern_bytes(message_size(pattern, rank), rank, 7 + pattern));
      std::vector<int> order;
      std::set<int> seen;
      const auto result = sparse_allgather(
          t, expected[static_cast<std::size_t>(t.rank())], options(100 + pattern),
          [&](int rank, std::span<const std::byte> message) {
            order.push_back(rank);
            const auto& want = expected[static_cast<std::size_t>(rank)];
            if (!std::equal(message.begin(), message.end(), want.begin(), want.end()))
              throw std::runtime_error(fmt::format("callback for rank {}: other bytes", rank));
            seen.insert(rank);
          });
      if (result != expected) throw std::runtime_error("result differs from the messages sent");
      if (static_cast<int>(seen.size()) != world || static_cast<int>(order.size()) != world ||
          order.front() != t.rank())
        throw std::runtime_error("callbacks: not once per rank with the own message first");
    }
  });
  expect_all_succeeded(outcomes);
}

TEST_P(OrderedTransport, SparseAllGatherIntoFillsTheCallersBuffers) {
  const int world = GetParam().world;
  auto group = make_ordered_group(world);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    std::vector<std::vector<std::byte>> expected;
    for (int rank = 0; rank < world; ++rank)
      expected.push_back(pattern_bytes(message_size(2, rank), rank, 3));
    std::vector<std::vector<std::byte>> arena(static_cast<std::size_t>(world));
    sparse_allgather_into(
        t, expected[static_cast<std::size_t>(t.rank())],
        [&](int rank, std::size_t bytes) {
          auto& slot = arena[static_cast<std::size_t>(rank)];
          slot.assign(bytes, std::byte{0x5A});
          return std::span<std::byte>(slot);
        },
        options());
    if (arena != expected) throw std::runtime_error("buffers differ from the messages sent");
  });
  expect_all_succeeded(outcomes);
}

TEST_P(OrderedTransport, AllReduceGivesEveryRankTheSameBytesFromTheNativeSum) {
  const int world = GetParam().world;
  auto group = make_ordered_group(world);
  for (const std::size_t count :
       {std::size_t{0}, std::size_t{1}, std::size_t{5}, std::size_t{1000}, std::size_t{65539}}) {
    std::vector<std::vector<float>> inputs(static_cast<std::size_t>(world));
    for (int rank = 0; rank < world; ++rank)
      for (std::size_t e = 0; e < count; ++e)
        inputs[static_cast<std::size_t>(rank)].push_back(order_sensitive_value(rank, e));
    // The double's native sum: plain rank order.
    const std::vector<float> expected = pulseloco::testing::plain_rank_order_sum(inputs);
    std::vector<std::vector<float>> outputs(static_cast<std::size_t>(world));
    const auto outcomes = run_ranks(group, [&](Transport& t) {
      auto& output = outputs[static_cast<std::size_t>(t.rank())];
      output.assign(count, std::numeric_limits<float>::quiet_NaN());
      allreduce_sum(t, inputs[static_cast<std::size_t>(t.rank())], output, options(400));
    });
    expect_all_succeeded(outcomes);
    for (int rank = 0; rank < world; ++rank) {
      EXPECT_EQ(std::memcmp(outputs[static_cast<std::size_t>(rank)].data(), expected.data(),
                            count * sizeof(float)),
                0)
          << "rank " << rank << ", " << count << " elements";
    }
  }
}

TEST_P(OrderedTransport, BroadcastBarrierAndAllGatherU64) {
  const int world = GetParam().world;
  auto group = make_ordered_group(world);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    for (const int root : std::set<int>{0, world - 1}) {
      for (const std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{300'001}}) {
        const auto expected = pattern_bytes(bytes, root, 11);
        std::vector<std::byte> data =
            t.rank() == root ? expected : std::vector<std::byte>(bytes, std::byte{0x5A});
        broadcast(t, root, data, options(64 << 10));
        if (data != expected) throw std::runtime_error("broadcast delivered other bytes");
        barrier(t, options());
        const auto values = allgather_u64(t, 1000 + static_cast<std::uint64_t>(t.rank()), {});
        for (int rank = 0; rank < world; ++rank)
          if (values[static_cast<std::size_t>(rank)] != 1000 + static_cast<std::uint64_t>(rank))
            throw std::runtime_error("allgather_u64 returned another value");
      }
    }
  });
  expect_all_succeeded(outcomes);
}

INSTANTIATE_TEST_SUITE_P(Cases, OrderedTransport, ::testing::ValuesIn(cases()), case_name);

// Failures stay bounded and name a peer where no notice may travel.

TEST(OrderedTransportFailures, ADisagreementIsNamedAlikeByEveryRank) {
  constexpr int kWorld = 4;
  auto group = make_ordered_group(kWorld);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const std::vector<float> input(t.rank() == 2 ? 7 : 6, 1.0F);
    std::vector<float> output(input.size());
    allreduce_sum(t, input, output, {.timeout = std::chrono::seconds(5)});
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    const auto error = caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << "rank " << rank << ": "
                       << describe(outcomes[static_cast<std::size_t>(rank)]);
    EXPECT_EQ(error->kind, ErrorKind::invalid_argument) << error->what;
    if (rank != 2) {
      EXPECT_EQ(error->context.peer, 2) << error->what;
    }
  }
}

TEST(OrderedTransportFailures, ARankThatNeverCallsMakesTheOthersTimeOutNamingAPeer) {
  constexpr int kWorld = 3;
  auto group = make_ordered_group(kWorld);
  const auto timeout = std::chrono::milliseconds(300);
  const auto start = transport::Clock::now();
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    if (t.rank() == 1) return;  // never joins
    std::vector<std::byte> data(64, std::byte{1});
    broadcast(t, 0, data, {.timeout = timeout});
  });
  for (const int rank : {0, 2}) {
    const auto error = caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << "rank " << rank;
    EXPECT_EQ(error->kind, ErrorKind::timeout) << error->what;
    ASSERT_TRUE(error->context.peer.has_value()) << error->what;
    EXPECT_NE(*error->context.peer, rank) << error->what;
    EXPECT_LE(outcomes[static_cast<std::size_t>(rank)].finished - start,
              pulseloco::testing::fails_within(timeout));
  }
}

TEST(OrderedTransportFailures,
     ARankWhoseCallbackThrowsKeepsItsErrorAndTheOthersTimeOutNamingAPeer) {
  constexpr int kWorld = 3;
  auto group = make_ordered_group(kWorld);
  const auto timeout = std::chrono::milliseconds(300);
  const auto start = transport::Clock::now();
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const auto mine = pattern_bytes(100, t.rank());
    (void)sparse_allgather(t, mine, {.timeout = timeout}, [&](int, std::span<const std::byte>) {
      if (t.rank() == 1) throw std::runtime_error("the callback of rank 1 failed");
    });
  });
  EXPECT_NE(describe(outcomes[1]).find("the callback of rank 1 failed"), std::string::npos)
      << describe(outcomes[1]);
  for (const int rank : {0, 2}) {
    const auto error = caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << "rank " << rank << ": "
                       << describe(outcomes[static_cast<std::size_t>(rank)]);
    // The peer it waited on: rank 1, or a peer whose operations share a group with rank 1's
    // (they complete together, so the waiting rank cannot tell them apart).
    EXPECT_EQ(error->kind, ErrorKind::timeout) << error->what;
    ASSERT_TRUE(error->context.peer.has_value()) << error->what;
    EXPECT_NE(*error->context.peer, rank) << error->what;
    EXPECT_LE(outcomes[static_cast<std::size_t>(rank)].finished - start,
              pulseloco::testing::fails_within(timeout));
  }
}

// The double's own semantics.

TEST(OrderedDouble, MessagesMatchByOrderNotTagAndDifferentSizesFailLoudly) {
  auto group = make_ordered_group(2);
  const auto deadline = transport::deadline_after(std::chrono::seconds(5));
  std::vector<std::byte> small(8, std::byte{1});
  std::vector<std::byte> large(16, std::byte{2});
  auto first = group[0]->isend(1, 1, small);
  auto second = group[0]->isend(1, 2, large);
  std::vector<std::byte> into_large(16);
  std::vector<std::byte> into_small(8);
  // Rank 1 asks for tag 2 first: the first message (8 bytes) meets a 16-byte receive.
  auto wrong = group[1]->irecv(0, 2, into_large);
  auto other = group[1]->irecv(0, 1, into_small);
  (void)group[0]->isend(1, 3, {});  // zero bytes: complete at once, no place in the order
  EXPECT_FALSE(first->test());      // launches rank 0's group
  try {
    wrong->wait(deadline);
    ADD_FAILURE() << "a size mismatch went unnoticed";
  } catch (const ProtocolError& error) {
    EXPECT_EQ(error.context().peer, 0);
  }
}

TEST(OrderedDouble, ASendWaitsForItsReceiveToBeLaunched) {
  auto group = make_ordered_group(2);
  std::vector<std::byte> out0(8, std::byte{1}), out1(8, std::byte{2}), in0(8), in1(8);
  // Both ranks send first and wait before posting their receives: NCCL hangs, so must the
  // double.
  auto send0 = group[0]->isend(1, 0, out0);
  auto send1 = group[1]->isend(0, 0, out1);
  const auto soon = transport::deadline_after(std::chrono::milliseconds(50));
  EXPECT_THROW(send0->wait(soon), TimeoutError);
  EXPECT_THROW(send1->wait(soon), TimeoutError);
  // Posted now, the receives are in a later group, behind the stuck sends: still stuck.
  auto recv0 = group[0]->irecv(1, 0, in0);
  auto recv1 = group[1]->irecv(0, 0, in1);
  EXPECT_THROW(recv0->wait(transport::deadline_after(std::chrono::milliseconds(50))), TimeoutError);
  // Launched together, a send and a receive progress.
  auto group2 = make_ordered_group(2);
  auto s0 = group2[0]->isend(1, 0, out0);
  auto r0 = group2[0]->irecv(1, 0, in0);
  auto s1 = group2[1]->isend(0, 0, out1);
  auto r1 = group2[1]->irecv(0, 0, in1);
  const auto deadline = transport::deadline_after(std::chrono::seconds(5));
  EXPECT_FALSE(s0->test());
  r1->wait(deadline);
  r0->wait(deadline);
  EXPECT_EQ(in0, out1);
  EXPECT_EQ(in1, out0);
}

}  // namespace
}  // namespace pulseloco::collectives
