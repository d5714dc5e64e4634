// The in-process transport: message semantics, deadlines, abort, and every fault it injects.
#include <pulseloco/transport/inproc/inproc.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <pulseloco/base/errors.h>
#include "rank_harness.h"

namespace pulseloco::transport::inproc {
namespace {

using namespace std::chrono_literals;
using pulseloco::testing::pattern_bytes;

Deadline soon() {
  return deadline_after(5s);
}

TEST(Inproc, MessagesUnderOneTagArriveInOrderAndTagsAreIndependent) {
  auto group = make_group(2);
  const auto a = pattern_bytes(10, 1);
  const auto b = pattern_bytes(20, 2);
  const auto c = pattern_bytes(30, 3);
  group[0]->send(1, 7, a, soon());
  group[0]->send(1, 7, b, soon());
  group[0]->send(1, 8, c, soon());
  std::vector<std::byte> got_c(30);
  std::vector<std::byte> got_a(10);
  std::vector<std::byte> got_b(20);
  group[1]->recv(0, 8, got_c, soon());  // another tag does not wait behind tag 7
  group[1]->recv(0, 7, got_a, soon());
  group[1]->recv(0, 7, got_b, soon());
  EXPECT_EQ(got_a, a);
  EXPECT_EQ(got_b, b);
  EXPECT_EQ(got_c, c);
}

TEST(Inproc, PostedReceiveIsFilledBySend) {
  auto group = make_group(3);
  std::vector<std::byte> got(1000);
  auto receive = group[2]->irecv(0, 1, got);
  EXPECT_FALSE(receive->test());
  const auto sent = pattern_bytes(1000, 0);
  auto send = group[0]->isend(2, 1, sent);
  EXPECT_TRUE(send->test());  // eager
  receive->wait(soon());
  EXPECT_EQ(got, sent);
}

TEST(Inproc, ZeroByteMessagesWork) {
  auto group = make_group(2);
  std::vector<std::byte> none;
  auto receive = group[1]->irecv(0, 3, none);
  group[0]->send(1, 3, none, soon());
  receive->wait(soon());
  EXPECT_EQ(group[1]->stats().messages_received, 1U);
}

TEST(Inproc, SizeMismatchIsAProtocolErrorNamingTheSender) {
  auto group = make_group(2);
  const auto sent = pattern_bytes(9, 0);
  group[0]->send(1, 1, sent, soon());
  std::vector<std::byte> got(8);
  try {
    group[1]->recv(0, 1, got, soon());
    FAIL() << "a 9-byte message was accepted into an 8-byte receive";
  } catch (const ProtocolError& error) {
    EXPECT_EQ(error.context().peer, 0);
    EXPECT_EQ(error.context().rank, 1);
  }
}

TEST(Inproc, WaitTimeoutNamesThePeerAndLeavesTheReceivePending) {
  auto group = make_group(2);
  std::vector<std::byte> got(4);
  auto receive = group[1]->irecv(0, 5, got);
  try {
    receive->wait(deadline_after(20ms));
    FAIL() << "wait returned without a message";
  } catch (const TimeoutError& error) {
    EXPECT_EQ(error.context().peer, 0);
  }
  const auto sent = pattern_bytes(4, 9);
  group[0]->send(1, 5, sent, soon());
  receive->wait(soon());
  EXPECT_EQ(got, sent);
}

TEST(Inproc, AbortFailsPendingAndFutureOperationsAndPeersSeeTheConnectionClose) {
  auto group = make_group(3);
  std::vector<std::byte> got(4);
  auto pending = group[1]->irecv(0, 1, got);
  std::vector<std::byte> peer_got(4);
  auto peer_pending = group[2]->irecv(1, 1, peer_got);
  group[1]->abort("test says stop");
  try {
    pending->wait(soon());
    FAIL();
  } catch (const PeerLostError& error) {
    EXPECT_EQ(error.kind(), ErrorKind::aborted);
    EXPECT_EQ(error.message(), "test says stop");
  }
  EXPECT_THROW(group[1]->send(0, 1, got, soon()), PeerLostError);
  try {
    peer_pending->wait(soon());
    FAIL();
  } catch (const PeerLostError& error) {
    EXPECT_EQ(error.context().peer, 1);
    EXPECT_EQ(error.context().rank, 2);
  }
  // A send to the closed rank fails too.
  EXPECT_THROW(group[0]->send(1, 1, got, soon()), PeerLostError);
}

TEST(Inproc, DestroyingATransportClosesIt) {
  auto group = make_group(2);
  std::vector<std::byte> got(4);
  auto pending = group[1]->irecv(0, 1, got);
  group[0].reset();
  EXPECT_THROW(pending->wait(soon()), PeerLostError);
}

TEST(Inproc, MessagesSentBeforeAKillAreStillDelivered) {
  auto faults = std::make_shared<FaultInjector>();
  auto group = make_group(2, {.faults = faults});
  const auto sent = pattern_bytes(16, 0);
  group[0]->send(1, 1, sent, soon());
  faults->kill(0);
  std::vector<std::byte> got(16);
  group[1]->recv(0, 1, got, soon());
  EXPECT_EQ(got, sent);
  EXPECT_THROW(group[1]->recv(0, 1, got, soon()), PeerLostError);
  try {
    group[0]->send(1, 1, sent, soon());
    FAIL();
  } catch (const PeerLostError& error) {
    EXPECT_EQ(error.kind(), ErrorKind::aborted);
    EXPECT_EQ(error.message(), "killed by fault injection");
  }
  ASSERT_EQ(faults->injected().size(), 1U);
  EXPECT_EQ(faults->injected()[0].action, FaultAction::kill_sender);
}

TEST(Inproc, LostPeersAreListedInTheOrderTheyClosed) {
  auto faults = std::make_shared<FaultInjector>();
  auto group = make_group(5, {.faults = faults});
  faults->stall(4);
  faults->kill(3);
  group[1]->abort("failed after rank 3 was lost");
  group[2].reset();                          // closed without an abort: an orderly exit, not a loss
  group[4]->abort("aborted while stopped");  // still silent, not closed, for its peers
  EXPECT_EQ(group[0]->lost_peers(), (std::vector<int>{3, 1}));
  faults->kill(4);  // SIGKILL of the stopped rank closes its connections
  EXPECT_EQ(group[0]->lost_peers(), (std::vector<int>{3, 1, 4}));
  // Ranks that were closed when a peer went see nothing more.
  EXPECT_EQ(group[1]->lost_peers(), std::vector<int>{3});
}

TEST(Inproc, HookKillsTheSenderAtTheChosenMessage) {
  auto faults = std::make_shared<FaultInjector>();
  faults->set_hook([](const MessageEvent& m) {
    return m.from == 0 && m.index == 2 ? FaultAction::kill_sender : FaultAction::deliver;
  });
  auto group = make_group(2, {.faults = faults});
  std::vector<std::byte> got(1);
  auto pending_third = group[1]->irecv(0, 9, got);
  const auto one = pattern_bytes(1, 0);
  group[0]->send(1, 1, one, soon());
  group[0]->send(1, 2, one, soon());
  EXPECT_THROW(group[0]->send(1, 9, one, soon()), PeerLostError);
  EXPECT_THROW(pending_third->wait(soon()), PeerLostError);
  ASSERT_EQ(faults->injected().size(), 1U);
  EXPECT_EQ(faults->injected()[0].event->index, 2U);
  EXPECT_EQ(faults->injected()[0].event->bytes_sent_before, 2U);
}

TEST(Inproc, AStalledRankGoesSilentButKeepsItsConnectionsOpen) {
  auto faults = std::make_shared<FaultInjector>();
  auto group = make_group(2, {.faults = faults});
  faults->stall(0);
  const auto sent = pattern_bytes(8, 0);
  auto send = group[0]->isend(1, 1, sent);
  EXPECT_FALSE(send->test());
  EXPECT_THROW(send->wait(deadline_after(20ms)), TimeoutError);
  std::vector<std::byte> got(8);
  auto receive = group[1]->irecv(0, 1, got);
  EXPECT_THROW(receive->wait(deadline_after(20ms)), TimeoutError);
  // The peer can still send to it (a stopped process's kernel buffers the data)...
  group[1]->send(0, 2, sent, soon());
  // ...but the stalled rank receives nothing.
  auto stalled_receive = group[0]->irecv(1, 2, got);
  EXPECT_THROW(stalled_receive->wait(deadline_after(20ms)), TimeoutError);
  // Aborting a stalled rank fails its own operations, but its peers still see silence.
  group[0]->abort("test over");
  EXPECT_THROW(send->wait(soon()), PeerLostError);
  EXPECT_THROW(receive->wait(deadline_after(20ms)), TimeoutError);
  // A SIGKILL of the stopped rank closes its connections.
  faults->kill(0);
  EXPECT_THROW(receive->wait(soon()), PeerLostError);
}

TEST(Inproc, CorruptFramesFailTheirChecksumAndTheLinkStaysBroken) {
  auto faults = std::make_shared<FaultInjector>();
  faults->set_hook([](const MessageEvent& m) {
    return m.from == 0 && m.tag == 4 ? FaultAction::corrupt : FaultAction::deliver;
  });
  auto group = make_group(2, {.faults = faults});
  const auto sent = pattern_bytes(1000, 0);
  std::vector<std::byte> got(1000);
  auto posted = group[1]->irecv(0, 4, got);  // corrupted while copied into a posted buffer
  group[0]->send(1, 4, sent, soon());
  try {
    posted->wait(soon());
    FAIL();
  } catch (const ProtocolError& error) {
    EXPECT_EQ(error.context().peer, 0);
    EXPECT_NE(error.message().find("checksum"), std::string::npos);
  }
  group[0]->send(1, 5, sent, soon());
  EXPECT_THROW(group[1]->recv(0, 5, got, soon()), ProtocolError);
}

TEST(Inproc, CorruptionIsCaughtInQueuedAndEmptyMessagesToo) {
  auto faults = std::make_shared<FaultInjector>();
  faults->set_hook([](const MessageEvent&) { return FaultAction::corrupt; });
  auto group = make_group(3, {.faults = faults});
  const auto sent = pattern_bytes(100, 0);
  group[0]->send(1, 1, sent, soon());  // queued: nobody posted yet
  std::vector<std::byte> got(100);
  EXPECT_THROW(group[1]->recv(0, 1, got, soon()), ProtocolError);
  std::vector<std::byte> none;
  group[0]->send(2, 1, none, soon());
  EXPECT_THROW(group[2]->recv(0, 1, none, soon()), ProtocolError);
}

TEST(Inproc, DroppedMessagesNeverArrive) {
  auto faults = std::make_shared<FaultInjector>();
  faults->set_hook([](const MessageEvent& m) {
    return m.index == 0 ? FaultAction::drop : FaultAction::deliver;
  });
  auto group = make_group(2, {.faults = faults});
  const auto first = pattern_bytes(4, 1);
  const auto second = pattern_bytes(4, 2);
  group[0]->send(1, 1, first, soon());  // completes although it is lost
  group[0]->send(1, 1, second, soon());
  std::vector<std::byte> got(4);
  group[1]->recv(0, 1, got, soon());
  EXPECT_EQ(got, second);
  EXPECT_THROW(group[1]->recv(0, 1, got, deadline_after(20ms)), TimeoutError);
}

TEST(Inproc, WithdrawnReceivesAreNotWrittenAndTheMessageWaitsForTheNextOne) {
  auto group = make_group(2);
  const auto sent = pattern_bytes(64, 0);
  {
    std::vector<std::byte> abandoned(64, std::byte{0});
    auto receive = group[1]->irecv(0, 1, abandoned);
    receive.reset();
    group[0]->send(1, 1, sent, soon());
    EXPECT_EQ(abandoned, std::vector<std::byte>(64, std::byte{0}));
  }
  std::vector<std::byte> got(64);
  group[1]->recv(0, 1, got, soon());
  EXPECT_EQ(got, sent);
}

TEST(Inproc, StatsCountPayloadAndFraming) {
  auto group = make_group(2, {.header_bytes = 32});
  const auto sent = pattern_bytes(100, 0);
  group[0]->send(1, 1, sent, soon());
  std::vector<std::byte> got(100);
  group[1]->recv(0, 1, got, soon());
  const TransportStats s = group[0]->stats();
  EXPECT_EQ(s.payload_bytes_sent, 100U);
  EXPECT_EQ(s.wire_bytes_sent, 132U);
  EXPECT_EQ(s.messages_sent, 1U);
  const TransportStats r = group[1]->stats();
  EXPECT_EQ(r.payload_bytes_received, 100U);
  EXPECT_EQ(r.wire_bytes_received, 132U);
  EXPECT_EQ(r.messages_received, 1U);
  EXPECT_EQ(group[0]->backend(), "inproc");
}

TEST(Inproc, InvalidPeersAreRejected) {
  auto group = make_group(2);
  std::vector<std::byte> got(1);
  EXPECT_THROW((void)group[0]->irecv(0, 1, got), InvalidArgument);
  EXPECT_THROW((void)group[0]->irecv(2, 1, got), InvalidArgument);
  EXPECT_THROW((void)group[0]->isend(-1, 1, got), InvalidArgument);
  EXPECT_THROW((void)make_group(0), InvalidArgument);
  auto faults = std::make_shared<FaultInjector>();
  EXPECT_THROW(faults->kill(0), InvalidArgument);  // not attached yet
  auto attached = make_group(2, {.faults = faults});
  EXPECT_THROW(faults->kill(2), InvalidArgument);
  EXPECT_THROW((void)make_group(2, {.faults = faults}), InvalidArgument);
}

TEST(Inproc, ConcurrentRanksExchangeIntactMessages) {
  constexpr int kWorld = 4;
  constexpr int kRounds = 200;
  auto group = make_group(kWorld);
  const auto outcomes = pulseloco::testing::run_ranks(group, [](Transport& t) {
    const int r = t.rank();
    for (int round = 0; round < kRounds; ++round) {
      std::vector<std::vector<std::byte>> got(kWorld);
      std::vector<std::unique_ptr<Request>> requests;
      for (int p = 0; p < kWorld; ++p) {
        if (p == r) continue;
        got[static_cast<std::size_t>(p)].resize(static_cast<std::size_t>(round + p));
        requests.push_back(t.irecv(p, static_cast<Tag>(round), got[static_cast<std::size_t>(p)]));
      }
      const auto mine =
          pattern_bytes(static_cast<std::size_t>(round + r), r, static_cast<std::uint64_t>(round));
      for (int p = 0; p < kWorld; ++p) {
        if (p != r) requests.push_back(t.isend(p, static_cast<Tag>(round), mine));
      }
      for (auto& request : requests)
        request->wait(deadline_after(10s));
      for (int p = 0; p < kWorld; ++p) {
        if (p == r) continue;
        if (got[static_cast<std::size_t>(p)] != pattern_bytes(static_cast<std::size_t>(round + p),
                                                              p,
                                                              static_cast<std::uint64_t>(round))) {
          throw std::runtime_error("corrupted message");
        }
      }
    }
  });
  for (const auto& outcome : outcomes) {
    EXPECT_FALSE(outcome.error) << pulseloco::testing::describe(outcome);
  }
}

}  // namespace
}  // namespace pulseloco::transport::inproc
