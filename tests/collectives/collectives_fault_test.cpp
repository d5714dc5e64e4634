// Failure semantics through the in-process transport's fault injection: a rank killed (as by
// SIGKILL) or stalled (as by SIGSTOP) during small and large collectives, a corrupted frame, a
// lost message, a local error in a callback, an aborted transport. Every survivor must throw
// within a bound of the fault (kFailsWithin), naming the culprit; inputs stay unchanged; the
// transport is aborted afterwards. Faults are triggered by message events, never by sleeps.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <set>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/transport/forwarding.h>
#include <pulseloco/transport/inproc/inproc.h>
#include <pulseloco/transport/native_collectives.h>
#include "rank_harness.h"

namespace pulseloco::collectives {
namespace {

using namespace std::chrono_literals;
using pulseloco::testing::caught_error;
using pulseloco::testing::describe;
using pulseloco::testing::pattern_bytes;
using pulseloco::testing::RankOutcome;
using pulseloco::testing::run_ranks;
using transport::Transport;
using transport::inproc::FaultAction;
using transport::inproc::FaultInjector;
using transport::inproc::MessageEvent;

constexpr std::chrono::milliseconds kTimeout = 1000ms;
constexpr std::chrono::milliseconds kFailsWithin = pulseloco::testing::fails_within(kTimeout);

// Data-phase messages (not headers or notices): the low byte of the tag is the phase, and
// phases 3..5 carry payload (collectives/detail/packets.h).
bool is_data(const MessageEvent& m) {
  const auto phase = m.tag & 0xFF;
  return phase >= 3 && phase <= 5;
}
bool is_notice(const MessageEvent& m) {
  return (m.tag & 0xFF) == 2;
}

// Acts on the `nth` (0-based) message of `rank` that `select` accepts.
transport::inproc::FaultHook at_message(int rank, int nth, FaultAction action,
                                        bool (*select)(const MessageEvent&) = is_data) {
  auto seen = std::make_shared<std::atomic<int>>(0);
  return [=](const MessageEvent& m) {
    if (m.from != rank || !select(m)) return FaultAction::deliver;
    return seen->fetch_add(1) == nth ? action : FaultAction::deliver;
  };
}

struct Group {
  std::shared_ptr<FaultInjector> faults = std::make_shared<FaultInjector>();
  std::vector<std::unique_ptr<Transport>> transports;
  explicit Group(int world)
      : transports(transport::inproc::make_group(world, {.faults = faults})) {}
};

transport::Clock::time_point fault_time(const FaultInjector& faults) {
  const auto injected = faults.injected();
  EXPECT_FALSE(injected.empty()) << "the fault was never injected";
  return injected.empty() ? transport::Clock::now() : injected.front().when;
}

// Every rank outside `exempt` threw a pulseloco::Error of `kind` naming `culprit`, within
// kFailsWithin of the fault.
void expect_survivors_blame(const std::vector<RankOutcome>& outcomes, int culprit, ErrorKind kind,
                            transport::Clock::time_point fault, const std::set<int>& exempt) {
  for (int rank = 0; rank < static_cast<int>(outcomes.size()); ++rank) {
    if (exempt.contains(rank)) continue;
    const RankOutcome& outcome = outcomes[static_cast<std::size_t>(rank)];
    const auto error = caught_error(outcome);
    ASSERT_TRUE(error) << "rank " << rank << ": " << describe(outcome);
    EXPECT_EQ(error->kind, kind) << "rank " << rank << ": " << error->what;
    EXPECT_EQ(error->context.peer, culprit) << "rank " << rank << ": " << error->what;
    EXPECT_EQ(error->context.rank, rank) << error->what;
    const auto took =
        std::chrono::duration_cast<std::chrono::milliseconds>(outcome.finished - fault);
    EXPECT_LE(took, kFailsWithin) << "rank " << rank << " took " << took.count()
                                  << " ms after the fault: " << error->what;
  }
}

CollectiveOptions options_with(CollectiveAlgorithm algorithm, std::size_t chunk) {
  return {.timeout = kTimeout, .algorithm = algorithm, .pipeline_chunk_bytes = chunk};
}

void all_gather(Transport& t, std::size_t bytes, const CollectiveOptions& options) {
  const auto mine = pattern_bytes(bytes, t.rank());
  (void)sparse_allgather(t, mine, options);
}

// ---------------------------------------------------------------------------------------------
// A rank killed mid-call

class KillDuringAllGather : public ::testing::TestWithParam<CollectiveAlgorithm> {};

TEST_P(KillDuringAllGather, SmallMessages) {
  Group group(4);
  group.faults->set_hook(at_message(2, 2, FaultAction::kill_sender));
  const auto outcomes = run_ranks(
      group.transports, [&](Transport& t) { all_gather(t, 100, options_with(GetParam(), 16)); });
  expect_survivors_blame(outcomes, 2, ErrorKind::peer_lost, fault_time(*group.faults), {2});
}

TEST_P(KillDuringAllGather, LargeMessages) {
  Group group(4);
  group.faults->set_hook([](const MessageEvent& m) {
    return m.from == 1 && is_data(m) && m.bytes_sent_before >= (std::size_t{8} << 20)
               ? FaultAction::kill_sender
               : FaultAction::deliver;
  });
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    all_gather(t, std::size_t{16} << 20, options_with(GetParam(), std::size_t{256} << 10));
  });
  expect_survivors_blame(outcomes, 1, ErrorKind::peer_lost, fault_time(*group.faults), {1});
}

INSTANTIATE_TEST_SUITE_P(Algorithms, KillDuringAllGather,
                         ::testing::Values(CollectiveAlgorithm::ring, CollectiveAlgorithm::direct),
                         [](const auto& param_info) {
                           return std::string(algorithm_name(param_info.param));
                         });

// Every rank sends every other rank 64 KiB in 4 KiB chunks.
void all_to_all(Transport& t, const CollectiveOptions& options) {
  std::vector<std::vector<std::byte>> mine;
  std::vector<std::span<const std::byte>> to_rank;
  for (int to = 0; to < t.size(); ++to)
    mine.push_back(pattern_bytes(std::size_t{64} << 10, t.rank(), static_cast<std::uint64_t>(to)));
  for (const auto& message : mine)
    to_rank.emplace_back(message);
  std::vector<std::vector<std::byte>> got(static_cast<std::size_t>(t.size()));
  sparse_alltoall(
      t, to_rank,
      [&](int from, std::size_t bytes) {
        got[static_cast<std::size_t>(from)].resize(bytes);
        return std::span<std::byte>(got[static_cast<std::size_t>(from)]);
      },
      options);
}

TEST(KillDuringAllToAll, FiveRanks) {
  Group group(5);
  group.faults->set_hook(at_message(2, 6, FaultAction::kill_sender));
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    all_to_all(t, options_with(CollectiveAlgorithm::automatic, 4096));
  });
  expect_survivors_blame(outcomes, 2, ErrorKind::peer_lost, fault_time(*group.faults), {2});
}

TEST(StallDuringAllToAll, FiveRanks) {
  Group group(5);
  group.faults->set_hook(at_message(3, 6, FaultAction::stall_sender));
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    all_to_all(t, options_with(CollectiveAlgorithm::automatic, 4096));
  });
  expect_survivors_blame(outcomes, 3, ErrorKind::timeout, fault_time(*group.faults), {3});
}

class KillDuringAllReduce : public ::testing::TestWithParam<CollectiveAlgorithm> {};

TEST_P(KillDuringAllReduce, FiveRanks) {
  Group group(5);
  group.faults->set_hook(at_message(3, 10, FaultAction::kill_sender));
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    const std::vector<float> input(std::size_t{1} << 20, 1.0F);
    std::vector<float> output(input.size());
    allreduce_sum(t, input, output, options_with(GetParam(), 64 << 10));
  });
  expect_survivors_blame(outcomes, 3, ErrorKind::peer_lost, fault_time(*group.faults), {3});
}

INSTANTIATE_TEST_SUITE_P(Algorithms, KillDuringAllReduce,
                         ::testing::Values(CollectiveAlgorithm::ring, CollectiveAlgorithm::direct),
                         [](const auto& param_info) {
                           return std::string(algorithm_name(param_info.param));
                         });

TEST(Kill, DuringBroadcastInTheMiddleOfTheChain) {
  Group group(4);
  group.faults->set_hook(at_message(2, 5, FaultAction::kill_sender));
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    auto data = pattern_bytes(std::size_t{4} << 20, 0);
    broadcast(t, 0, data, options_with(CollectiveAlgorithm::ring, 64 << 10));
  });
  expect_survivors_blame(outcomes, 2, ErrorKind::peer_lost, fault_time(*group.faults), {2});
}

TEST(Kill, BetweenItsDoneNoticesIsNamedByASurvivorThatFinishedTheCall) {
  // Rank 2 dies between its two `done` notices of a barrier: rank 0 has it and finishes the
  // call; rank 1 never gets it, fails naming rank 2 and closes its transport. Only then does
  // rank 0 start its next call, where both peers are gone: it must still name rank 2, the rank
  // lost first, not rank 1, which left only because of it.
  Group group(3);
  group.faults->set_hook([](const MessageEvent& m) {
    return m.from == 2 && m.to == 1 && is_notice(m) ? FaultAction::kill_sender
                                                    : FaultAction::deliver;
  });
  std::promise<void> rank1_failed;
  std::shared_future<void> rank1_has_failed = rank1_failed.get_future().share();
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    const CollectiveOptions options{.timeout = kTimeout};
    if (t.rank() == 1) {
      try {
        barrier(t, options);
      } catch (...) {
        rank1_failed.set_value();  // its transport is aborted by now
        throw;
      }
      return;
    }
    barrier(t, options);
    if (t.rank() != 0) return;
    ASSERT_EQ(rank1_has_failed.wait_for(60s), std::future_status::ready)
        << "rank 1 did not fail its barrier";
    barrier(t, options);
  });
  expect_survivors_blame(outcomes, 2, ErrorKind::peer_lost, fault_time(*group.faults), {2});
}

// ---------------------------------------------------------------------------------------------
// A rank stalled mid-call: its neighbours time out; the others, waiting on healthy ranks, must
// still name the stalled one.

class StallDuringAllGather : public ::testing::TestWithParam<CollectiveAlgorithm> {};

TEST_P(StallDuringAllGather, SevenRanks) {
  Group group(7);
  group.faults->set_hook(at_message(3, 5, FaultAction::stall_sender));
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    all_gather(t, std::size_t{64} << 10, options_with(GetParam(), 4096));
  });
  expect_survivors_blame(outcomes, 3, ErrorKind::timeout, fault_time(*group.faults), {3});
}

INSTANTIATE_TEST_SUITE_P(Algorithms, StallDuringAllGather,
                         ::testing::Values(CollectiveAlgorithm::ring, CollectiveAlgorithm::direct),
                         [](const auto& param_info) {
                           return std::string(algorithm_name(param_info.param));
                         });

class StallDuringAllReduce : public ::testing::TestWithParam<CollectiveAlgorithm> {};

TEST_P(StallDuringAllReduce, FourRanks) {
  Group group(4);
  group.faults->set_hook(at_message(1, 7, FaultAction::stall_sender));
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    const std::vector<float> input(std::size_t{1} << 18, 1.0F);
    std::vector<float> output(input.size());
    allreduce_sum(t, input, output, options_with(GetParam(), 16 << 10));
  });
  expect_survivors_blame(outcomes, 1, ErrorKind::timeout, fault_time(*group.faults), {1});
}

INSTANTIATE_TEST_SUITE_P(Algorithms, StallDuringAllReduce,
                         ::testing::Values(CollectiveAlgorithm::ring, CollectiveAlgorithm::direct),
                         [](const auto& param_info) {
                           return std::string(algorithm_name(param_info.param));
                         });

TEST(Stall, BeforeTheFirstMessage) {
  Group group(4);
  group.faults->set_hook([](const MessageEvent& m) {
    return m.from == 0 ? FaultAction::stall_sender : FaultAction::deliver;
  });
  const auto outcomes =
      run_ranks(group.transports, [&](Transport& t) { barrier(t, {.timeout = kTimeout}); });
  expect_survivors_blame(outcomes, 0, ErrorKind::timeout, fault_time(*group.faults), {0});
}

// The ring all-reduce sends its header to its right neighbour alone: a rank that stalls before
// sending anything is then noticed first by that neighbour, and by the others only through the
// chain of waits.
TEST(Stall, BeforeTheFirstMessageOfARingAllReduce) {
  for (const int stalled : {0, 2}) {
    SCOPED_TRACE(fmt::format("rank {} stalls", stalled));
    Group group(4);
    group.faults->set_hook([stalled](const MessageEvent& m) {
      return m.from == stalled ? FaultAction::stall_sender : FaultAction::deliver;
    });
    const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
      const std::vector<float> input(std::size_t{1} << 16, 1.0F);
      std::vector<float> output(input.size());
      allreduce_sum(t, input, output, options_with(CollectiveAlgorithm::ring, 16 << 10));
    });
    expect_survivors_blame(outcomes, stalled, ErrorKind::timeout, fault_time(*group.faults),
                           {stalled});
  }
}

TEST(Stall, InTheCompletionRound) {
  Group group(4);
  group.faults->set_hook(at_message(1, 0, FaultAction::stall_sender, is_notice));
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    all_gather(t, 1000, options_with(CollectiveAlgorithm::ring, 100));
  });
  expect_survivors_blame(outcomes, 1, ErrorKind::timeout, fault_time(*group.faults), {1});
}

// ---------------------------------------------------------------------------------------------
// Garbage, loss, local errors

TEST(Corruption, IsDetectedAndBlamedOnTheSender) {
  Group group(4);
  group.faults->set_hook(at_message(1, 1, FaultAction::corrupt));
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    all_gather(t, 1000, options_with(CollectiveAlgorithm::ring, 100));
  });
  expect_survivors_blame(outcomes, 1, ErrorKind::protocol, fault_time(*group.faults), {1});
  // The sender learns that a peer rejected its data.
  const auto sender = caught_error(outcomes[1]);
  ASSERT_TRUE(sender) << describe(outcomes[1]);
  EXPECT_EQ(sender->kind, ErrorKind::protocol) << sender->what;
  EXPECT_NE(sender->what.find("reports that this rank failed"), std::string::npos) << sender->what;
}

TEST(Loss, OfOneMessageFailsEveryRankInTime) {
  Group group(3);
  group.faults->set_hook([](const MessageEvent& m) {
    return m.from == 0 && m.to == 1 && is_data(m) && m.index < 100 ? FaultAction::drop
                                                                   : FaultAction::deliver;
  });
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    all_gather(t, 64, options_with(CollectiveAlgorithm::direct, 1024));
  });
  const auto fault = fault_time(*group.faults);
  for (int rank = 0; rank < 3; ++rank) {
    const auto error = caught_error(outcomes[static_cast<std::size_t>(rank)]);
    ASSERT_TRUE(error) << "rank " << rank << ": "
                       << describe(outcomes[static_cast<std::size_t>(rank)]);
    EXPECT_EQ(error->kind, ErrorKind::timeout) << error->what;
    // Either end of the broken link.
    EXPECT_TRUE(error->context.peer == 0 || error->context.peer == 1) << error->what;
    EXPECT_LE(outcomes[static_cast<std::size_t>(rank)].finished - fault, kFailsWithin)
        << error->what;
  }
}

TEST(LocalError, InACallbackFailsTheCallEverywhere) {
  Group group(4);
  transport::Clock::time_point thrown_at;
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    const auto mine = pattern_bytes(5000, t.rank());
    (void)sparse_allgather(t, mine, options_with(CollectiveAlgorithm::ring, 500),
                           [&](int rank, std::span<const std::byte>) {
                             if (t.rank() == 3 && rank != 3) {
                               thrown_at = transport::Clock::now();
                               throw std::runtime_error("decoder rejected the message");
                             }
                           });
  });
  try {
    std::rethrow_exception(outcomes[3].error);
  } catch (const std::runtime_error& error) {
    EXPECT_STREQ(error.what(), "decoder rejected the message");
  }
  expect_survivors_blame(outcomes, 3, ErrorKind::peer_lost, thrown_at, {3});
}

TEST(LocalError, AnAbortedTransportFailsItsRankAndItsPeersNameIt) {
  Group group(3);
  auto* victim = group.transports[1].get();
  auto aborted_at = std::make_shared<transport::Clock::time_point>();
  group.faults->set_hook([victim, aborted_at](const MessageEvent& m) {
    if (m.from == 0 && is_data(m) && m.index == 4) {
      *aborted_at = transport::Clock::now();  // only rank 0's thread writes it
      victim->abort("the engine gave up");
    }
    return FaultAction::deliver;
  });
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    all_gather(t, 1000, options_with(CollectiveAlgorithm::direct, 100));
  });
  const auto aborted = caught_error(outcomes[1]);
  ASSERT_TRUE(aborted) << describe(outcomes[1]);
  EXPECT_EQ(aborted->kind, ErrorKind::aborted);
  EXPECT_NE(aborted->what.find("aborted: the engine gave up"), std::string::npos) << aborted->what;
  expect_survivors_blame(outcomes, 1, ErrorKind::peer_lost, *aborted_at, {1});
}

// ---------------------------------------------------------------------------------------------
// What a failure leaves behind

TEST(AfterFailure, InputsAreUnchangedAndTheTransportIsAborted) {
  Group group(4);
  group.faults->set_hook(at_message(2, 3, FaultAction::kill_sender));
  std::atomic<int> intact{0};
  std::atomic<int> aborted_afterwards{0};
  const auto outcomes = run_ranks(group.transports, [&](Transport& t) {
    std::vector<float> input(100'000);
    for (std::size_t i = 0; i < input.size(); ++i) {
      input[i] = static_cast<float>(i) * 0.5F + static_cast<float>(t.rank());
    }
    const std::vector<float> before = input;
    std::vector<float> output(input.size());
    const auto mine = pattern_bytes(10'000, t.rank());
    const auto mine_before = mine;
    try {
      allreduce_sum(t, input, output, options_with(CollectiveAlgorithm::automatic, 4096));
    } catch (const Error&) {
      if (std::memcmp(before.data(), input.data(), input.size() * sizeof(float)) == 0) {
        intact.fetch_add(1);
      }
      try {
        barrier(t, {.timeout = kTimeout});
      } catch (const PeerLostError& error) {
        if (error.kind() == ErrorKind::aborted) aborted_afterwards.fetch_add(1);
      }
      throw;
    }
  });
  EXPECT_EQ(intact.load(), 4);
  EXPECT_EQ(aborted_afterwards.load(), 4);
  expect_survivors_blame(outcomes, 2, ErrorKind::peer_lost, fault_time(*group.faults), {2});
}

// ---------------------------------------------------------------------------------------------
// Native collectives (as the MPI backend offers): a failure inside one does not say which
// peer is missing, so the ranks find the one that says nothing.

// An in-process transport that also offers a native all-gather (plain sends and receives under
// a tag of its own), failing at its deadline without naming a peer, as MPI's does.
class NativeInproc final : public transport::ForwardingTransport,
                           public transport::NativeCollectives {
 public:
  static constexpr transport::Tag kTag = 77;
  explicit NativeInproc(std::unique_ptr<Transport> inner) : ForwardingTransport(std::move(inner)) {}
  [[nodiscard]] std::string_view backend() const noexcept override { return "native-inproc"; }

  bool allgatherv(std::span<const std::byte> mine, std::span<const std::uint64_t> counts,
                  std::span<std::byte> out, transport::Deadline deadline) override {
    ++native_calls;
    std::vector<std::unique_ptr<transport::Request>> requests;
    std::size_t offset = 0;
    for (int peer = 0; peer < size(); ++peer) {
      const auto count = static_cast<std::size_t>(counts[static_cast<std::size_t>(peer)]);
      if (peer == rank()) {
        std::copy(mine.begin(), mine.end(), out.begin() + static_cast<std::ptrdiff_t>(offset));
      } else {
        requests.push_back(inner().irecv(peer, kTag, out.subspan(offset, count)));
        requests.push_back(inner().isend(peer, kTag, mine));
      }
      offset += count;
    }
    for (auto& request : requests) {
      try {
        request->wait(deadline);
      } catch (const TimeoutError&) {
        throw TimeoutError("native allgatherv did not complete in time", {.rank = rank()});
      }
    }
    return true;
  }
  void broadcast(int, std::span<std::byte>, transport::Deadline) override {
    throw std::logic_error("not used");
  }
  void barrier(transport::Deadline) override { throw std::logic_error("not used"); }

  int native_calls = 0;
};

std::vector<std::unique_ptr<Transport>> native_group(int world,
                                                     std::shared_ptr<FaultInjector> faults) {
  auto inner = transport::inproc::make_group(world, {.faults = std::move(faults)});
  std::vector<std::unique_ptr<Transport>> group;
  for (auto& t : inner)
    group.push_back(std::make_unique<NativeInproc>(std::move(t)));
  return group;
}

TEST(Native, AllGatherRunsNativelyAndDeliversTheSameBytes) {
  auto group = native_group(3, nullptr);
  const auto outcomes = run_ranks(group, [](Transport& t) {
    const auto mine = pattern_bytes(1000 + static_cast<std::size_t>(t.rank()) * 7, t.rank());
    const auto all = sparse_allgather(t, mine, {.timeout = kTimeout});
    for (int rank = 0; rank < 3; ++rank) {
      if (all[static_cast<std::size_t>(rank)] !=
          pattern_bytes(1000 + static_cast<std::size_t>(rank) * 7, rank)) {
        throw std::runtime_error("native all-gather delivered other bytes");
      }
    }
    if (dynamic_cast<NativeInproc&>(t).native_calls != 1) {
      throw std::runtime_error("the native all-gather was not used");
    }
  });
  for (const auto& outcome : outcomes)
    EXPECT_FALSE(outcome.error) << describe(outcome);
}

TEST(Native, AStallInsideANativeCollectiveIsBlamedOnTheSilentRank) {
  auto faults = std::make_shared<FaultInjector>();
  faults->set_hook([](const MessageEvent& m) {
    return m.from == 2 && m.tag == NativeInproc::kTag ? FaultAction::stall_sender
                                                      : FaultAction::deliver;
  });
  auto group = native_group(4, faults);
  const auto outcomes = run_ranks(group, [](Transport& t) {
    const auto mine = pattern_bytes(5000, t.rank());
    (void)sparse_allgather(t, mine, {.timeout = kTimeout});
  });
  expect_survivors_blame(outcomes, 2, ErrorKind::timeout, fault_time(*faults), {2});
}

}  // namespace
}  // namespace pulseloco::collectives
