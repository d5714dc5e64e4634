// The subgroup view of a transport (transport/subgroup.h) and the node-aware all-gather
// (collectives.h, sparse_allgather_nodes), every rank a thread of this process: the view's
// numbering, errors, sequence numbers and abort; the all-gather's results against the flat
// all-gather's for 1 to 8 ranks, equal, unequal and non-contiguous nodes, empty and large
// messages, over the in-process transport and TCP loopback; the bytes that cross into each
// node; bad layouts; a rank killed or aborted mid-exchange.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/transport/forwarding.h>
#include <pulseloco/transport/inproc/inproc.h>
#include <pulseloco/transport/subgroup.h>
#include "rank_harness.h"
#include "test_groups.h"

namespace pulseloco::collectives {
namespace {

using namespace std::chrono_literals;
using pulseloco::testing::caught_error;
using pulseloco::testing::describe;
using pulseloco::testing::make_test_group;
using pulseloco::testing::pattern_bytes;
using pulseloco::testing::RankOutcome;
using pulseloco::testing::run_ranks;
using transport::SubgroupTransport;
using transport::Transport;
using transport::inproc::FaultAction;
using transport::inproc::FaultInjector;
using transport::inproc::MessageEvent;

// The timeout of the failure tests, as in collectives_fault_test.cpp (survivors must fail
// within twice it); where no timeout is under test, waits get kPatience, so that a loaded
// machine does not fail them; the stalled member's peers wait kStallTimeout for it.
constexpr std::chrono::milliseconds kTimeout = 1000ms;
constexpr std::chrono::milliseconds kPatience = 30'000ms;
constexpr std::chrono::milliseconds kStallTimeout = 3000ms;

void expect_all_succeeded(const std::vector<RankOutcome>& outcomes) {
  for (std::size_t rank = 0; rank < outcomes.size(); ++rank) {
    EXPECT_FALSE(outcomes[rank].error) << "rank " << rank << ": " << describe(outcomes[rank]);
  }
}

// ---------------------------------------------------------------------------------------------
// The view

TEST(SubgroupTransport, NumbersItsMembersInOrderAndMovesTheirMessages) {
  auto group = transport::inproc::make_group(5);
  const std::vector<int> members{4, 1, 3};
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    if (t.rank() != 4 && t.rank() != 1 && t.rank() != 3) return;
    SubgroupTransport view(t, members);
    EXPECT_EQ(view.size(), 3);
    EXPECT_EQ(view.parent_rank(view.rank()), t.rank());
    EXPECT_EQ(view.backend(), t.backend());
    const auto deadline = transport::deadline_after(kPatience);
    // Each member sends its parent rank to the next member (in the view's numbering).
    const int right = (view.rank() + 1) % 3;
    const int left = (view.rank() + 2) % 3;
    const std::vector<std::byte> out{static_cast<std::byte>(t.rank())};
    std::vector<std::byte> in(1);
    auto receive = view.irecv(left, 7, in);
    view.send(right, 7, out, deadline);
    receive->wait(deadline);
    EXPECT_EQ(static_cast<int>(in[0]), members[static_cast<std::size_t>(left)]);
    EXPECT_EQ(view.stats().messages_sent, t.stats().messages_sent);
  });
  expect_all_succeeded(outcomes);
}

TEST(SubgroupTransport, RefusesBadMembers) {
  auto group = transport::inproc::make_group(3);
  EXPECT_THROW(SubgroupTransport(*group[0], {0, 3}), InvalidArgument);
  EXPECT_THROW(SubgroupTransport(*group[0], {0, 1, 0}), InvalidArgument);
  EXPECT_THROW(SubgroupTransport(*group[0], {1, 2}), InvalidArgument);
  EXPECT_THROW(SubgroupTransport(*group[0], {-1, 0}), InvalidArgument);
}

TEST(SubgroupTransport, NumbersItsCallsFromItsFirstSequence) {
  auto group = transport::inproc::make_group(2);
  SubgroupTransport view(*group[0], {0, 1}, 40);
  EXPECT_EQ(view.next_sequence(3), 40U);
  EXPECT_EQ(view.next_sequence(3), 41U);
  EXPECT_EQ(view.next_sequence(5), 40U);
  EXPECT_EQ(group[0]->next_sequence(3), 0U);  // the parent's numbers are its own
}

TEST(SubgroupTransport, LostPeersAndErrorsNameTheViewsRanks) {
  auto faults = std::make_shared<FaultInjector>();
  auto group = transport::inproc::make_group(5, {.faults = faults});
  SubgroupTransport view(*group[2], {4, 2, 0});
  std::vector<std::byte> in(1);
  auto receive = view.irecv(0, 1, in);  // from parent rank 4
  faults->kill(1);                      // not a member
  faults->kill(4);
  EXPECT_EQ(view.lost_peers(), std::vector<int>{0});
  try {
    receive->wait(transport::deadline_after(kPatience));
    FAIL() << "the receive from a killed member completed";
  } catch (const PeerLostError& error) {
    EXPECT_EQ(error.context().peer, 0) << error.what();
  }
}

TEST(SubgroupTransport, AbortAbortsTheParentAfterItsHookWhichLearnsTheCulprit) {
  auto group = transport::inproc::make_group(3);
  int hooks = 0;
  bool parent_usable_in_hook = false;
  SubgroupTransport view(*group[1], {1, 2}, 0,
                         [&](int culprit, ErrorKind kind, std::string_view reason) {
                           ++hooks;
                           EXPECT_EQ(culprit, 2);  // the view's rank 1
                           EXPECT_EQ(kind, ErrorKind::timeout);
                           EXPECT_EQ(reason, "stop");
                           std::vector<std::byte> out{std::byte{1}};
                           try {
                             (void)group[1]->isend(0, 9, out)->test();
                             parent_usable_in_hook = true;
                           } catch (const Error&) {
                           }
                         });
  view.abort_blaming(1, ErrorKind::timeout, "stop");
  view.abort("again");
  EXPECT_EQ(hooks, 1);
  EXPECT_TRUE(parent_usable_in_hook);
  std::vector<std::byte> in(1);
  EXPECT_THROW(group[1]->irecv(0, 2, in)->wait(transport::deadline_after(kPatience)), AbortedError);
}

// A collective over a view that fails passes its verdict to the view's hook, in the parent's
// numbering, and its error names the culprit in the parent's numbering once translated.
TEST(SubgroupTransport, ACollectivesVerdictReachesTheHookAndTheErrorInTheParentsNumbering) {
  auto faults = std::make_shared<FaultInjector>();
  auto group = transport::inproc::make_group(4, {.faults = faults});
  const std::vector<int> members{3, 1, 2};
  faults->set_hook([](const MessageEvent& m) {
    return m.from == 2 && (m.tag & 0xFF) == 3 ? FaultAction::stall_sender : FaultAction::deliver;
  });
  std::mutex mutex;
  std::map<int, std::pair<int, ErrorKind>> blamed;  // by parent rank
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    if (t.rank() == 0) return;
    const int me = t.rank();
    SubgroupTransport view(t, members, 0, [&](int culprit, ErrorKind kind, std::string_view) {
      const std::lock_guard lock(mutex);
      blamed[me] = {culprit, kind};
    });
    try {
      (void)sparse_allgather(view, pattern_bytes(100, me), {.timeout = kStallTimeout});
    } catch (const Error& error) {
      view.rethrow_in_parent_numbering(error, "the test's all-gather");
    }
  });
  for (const int rank : {3, 1}) {
    ASSERT_TRUE(blamed.contains(rank)) << "rank " << rank;
    EXPECT_EQ(blamed[rank].first, 2) << "rank " << rank;
    EXPECT_EQ(blamed[rank].second, ErrorKind::timeout) << "rank " << rank;
    const auto error = caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << "rank " << rank;
    EXPECT_EQ(error->kind, ErrorKind::timeout) << error->what;
    EXPECT_EQ(error->context.peer, 2) << error->what;
    EXPECT_EQ(error->context.rank, rank) << error->what;
  }
}

// Views over one parent, one after the other (with the numbers drawn from the parent) and at
// the same time from two threads per rank (distinct base tags), run collectives correctly.
TEST(SubgroupTransport, ViewsRunCollectivesInTurnAndAtTheSameTime) {
  auto group = transport::inproc::make_group(4);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const CollectiveOptions options{.timeout = kPatience};
    const auto mine = pattern_bytes(3000, t.rank());
    for (int round = 0; round < 3; ++round) {
      // Evens and odds, then everyone, over the same parent.
      const std::vector<int> half =
          t.rank() % 2 == 0 ? std::vector<int>{0, 2} : std::vector<int>{1, 3};
      SubgroupTransport pair(t, half, t.next_sequence(0));
      const auto got = sparse_allgather(pair, mine, options);
      for (int r = 0; r < 2; ++r)
        EXPECT_EQ(got[static_cast<std::size_t>(r)],
                  pattern_bytes(3000, half[static_cast<std::size_t>(r)]));
      SubgroupTransport all(t, {3, 2, 1, 0}, t.next_sequence(0));
      const auto everyone = sparse_allgather(all, mine, options);
      for (int r = 0; r < 4; ++r)
        EXPECT_EQ(everyone[static_cast<std::size_t>(r)], pattern_bytes(3000, 3 - r));
    }
    SubgroupTransport first(t, {0, 1, 2, 3});
    SubgroupTransport second(t, {3, 2, 1, 0});
    std::vector<std::vector<std::byte>> a;
    std::vector<std::vector<std::byte>> b;
    std::jthread other(
        [&] { b = sparse_allgather(second, mine, {.timeout = kPatience, .tag = 2}); });
    a = sparse_allgather(first, mine, {.timeout = kPatience, .tag = 1});
    other.join();
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(a[static_cast<std::size_t>(r)], pattern_bytes(3000, r));
      EXPECT_EQ(b[static_cast<std::size_t>(r)], pattern_bytes(3000, 3 - r));
    }
  });
  expect_all_succeeded(outcomes);
}

// ---------------------------------------------------------------------------------------------
// The node-aware all-gather: results

struct Case {
  std::string backend;
  std::vector<int> layout;
  CollectiveAlgorithm algorithm;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string name = info.param.backend + "_";
  for (const int node : info.param.layout)
    name += std::to_string(node);
  name += "_" + std::string(algorithm_name(info.param.algorithm));
  return name;
}

// Sizes with empty messages and different sizes (rank 1's is empty, others vary).
std::size_t size_of_rank(int rank) {
  return rank == 1 ? 0 : 1000 + 777 * static_cast<std::size_t>(rank);
}

class NodeAllGather : public ::testing::TestWithParam<Case> {};

TEST_P(NodeAllGather, DeliversEveryMessageAsTheFlatAllGatherDoes) {
  const Case& c = GetParam();
  const int world = static_cast<int>(c.layout.size());
  auto group = make_test_group(c.backend, world);
  const NodeLayout layout{c.layout};
  const CollectiveOptions options{
      .timeout = 10s, .algorithm = c.algorithm, .pipeline_chunk_bytes = 1024};
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const auto mine = pattern_bytes(size_of_rank(t.rank()), t.rank());
    std::vector<std::vector<std::byte>> stored(static_cast<std::size_t>(world));
    std::vector<int> buffers_asked(static_cast<std::size_t>(world), 0);
    std::vector<int> delivered(static_cast<std::size_t>(world), 0);
    std::vector<int> order;
    sparse_allgather_nodes(
        t, layout, mine,
        [&](int rank, std::size_t bytes) {
          ++buffers_asked[static_cast<std::size_t>(rank)];
          auto& slot = stored[static_cast<std::size_t>(rank)];
          slot.resize(bytes);
          return std::span<std::byte>(slot);
        },
        options,
        [&](int rank, std::span<const std::byte> message) {
          ++delivered[static_cast<std::size_t>(rank)];
          order.push_back(rank);
          EXPECT_EQ(message.data(), stored[static_cast<std::size_t>(rank)].data());
          EXPECT_EQ(std::vector<std::byte>(message.begin(), message.end()),
                    pattern_bytes(size_of_rank(rank), rank));
        });
    const auto flat = sparse_allgather(t, mine, options);
    EXPECT_EQ(stored, flat);
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(stored[static_cast<std::size_t>(r)], pattern_bytes(size_of_rank(r), r));
      EXPECT_EQ(buffers_asked[static_cast<std::size_t>(r)], 1) << "rank " << r;
      EXPECT_EQ(delivered[static_cast<std::size_t>(r)], 1) << "rank " << r;
    }
    ASSERT_FALSE(order.empty());
    EXPECT_EQ(order.front(), t.rank());
    // The transport stays usable, and a second call agrees too.
    const auto again = sparse_allgather_nodes(t, layout, mine, options);
    EXPECT_EQ(again, flat);
  });
  expect_all_succeeded(outcomes);
}

std::vector<Case> cases() {
  const std::vector<std::vector<int>> layouts{
      {0},
      {0, 0},
      {0, 1},
      {0, 1, 0},
      {0, 0, 1, 1},
      {0, 1, 0, 1},
      {7, 7, 7, 3, 3},
      {2, 0, 1, 0, 2},
      {0, 0, 0, 1, 1, 2},
      {0, 1, 2, 0, 1, 2, 0},
      {0, 0, 0, 0, 1, 1, 1, 1},
      {0, 1, 1, 2, 2, 2, 3, 3},
      {5, 4, 3, 2, 1, 0, 0, 1},
  };
  std::vector<Case> all;
  for (const auto& backend : {std::string("inproc"), std::string("tcp")}) {
    for (const auto& layout : layouts) {
      for (const auto algorithm : {CollectiveAlgorithm::ring, CollectiveAlgorithm::direct}) {
        if (backend == "tcp" && algorithm == CollectiveAlgorithm::ring && layout.size() < 5)
          continue;  // TCP: both algorithms on the larger groups only, to keep the test short
        all.push_back({backend, layout, algorithm});
      }
    }
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Layouts, NodeAllGather, ::testing::ValuesIn(cases()), case_name);

TEST(NodeAllGatherLarge, MessagesOfSeveralChunksOverTcp) {
  const std::vector<int> nodes{0, 1, 0, 1, 1};
  auto group = make_test_group("tcp", 5);
  const CollectiveOptions options{.timeout = 30s, .pipeline_chunk_bytes = 1 << 20};
  const auto size = [](int rank) {
    return (std::size_t{3} << 20) + 4099 * static_cast<std::size_t>(rank);
  };
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const auto mine = pattern_bytes(size(t.rank()), t.rank(), 9);
    const auto got = sparse_allgather_nodes(t, {nodes}, mine, options);
    for (int r = 0; r < 5; ++r)
      EXPECT_EQ(got[static_cast<std::size_t>(r)], pattern_bytes(size(r), r, 9));
  });
  expect_all_succeeded(outcomes);
}

TEST(NodeAllGatherLarge, AllEmpty) {
  auto group = make_test_group("inproc", 6);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const auto got = sparse_allgather_nodes(t, {{0, 0, 1, 1, 1, 2}}, {}, {.timeout = kPatience});
    for (const auto& message : got)
      EXPECT_TRUE(message.empty());
  });
  expect_all_succeeded(outcomes);
}

// ---------------------------------------------------------------------------------------------
// Bytes into each node

// Counts the payload bytes this rank receives from ranks of other nodes (posted receives of
// the payload phase, collectives/detail/packets.h; every one completes in a successful call).
class CountingTransport : public transport::ForwardingTransport {
 public:
  CountingTransport(std::unique_ptr<Transport> inner, std::vector<int> nodes)
      : ForwardingTransport(std::move(inner)), nodes_(std::move(nodes)) {}
  [[nodiscard]] std::unique_ptr<transport::Request> irecv(int peer, transport::Tag tag,
                                                          std::span<std::byte> data) override {
    const bool payload = (tag & 0xFF) == 3;
    if (nodes_[static_cast<std::size_t>(peer)] != nodes_[static_cast<std::size_t>(rank())]) {
      (payload ? remote_payload : remote_other) += data.size();
    }
    return ForwardingTransport::irecv(peer, tag, data);
  }
  std::uint64_t remote_payload = 0;
  std::uint64_t remote_other = 0;  // headers, notices

 private:
  std::vector<int> nodes_;
};

TEST(NodeAllGatherBytes, EachRemoteMessageEntersEachNodeOnce) {
  const std::vector<int> nodes{0, 1, 2, 0, 1, 0, 0, 2};  // nodes of 4, 2 and 2 ranks
  const int world = static_cast<int>(nodes.size());
  for (const bool node_aware : {true, false}) {
    auto inner = transport::inproc::make_group(world);
    std::vector<std::unique_ptr<Transport>> group;
    std::vector<CountingTransport*> counters;
    for (auto& t : inner) {
      auto counting = std::make_unique<CountingTransport>(std::move(t), nodes);
      counters.push_back(counting.get());
      group.push_back(std::move(counting));
    }
    const CollectiveOptions options{.timeout = 10s, .algorithm = CollectiveAlgorithm::direct};
    const auto outcomes = run_ranks(group, [&](Transport& t) {
      const auto mine = pattern_bytes(size_of_rank(t.rank()), t.rank());
      if (node_aware) {
        (void)sparse_allgather_nodes(t, {nodes}, mine, options);
      } else {
        (void)sparse_allgather(t, mine, options);
      }
    });
    expect_all_succeeded(outcomes);
    std::map<int, std::uint64_t> payload_into;
    std::map<int, std::uint64_t> other_into;
    std::map<int, std::uint64_t> remote_messages;
    std::map<int, std::uint64_t> ranks_of;
    for (int r = 0; r < world; ++r) {
      payload_into[nodes[static_cast<std::size_t>(r)]] +=
          counters[static_cast<std::size_t>(r)]->remote_payload;
      other_into[nodes[static_cast<std::size_t>(r)]] +=
          counters[static_cast<std::size_t>(r)]->remote_other;
      ++ranks_of[nodes[static_cast<std::size_t>(r)]];
      for (int node = 0; node < 3; ++node) {
        if (node != nodes[static_cast<std::size_t>(r)]) remote_messages[node] += size_of_rank(r);
      }
    }
    for (int node = 0; node < 3; ++node) {
      const std::uint64_t expected =
          node_aware ? remote_messages[node] : ranks_of[node] * remote_messages[node];
      EXPECT_EQ(payload_into[node], expected)
          << (node_aware ? "node-aware" : "flat") << ", node " << node;
      // Headers and notices: a few dozen bytes per pair of ranks.
      EXPECT_LE(other_into[node], 256 * ranks_of[node] * static_cast<std::uint64_t>(world))
          << (node_aware ? "node-aware" : "flat") << ", node " << node;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Bad layouts

TEST(NodeAllGatherLayout, OfTheWrongSizeOrWithANegativeNodeIsRefusedBeforeAnythingIsSent) {
  auto group = transport::inproc::make_group(1);
  EXPECT_THROW((void)sparse_allgather_nodes(*group[0], {{0, 0}}, {}, {}), InvalidArgument);
  EXPECT_THROW((void)sparse_allgather_nodes(*group[0], {{-2}}, {}, {}), InvalidArgument);
  const auto fine = sparse_allgather_nodes(*group[0], {{0}}, {}, {});  // still usable
  EXPECT_EQ(fine.size(), 1U);
}

TEST(NodeAllGatherLayout, ThatOneRankDisagreesWithIsNamedEverywhere) {
  auto group = transport::inproc::make_group(5);
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    const std::vector<int> layout =
        t.rank() == 3 ? std::vector<int>{0, 0, 1, 1, 0} : std::vector<int>{0, 0, 1, 1, 1};
    (void)sparse_allgather_nodes(t, {layout}, {}, {.timeout = kPatience});
  });
  for (int rank = 0; rank < 5; ++rank) {
    const auto error = caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << "rank " << rank;
    EXPECT_EQ(error->kind, ErrorKind::invalid_argument) << error->what;
    if (rank != 3) {
      EXPECT_EQ(error->context.peer, 3) << error->what;
    }
    EXPECT_NE(error->what.find("rank 3"), std::string::npos) << error->what;
  }
}

// ---------------------------------------------------------------------------------------------
// Failures

bool is_payload(const MessageEvent& m) {
  return (m.tag & 0xFF) == 3;
}

struct Fault {
  std::vector<int> layout;
  int victim;
  int nth;  // the victim's payload message at which it fails
  bool abort_instead;
};

class NodeAllGatherFault : public ::testing::TestWithParam<Fault> {};

// Every survivor throws PeerLostError naming the victim by its rank in the whole group, within
// 2x the timeout of the fault.
TEST_P(NodeAllGatherFault, EverySurvivorNamesTheVictimInTime) {
  const Fault& f = GetParam();
  const int world = static_cast<int>(f.layout.size());
  auto faults = std::make_shared<FaultInjector>();
  auto group = transport::inproc::make_group(world, {.faults = faults});
  auto* victim = group[static_cast<std::size_t>(f.victim)].get();
  auto fault_at = std::make_shared<std::atomic<transport::Clock::rep>>(0);
  auto seen = std::make_shared<std::atomic<int>>(0);
  faults->set_hook([=, &f](const MessageEvent& m) {
    if (m.from != f.victim || !is_payload(m) || seen->fetch_add(1) != f.nth)
      return FaultAction::deliver;
    fault_at->store(transport::Clock::now().time_since_epoch().count());
    if (f.abort_instead) {
      victim->abort("the engine gave up");
      return FaultAction::deliver;
    }
    return FaultAction::kill_sender;
  });
  const CollectiveOptions options{.timeout = kTimeout, .pipeline_chunk_bytes = 512};
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    (void)sparse_allgather_nodes(t, {f.layout}, pattern_bytes(3000, t.rank()), options);
  });
  ASSERT_NE(fault_at->load(), 0) << "the fault was never injected";
  const transport::Clock::time_point fault{transport::Clock::duration{fault_at->load()}};
  for (int rank = 0; rank < world; ++rank) {
    if (rank == f.victim) continue;
    const RankOutcome& outcome = outcomes[static_cast<std::size_t>(rank)];
    const auto error = caught_error(outcome);
    ASSERT_TRUE(error) << "rank " << rank << ": " << describe(outcome);
    EXPECT_EQ(error->kind, ErrorKind::peer_lost) << "rank " << rank << ": " << error->what;
    EXPECT_EQ(error->context.peer, f.victim) << "rank " << rank << ": " << error->what;
    EXPECT_EQ(error->context.rank, rank) << error->what;
    EXPECT_LE(outcome.finished - fault, pulseloco::testing::fails_within(kTimeout))
        << "rank " << rank << ": " << error->what;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Faults, NodeAllGatherFault,
    ::testing::Values(
        // Killed in its rail (its first payload message), equal nodes.
        Fault{{0, 1, 2, 0, 1, 2}, 4, 0, false},
        // Killed in its node's exchange of bundles: on its rail it sends 6 chunks of 512 bytes
        // to each of 2 peers (direct), so its 15th payload message is a chunk of its bundle.
        Fault{{0, 1, 2, 0, 1, 2}, 1, 14, false},
        // Unequal, non-contiguous nodes; the victim stands in for its node on another rail.
        Fault{{0, 1, 1, 2, 2, 2, 1}, 0, 3, false}, Fault{{0, 1, 1, 2, 2, 2, 1}, 5, 2, true},
        Fault{{0, 0, 0, 0, 1, 1, 1, 1}, 6, 8, true}),
    [](const ::testing::TestParamInfo<Fault>& param) {
      return fmt::format("case{}_victim{}_{}", param.index, param.param.victim,
                         param.param.abort_instead ? "aborted" : "killed");
    });

// Over TCP loopback: a rank aborts its transport when its rail has brought it the first message
// of another rank (from its callback, as an engine giving up would).
TEST(NodeAllGatherFaultOverTcp, ARankThatAbortsIsNamedByEverySurvivorInTime) {
  const std::vector<int> nodes{0, 1, 2, 0, 1, 2};
  constexpr int kVictim = 4;
  auto group = make_test_group("tcp", 6);
  std::atomic<transport::Clock::rep> aborted_at{0};
  const CollectiveOptions options{.timeout = kTimeout, .pipeline_chunk_bytes = 512};
  const auto outcomes = run_ranks(group, [&](Transport& t) {
    (void)sparse_allgather_nodes(
        t, {nodes}, pattern_bytes(3000, t.rank()), options,
        [&](int rank, std::span<const std::byte>) {
          if (t.rank() == kVictim && rank != kVictim && aborted_at.load() == 0) {
            aborted_at.store(transport::Clock::now().time_since_epoch().count());
            t.abort("the engine gave up");
          }
        });
  });
  ASSERT_NE(aborted_at.load(), 0) << "the victim never aborted";
  const transport::Clock::time_point fault{transport::Clock::duration{aborted_at.load()}};
  for (int rank = 0; rank < 6; ++rank) {
    if (rank == kVictim) continue;
    const RankOutcome& outcome = outcomes[static_cast<std::size_t>(rank)];
    const auto error = caught_error(outcome);
    ASSERT_TRUE(error) << "rank " << rank << ": " << describe(outcome);
    EXPECT_EQ(error->kind, ErrorKind::peer_lost) << "rank " << rank << ": " << error->what;
    EXPECT_EQ(error->context.peer, kVictim) << "rank " << rank << ": " << error->what;
    EXPECT_LE(outcome.finished - fault, pulseloco::testing::fails_within(kTimeout))
        << "rank " << rank << ": " << error->what;
  }
}

}  // namespace
}  // namespace pulseloco::collectives
