// The TCP transport with in-process ranks on loopback (one thread and one transport per rank).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <tuple>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/tcp/frame.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/lane.h>
#include "base/log_capture.h"
#include "transport/loopback_group.h"

namespace pulseloco::transport {
namespace {

using namespace std::chrono_literals;
using group::TransportOptions;
using testing::conformance_link_securities;
using testing::link_name;
using testing::make_loopback_group;
using testing::payload;
using testing::run_parallel;
using testing::secured;

constexpr auto kTimeout = 60s;

// The message rank `src` sends to rank `dst` in the all-pairs tests: a different size for every
// pair, including 0 and 1 byte and odd sizes.
std::size_t pair_size(int src, int dst) {
  static constexpr std::size_t kSizes[] = {0, 1, 7, 4093, 65537, 1'000'003, 3, 131'071};
  return kSizes[static_cast<std::size_t>(src * 3 + dst) % std::size(kSizes)];
}

std::uint64_t pair_seed(int src, int dst, int round = 0) {
  return static_cast<std::uint64_t>(src) * 1000003 + static_cast<std::uint64_t>(dst) * 1009 +
         static_cast<std::uint64_t>(round);
}

// Every rank sends a distinct message to every other rank and checks what it receives.
void exchange_all_pairs(std::vector<std::unique_ptr<TcpTransport>>& group, int rounds = 1) {
  const int n = static_cast<int>(group.size());
  run_parallel(n, [&](int rank) {
    auto& t = *group[static_cast<std::size_t>(rank)];
    for (int round = 0; round < rounds; ++round) {
      std::vector<std::vector<std::byte>> outgoing(static_cast<std::size_t>(n));
      std::vector<std::vector<std::byte>> incoming(static_cast<std::size_t>(n));
      std::vector<std::unique_ptr<Request>> requests;
      for (int peer = 0; peer < n; ++peer) {
        const auto p = static_cast<std::size_t>(peer);
        incoming[p].resize(pair_size(peer, rank));
        requests.push_back(t.irecv(peer, 7, incoming[p]));
      }
      for (int peer = 0; peer < n; ++peer) {
        const auto p = static_cast<std::size_t>(peer);
        outgoing[p] = payload(pair_seed(rank, peer, round), pair_size(rank, peer));
        requests.push_back(t.isend(peer, 7, outgoing[p]));
      }
      for (auto& request : requests)
        request->wait(deadline_after(kTimeout));
      for (int peer = 0; peer < n; ++peer)
        ASSERT_EQ(incoming[static_cast<std::size_t>(peer)],
                  payload(pair_seed(peer, rank, round), pair_size(peer, rank)))
            << "rank " << rank << " from " << peer << " round " << round;
    }
  });
}

// World size and link security.
class WorldSize : public ::testing::TestWithParam<std::tuple<int, LinkSecurity>> {};

TEST_P(WorldSize, EveryPairExchangesDistinctMessagesOfEverySize) {
  const auto [size, security] = GetParam();
  auto group = make_loopback_group(size, secured(security));
  for (int rank = 0; rank < size; ++rank) {
    EXPECT_EQ(group[static_cast<std::size_t>(rank)]->rank(), rank);
    EXPECT_EQ(group[static_cast<std::size_t>(rank)]->size(), size);
    EXPECT_EQ(group[static_cast<std::size_t>(rank)]->backend(), "tcp");
  }
  exchange_all_pairs(group, 3);
}

INSTANTIATE_TEST_SUITE_P(Loopback, WorldSize,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 7),
                                            ::testing::ValuesIn(conformance_link_securities())),
                         [](const auto& param_info) {
                           return std::to_string(std::get<0>(param_info.param)) +
                                  link_name(std::get<1>(param_info.param));
                         });

// The tests that exercise what encryption could disturb (large striped messages, paused
// connections, goodbye and abort frames, byte accounting) run over every link security.
class OverLinks : public ::testing::TestWithParam<LinkSecurity> {};

INSTANTIATE_TEST_SUITE_P(TcpTransport, OverLinks,
                         ::testing::ValuesIn(conformance_link_securities()),
                         [](const auto& param_info) { return link_name(param_info.param); });

// The default polls before sleeping (busy_poll); without it every wait sleeps at once. Both must
// deliver the same.
TEST(TcpTransport, WithoutBusyPollingEveryPairExchanges) {
  TransportOptions options;
  options.tcp.busy_poll = std::chrono::microseconds(0);
  auto group = make_loopback_group(4, options);
  exchange_all_pairs(group, 3);
}

// After a caller's wait the I/O threads stay out of the io_context for a moment (the caller is
// likely back soon); a send nobody waits for must still go out once they are back.
TEST(TcpTransport, ASendNobodyWaitsForGoesOutAfterTheCallerLeft) {
  auto group = make_loopback_group(2);
  const auto ping = payload(1, 10);
  std::vector<std::byte> pong(ping.size());
  auto ping_recv = group[1]->irecv(0, 1, pong);
  group[0]->send(1, 1, ping, deadline_after(kTimeout));  // rank 0's caller drove just now
  ping_recv->wait(deadline_after(kTimeout));
  // Larger than the socket buffers: it takes many writes, which rank 0's caller does not run.
  const auto big = payload(2, std::size_t{24} << 20);
  auto unwaited = group[0]->isend(1, 2, big);
  std::vector<std::byte> got(big.size());
  group[1]->recv(0, 2, got, deadline_after(kTimeout));
  EXPECT_EQ(got, big);
  // The sender marks the send done in its write handler on an I/O thread, which may run after
  // the receiver already has every byte.
  EXPECT_NO_THROW(unwaited->wait(deadline_after(kTimeout)));
  EXPECT_TRUE(unwaited->test());
}

TEST(TcpTransport, SeveralIoThreadsPerTransport) {
  TransportOptions options;
  options.tcp.io_threads = 3;
  options.tcp.connections_per_peer = 3;
  options.tcp.stripe_threshold_bytes = 64 * 1024;
  options.tcp.stripe_chunk_bytes = 64 * 1024;
  auto group = make_loopback_group(4, options);
  exchange_all_pairs(group, 4);
}

TEST(TcpTransport, GroupOfOneWithoutRendezvous) {
  TransportOptions options;
  options.world_size = 1;
  auto transport = group::make_transport(options);
  EXPECT_EQ(transport->size(), 1);
  const auto message = payload(1, 1000);
  std::vector<std::byte> received(1000);
  auto recv = transport->irecv(0, 3, received);
  transport->send(0, 3, message, deadline_after(kTimeout));
  recv->wait(deadline_after(kTimeout));
  EXPECT_EQ(received, message);
}

TEST_P(OverLinks, SixtyFourMebibytesStripedOverFourConnections) {
  TransportOptions options = secured(GetParam());
  options.tcp.connections_per_peer = 4;
  auto group = make_loopback_group(3, options);
  constexpr std::size_t kBytes = std::size_t{64} << 20;
  run_parallel(3, [&](int rank) {
    auto& t = *group[static_cast<std::size_t>(rank)];
    const auto mine = payload(static_cast<std::uint64_t>(rank) + 100, kBytes + 17 * rank);
    std::vector<std::vector<std::byte>> theirs(3);
    std::vector<std::unique_ptr<Request>> requests;
    for (int peer = 0; peer < 3; ++peer) {
      if (peer == rank) continue;
      theirs[static_cast<std::size_t>(peer)].resize(kBytes + 17 * static_cast<std::size_t>(peer));
      requests.push_back(t.irecv(peer, 1, theirs[static_cast<std::size_t>(peer)]));
      requests.push_back(t.isend(peer, 1, mine));
    }
    for (auto& request : requests)
      request->wait(deadline_after(kTimeout));
    for (int peer = 0; peer < 3; ++peer) {
      if (peer == rank) continue;
      ASSERT_TRUE(theirs[static_cast<std::size_t>(peer)] ==
                  payload(static_cast<std::uint64_t>(peer) + 100,
                          kBytes + 17 * static_cast<std::size_t>(peer)));
    }
    // The message went as chunks over every connection.
    const auto plan = tcp::plan_chunks(kBytes, 4, options.tcp.stripe_threshold_bytes,
                                       options.tcp.stripe_chunk_bytes);
    EXPECT_GE(plan.count, 4U);
  });
}

TEST(TcpTransport, EqualTagsArriveInOrderAndTagsInterleave) {
  auto group = make_loopback_group(2);
  constexpr int kTags = 9;
  constexpr int kPerTag = 40;
  run_parallel(2, [&](int rank) {
    auto& t = *group[static_cast<std::size_t>(rank)];
    if (rank == 0) {
      // Round-robin over tags, sizes varying so that large and small messages mix.
      std::vector<std::vector<std::byte>> messages;
      std::vector<std::unique_ptr<Request>> sends;
      messages.reserve(kTags * kPerTag);
      for (int i = 0; i < kPerTag; ++i)
        for (int tag = 0; tag < kTags; ++tag) {
          messages.push_back(payload(static_cast<std::uint64_t>(tag * 1000 + i),
                                     static_cast<std::size_t>((i * 7919 + tag * 104729) % 300000)));
          sends.push_back(t.isend(1, static_cast<Tag>(tag) << 40, messages.back()));
        }
      for (auto& send : sends)
        send->wait(deadline_after(kTimeout));
    } else {
      // Receives posted tag by tag (the reverse of the sending order), partly after arrival.
      std::map<std::pair<int, int>, std::vector<std::byte>> buffers;
      std::vector<std::pair<std::pair<int, int>, std::unique_ptr<Request>>> recvs;
      for (int tag = kTags - 1; tag >= 0; --tag)
        for (int i = 0; i < kPerTag; ++i) {
          auto& buffer = buffers[{tag, i}];
          buffer.resize(static_cast<std::size_t>((i * 7919 + tag * 104729) % 300000));
          recvs.emplace_back(std::pair{tag, i}, t.irecv(0, static_cast<Tag>(tag) << 40, buffer));
        }
      for (auto& [key, request] : recvs)
        request->wait(deadline_after(kTimeout));
      for (const auto& [key, buffer] : buffers)
        ASSERT_EQ(buffer,
                  payload(static_cast<std::uint64_t>(key.first * 1000 + key.second), buffer.size()))
            << "tag " << key.first << " message " << key.second;
    }
  });
}

TEST(TcpTransport, MessagesThatArriveBeforeTheirReceiveAreKept) {
  auto group = make_loopback_group(2);
  const auto small = payload(1, 100);
  const auto large = payload(2, 5'000'000);
  // Everything is sent and delivered to rank 1's transport before any receive is posted.
  group[0]->send(1, 5, small, deadline_after(kTimeout));
  group[0]->send(1, 5, large, deadline_after(kTimeout));
  group[0]->send(1, 6, {}, deadline_after(kTimeout));
  // The sender's end completes when the kernel has the bytes; a receive of a message behind them
  // proves that rank 1 read them all.
  const auto marker = payload(3, 10);
  group[0]->send(1, 99, marker, deadline_after(kTimeout));
  std::vector<std::byte> got_marker(10);
  group[1]->recv(0, 99, got_marker, deadline_after(kTimeout));
  EXPECT_EQ(group[1]->unexpected_bytes(), small.size() + large.size());

  std::vector<std::byte> got_empty;
  std::vector<std::byte> got_small(100);
  std::vector<std::byte> got_large(large.size());
  group[1]->recv(0, 6, got_empty, deadline_after(kTimeout));
  group[1]->recv(0, 5, got_small, deadline_after(kTimeout));
  group[1]->recv(0, 5, got_large, deadline_after(kTimeout));
  EXPECT_EQ(got_small, small);
  EXPECT_EQ(got_large, large);
  EXPECT_EQ(group[1]->unexpected_bytes(), 0U);
}

TEST(TcpTransport, AFrameWhoseReceiveIsPostedIsCopiedOnlyAtItsEdges) {
  // The kernel writes a frame's payload straight into a posted receive's buffer, except what
  // arrives in the staging buffer: a frame's header with at most 16 KiB of its payload, and a
  // tail shorter than 16 KiB. (The staging buffer holds 64 KiB; a read that filled it whole
  // would take up to that much of every frame's payload, to be copied out again.)
  TransportOptions options;
  options.tcp.connections_per_peer = 1;
  auto group = make_loopback_group(2, options);
  constexpr int kMessages = 64;
  constexpr std::size_t kBytes = std::size_t{256} << 10;  // one frame each: below striping
  // 16 KiB, and the bytes of a header that may have been read before with the frame before.
  constexpr std::uint64_t kEdgeBytes = (16 << 10) + tcp::kFrameHeaderBytes;
  const auto message = payload(7, kBytes);
  std::vector<std::vector<std::byte>> got(kMessages, std::vector<std::byte>(kBytes));
  std::vector<std::unique_ptr<Request>> receives;
  for (auto& buffer : got)
    receives.push_back(group[1]->irecv(0, 7, buffer));
  std::vector<std::unique_ptr<Request>> sends;
  for (int i = 0; i < kMessages; ++i)
    sends.push_back(group[0]->isend(1, 7, message));
  for (auto& send : sends)
    send->wait(deadline_after(kTimeout));
  for (auto& receive : receives)
    receive->wait(deadline_after(kTimeout));
  for (const auto& buffer : got)
    ASSERT_EQ(buffer, message);
  EXPECT_LE(group[1]->payload_bytes_copied(), kMessages * 2 * kEdgeBytes);
}

// Rank 0 sends a message of `bytes` three times over `connections` connections, striped above
// `stripe_threshold` into chunks of at most `stripe_chunk`, with its writes held after the first
// kEarlyBytes (a test hook); rank 1 posts the receive once the message has started arriving (its
// early-arrival memory is in use), and only then are rank 0's writes released. So the receive is
// posted while at most kEarlyBytes of the message are in, and the rest must go straight into the
// receive's buffer: rank 1 copies at most the early bytes, plus what a read already in flight
// into early memory took (one per connection), plus each frame's edges that pass through the
// staging buffer (a header with up to 16 KiB of payload, and a tail shorter than 16 KiB); an
// early byte that came through the staging buffer is counted twice (payload_bytes_copied()).
void receive_while_arriving(int connections, std::size_t stripe_threshold, std::size_t stripe_chunk,
                            std::size_t bytes, std::uint64_t seed) {
  constexpr std::uint64_t kEarlyBytes = std::uint64_t{1} << 20;
  constexpr std::uint64_t kEdgeBytes = tcp::Lane::kDirectReadBytes + tcp::kFrameHeaderBytes;
  TransportOptions options;
  options.tcp.connections_per_peer = connections;
  options.tcp.stripe_threshold_bytes = stripe_threshold;
  options.tcp.stripe_chunk_bytes = stripe_chunk;
  auto group = make_loopback_group(2, options);
  const std::uint64_t frames =
      tcp::plan_chunks(bytes, connections, stripe_threshold, stripe_chunk).count;
  const std::uint64_t bound =
      kEarlyBytes + static_cast<std::uint64_t>(connections) * tcp::Lane::kDirectReadMaxBytes +
      frames * 2 * kEdgeBytes + 2 * kEdgeBytes * static_cast<std::uint64_t>(connections);
  ASSERT_LT(bound, bytes / 4) << "the message is too small to show anything";
  for (int round = 0; round < 3; ++round) {
    const auto message = payload(seed + static_cast<std::uint64_t>(round), bytes);
    const std::uint64_t copied_before = group[1]->payload_bytes_copied();
    group[0]->hold_sends_after(kEarlyBytes);
    auto send = group[0]->isend(1, 1, message);
    const auto give_up = Clock::now() + kTimeout;
    while (group[1]->unexpected_bytes() == 0 && Clock::now() < give_up)
      std::this_thread::yield();
    ASSERT_GT(group[1]->unexpected_bytes(), 0U) << "round " << round << ": nothing arrived early";
    std::vector<std::byte> got(message.size());
    auto receive = group[1]->irecv(0, 1, got);
    group[0]->release_sends();
    receive->wait(deadline_after(kTimeout));
    send->wait(deadline_after(kTimeout));
    ASSERT_EQ(got, message) << "round " << round;
    EXPECT_EQ(group[1]->unexpected_bytes(), 0U);
    EXPECT_LE(group[1]->payload_bytes_copied() - copied_before, bound) << "round " << round;
  }
}

TEST(TcpTransport, AReceivePostedWhileItsMessageArrivesTakesTheRestDirectly) {
  // A striped message (1 MiB chunks over 2 connections): the chunks still to come go straight
  // into the caller's buffer and only the early ones are copied.
  receive_while_arriving(2, 1U << 20, 1U << 20, (16U << 20) + 5, 0);
}

TEST(TcpTransport, AReceivePostedWhileAOneFrameMessageArrivesTakesTheRestOfTheFrame) {
  // A message that travels as one frame (below the striping threshold): the rest of the frame
  // is read straight into the receive's buffer and only the part that arrived before is copied
  // (the all-gather sends its first step before its receiver knows the size). The copy and the
  // direct part must join up exactly.
  receive_while_arriving(1, 64U << 20, 64U << 20, (16U << 20) + 3, 10);
}

TEST_P(OverLinks, EarlyMessagesBeyondTheCapWaitInTheSocketUntilReceived) {
  TransportOptions options = secured(GetParam());
  options.tcp.connections_per_peer = 1;
  options.tcp.max_unexpected_bytes = std::size_t{4} << 20;
  options.tcp.socket_send_buffer_bytes = 64 * 1024;
  options.tcp.socket_receive_buffer_bytes = 64 * 1024;
  auto group = make_loopback_group(2, options);
  constexpr std::size_t kBytes = std::size_t{4} << 20;
  std::vector<std::vector<std::byte>> messages;
  std::vector<std::unique_ptr<Request>> sends;
  for (int i = 0; i < 4; ++i) {
    messages.push_back(payload(static_cast<std::uint64_t>(i), kBytes));
    sends.push_back(group[0]->isend(1, 1, messages.back()));
  }
  // The first message fills the cap; the second waits in the paused connection, the kernel
  // buffers (about 0.5 MiB) hold a little more, so the last send cannot complete.
  sends[0]->wait(deadline_after(kTimeout));
  EXPECT_THROW(sends[3]->wait(deadline_after(300ms)), TimeoutError);
  EXPECT_LE(group[1]->unexpected_bytes(), options.tcp.max_unexpected_bytes);
  for (int i = 0; i < 4; ++i) {
    std::vector<std::byte> got(kBytes);
    group[1]->recv(0, 1, got, deadline_after(kTimeout));
    EXPECT_LE(group[1]->unexpected_bytes(), options.tcp.max_unexpected_bytes);
    ASSERT_EQ(got, messages[static_cast<std::size_t>(i)]) << "message " << i;
  }
  for (auto& send : sends)
    send->wait(deadline_after(kTimeout));
}

TEST(TcpTransport, SizeMismatchFailsThatReceiveOnly) {
  auto group = make_loopback_group(2);
  const auto ten = payload(1, 10);
  const auto after = payload(2, 33);
  group[0]->send(1, 4, ten, deadline_after(kTimeout));
  group[0]->send(1, 4, after, deadline_after(kTimeout));
  std::vector<std::byte> eight(8);
  try {
    group[1]->recv(0, 4, eight, deadline_after(kTimeout));
    FAIL() << "a 10-byte message into an 8-byte receive must fail";
  } catch (const ProtocolError& error) {
    EXPECT_EQ(error.context().peer, 0);
    EXPECT_NE(std::string(error.what()).find("sent 10 bytes"), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("expects 8 bytes"), std::string::npos);
  }
  std::vector<std::byte> next(33);
  group[1]->recv(0, 4, next, deadline_after(kTimeout));
  EXPECT_EQ(next, after);
  // A receive posted before a mismatched message arrives fails the same way.
  std::vector<std::byte> small(5);
  auto posted = group[1]->irecv(0, 8, small);
  group[0]->send(1, 8, ten, deadline_after(kTimeout));
  EXPECT_THROW(posted->wait(deadline_after(kTimeout)), ProtocolError);
}

TEST(TcpTransport, ReceiveTimesOutAtItsDeadlineNamingThePeer) {
  auto group = make_loopback_group(3);
  std::vector<std::byte> buffer(16);
  auto request = group[0]->irecv(2, 1, buffer);
  constexpr auto kDeadline = 500ms;
  const auto start = Clock::now();
  try {
    request->wait(deadline_after(kDeadline));
    FAIL() << "nothing was sent";
  } catch (const TimeoutError& error) {
    const auto elapsed = Clock::now() - start;
    EXPECT_GE(elapsed, kDeadline);
    // The wait ends at its own deadline rather than hanging; the slack absorbs a loaded machine.
    EXPECT_LT(elapsed, kDeadline + 10s);
    EXPECT_EQ(error.context().peer, 2);
    EXPECT_EQ(error.context().rank, 0);
    EXPECT_NE(std::string(error.what()).find("receive from peer 2"), std::string::npos);
  }
  EXPECT_FALSE(request->test());
}

TEST_P(OverLinks, AbortFailsPendingAndFutureOperationsAndTellsThePeers) {
  auto group = make_loopback_group(3, secured(GetParam()));
  std::vector<std::byte> buffer(16);
  auto pending = group[0]->irecv(1, 1, buffer);
  auto remote_pending = group[2]->irecv(0, 1, buffer);
  group[0]->abort("test says stop");
  try {
    pending->wait(deadline_after(kTimeout));
    FAIL();
  } catch (const PeerLostError& error) {
    EXPECT_NE(std::string(error.what()).find("aborted: test says stop"), std::string::npos);
  }
  EXPECT_THROW(group[0]->isend(1, 1, buffer)->wait(deadline_after(kTimeout)), PeerLostError);
  // Rank 2 learns that rank 0 aborted, and why.
  try {
    remote_pending->wait(deadline_after(kTimeout));
    FAIL();
  } catch (const PeerLostError& error) {
    EXPECT_EQ(error.context().peer, 0);
    EXPECT_NE(std::string(error.what()).find("test says stop"), std::string::npos) << error.what();
  }
  // Ranks 1 and 2 still talk to each other.
  const auto message = payload(5, 1234);
  std::vector<std::byte> got(1234);
  auto recv = group[2]->irecv(1, 2, got);
  group[1]->send(2, 2, message, deadline_after(kTimeout));
  recv->wait(deadline_after(kTimeout));
  EXPECT_EQ(got, message);
}

TEST_P(OverLinks, APeerThatClosesLeavesItsSentMessagesReceivable) {
  auto group = make_loopback_group(2, secured(GetParam()));
  const auto last_words = payload(8, 3'000'000);
  group[1]->send(0, 9, last_words, deadline_after(kTimeout));
  group[1].reset();  // says goodbye, waits until rank 0 has read everything
  std::vector<std::byte> got(last_words.size());
  group[0]->recv(1, 9, got, deadline_after(kTimeout));
  EXPECT_EQ(got, last_words);
  std::vector<std::byte> more(1);
  try {
    group[0]->recv(1, 9, more, deadline_after(kTimeout));
    FAIL();
  } catch (const PeerLostError& error) {
    EXPECT_EQ(error.context().peer, 1);
    EXPECT_NE(std::string(error.what()).find("closed its transport"), std::string::npos);
  }
}

TEST(TcpTransport, LostPeersAreListedInTheOrderTheirConnectionsFailed) {
  auto group = make_loopback_group(4);
  std::vector<std::byte> first(1);
  std::vector<std::byte> second(1);
  std::vector<std::byte> third(1);
  auto from_3 = group[0]->irecv(3, 1, first);
  auto from_1 = group[0]->irecv(1, 1, second);
  auto from_2 = group[0]->irecv(2, 1, third);
  group[3]->abort("lost first");
  EXPECT_THROW(from_3->wait(deadline_after(kTimeout)), PeerLostError);
  group[1]->abort("lost second");
  EXPECT_THROW(from_1->wait(deadline_after(kTimeout)), PeerLostError);
  group[2].reset();  // says goodbye: an orderly exit, not a loss
  EXPECT_THROW(from_2->wait(deadline_after(kTimeout)), PeerLostError);
  EXPECT_EQ(group[0]->lost_peers(), (std::vector<int>{3, 1}));
}

TEST(TcpTransport, DestroyingTheTransportFailsItsPendingRequests) {
  auto group = make_loopback_group(2);
  std::vector<std::byte> buffer(4);
  auto pending = group[0]->irecv(1, 1, buffer);
  group[0].reset();
  EXPECT_THROW(pending->wait(deadline_after(kTimeout)), PeerLostError);
}

std::string corruption_name(FrameCorruption target) {
  return target == FrameCorruption::payload ? "payload" : "header";
}

}  // namespace

// How gtest prints the parameter of the Corruption tests.
void PrintTo(FrameCorruption target, std::ostream* out) {
  *out << corruption_name(target);
}

namespace {

class Corruption : public ::testing::TestWithParam<FrameCorruption> {};

TEST_P(Corruption, IsDetectedAndNamesThePeer) {
  TransportOptions options;
  options.tcp.connections_per_peer = 2;
  auto group = make_loopback_group(2, options);
  const auto good = payload(1, 50'000);
  std::vector<std::byte> received(good.size());
  group[0]->send(1, 1, good, deadline_after(kTimeout));
  group[1]->recv(0, 1, received, deadline_after(kTimeout));
  ASSERT_EQ(received, good);

  group[0]->corrupt_outgoing_frame(CorruptFrame{0, GetParam()});
  auto recv = group[1]->irecv(0, 2, received);
  group[0]->send(1, 2, good, deadline_after(kTimeout));
  try {
    recv->wait(deadline_after(kTimeout));
    FAIL() << "corruption went unnoticed";
  } catch (const ProtocolError& error) {
    EXPECT_EQ(error.context().peer, 0);
    const std::string expected = GetParam() == FrameCorruption::payload
                                     ? "payload checksum mismatch"
                                     : "frame header checksum mismatch";
    EXPECT_NE(std::string(error.what()).find(expected), std::string::npos) << error.what();
  }
  // Rank 1 dropped its connections to rank 0, which therefore loses rank 1.
  std::vector<std::byte> nothing(1);
  try {
    group[0]->recv(1, 3, nothing, deadline_after(kTimeout));
    FAIL();
  } catch (const PeerLostError& error) {
    EXPECT_EQ(error.context().peer, 1);
  }
}

INSTANTIATE_TEST_SUITE_P(TcpTransport, Corruption,
                         ::testing::Values(FrameCorruption::payload, FrameCorruption::header),
                         [](const auto& param_info) { return corruption_name(param_info.param); });

// The checksum-reuse tests send a message striped in several frames over two connections.
TransportOptions striped_over_two_connections() {
  TransportOptions options;
  options.tcp.connections_per_peer = 2;
  options.tcp.stripe_threshold_bytes = 64 << 10;
  options.tcp.stripe_chunk_bytes = 64 << 10;
  return options;
}

constexpr Tag kStaleTag = 3;
constexpr Tag kAckTag = 9;

// On the sender of a message with stale checksums: waits until `receiver` confirms that it
// holds everything sent to it before (its rejection of the stale message ends the connections,
// which must not cut off earlier frames), then sends it. That send's wait may fail for the same
// reason.
void send_stale_after_ack(Transport& t, int receiver,
                          const std::function<std::unique_ptr<Request>()>& send_stale) {
  std::array<std::byte, 1> ack{};
  t.recv(receiver, kAckTag, ack, deadline_after(kTimeout));
  try {
    send_stale()->wait(deadline_after(kTimeout));
  } catch (const Error&) {
  }
}

struct Rejection {
  std::string what;
  int peer = -1;
};

// On the receiver: acknowledges what arrived so far, then receives the stale message (tag
// kStaleTag) and returns how it was rejected (empty if it was not).
Rejection ack_then_receive_stale(Transport& t, int sender, std::size_t bytes) {
  const std::array<std::byte, 1> ack{};
  t.send(sender, kAckTag, ack, deadline_after(kTimeout));
  std::vector<std::byte> stale(bytes);
  try {
    t.recv(sender, kStaleTag, stale, deadline_after(kTimeout));
  } catch (const ProtocolError& error) {
    return {error.what(), error.context().peer.value_or(-1)};
  }
  return {};
}

std::vector<std::byte> shortened_with_a_flipped_bit(const std::vector<std::byte>& bytes) {
  std::vector<std::byte> changed(bytes.begin(), bytes.end() - 1);
  changed[bytes.size() / 2] ^= std::byte{0x40};
  return changed;
}

// Rank 1 forwards to rank 2 what rank 0 sent it. Unchanged bytes arrive intact; bytes changed
// after their receive and forwarded against that receive arrive with the checksums verified on
// arrival, so rank 2 must detect the change: which shows that the checksums were reused, not
// computed again.
TEST(TcpTransport, ForwardingReusesTheChecksumsVerifiedOnArrival) {
  const TransportOptions options = striped_over_two_connections();
  auto group = make_loopback_group(3, options);
  constexpr std::size_t kBytes = (std::size_t{1} << 20) + 5;
  const auto first = payload(11, kBytes);
  const auto second = payload(12, kBytes);
  ASSERT_GT(tcp::plan_chunks(kBytes, 2, options.tcp.stripe_threshold_bytes,
                             options.tcp.stripe_chunk_bytes)
                .count,
            2U);
  std::vector<std::byte> at_two(kBytes);
  std::vector<std::byte> at_two_shorter(kBytes - 1);
  Rejection rejection;
  run_parallel(3, [&](int rank) {
    auto& t = *group[static_cast<std::size_t>(rank)];
    if (rank == 0) {
      t.send(1, 1, first, deadline_after(kTimeout));
      t.send(1, 2, second, deadline_after(kTimeout));
    } else if (rank == 1) {
      std::vector<std::byte> buffer(kBytes);
      auto received = t.irecv(0, 1, buffer);
      received->wait(deadline_after(kTimeout));
      t.iforward(2, 1, buffer, *received)->wait(deadline_after(kTimeout));
      // Changed bytes against a receive of other bytes: a plain send.
      std::vector<std::byte> other(kBytes);
      auto received_second = t.irecv(0, 2, other);
      received_second->wait(deadline_after(kTimeout));
      buffer[kBytes / 2] ^= std::byte{0x40};
      t.iforward(2, 2, std::span<const std::byte>(buffer).first(kBytes - 1), *received)
          ->wait(deadline_after(kTimeout));
      // Changed bytes against their own receive: the stale checksum goes out.
      other[kBytes - 3] ^= std::byte{0x01};
      send_stale_after_ack(t, 2, [&] { return t.iforward(2, kStaleTag, other, *received_second); });
    } else {
      t.recv(1, 1, at_two, deadline_after(kTimeout));
      t.recv(1, 2, at_two_shorter, deadline_after(kTimeout));
      rejection = ack_then_receive_stale(t, 1, kBytes);
    }
  });
  EXPECT_EQ(at_two, first);
  EXPECT_EQ(at_two_shorter, shortened_with_a_flipped_bit(first));
  EXPECT_NE(rejection.what.find("payload checksum mismatch"), std::string::npos) << rejection.what;
  EXPECT_EQ(rejection.peer, 1);
}

// Rank 0 sends the same bytes to ranks 1 and 2, the second time through iforward of the first
// send. Changed bytes claimed as that send's go out with its checksums, so rank 2 must detect
// the change: which shows that the checksums were shared, not computed again.
TEST(TcpTransport, SendingTheSameBytesAgainSharesTheChecksumsOfTheEarlierSend) {
  auto group = make_loopback_group(3, striped_over_two_connections());
  constexpr std::size_t kBytes = (std::size_t{1} << 20) + 5;
  const auto original = payload(21, kBytes);
  std::vector<std::byte> at_one(kBytes);
  std::vector<std::byte> at_two(kBytes);
  std::vector<std::byte> at_two_plain(kBytes - 1);
  Rejection rejection;
  run_parallel(3, [&](int rank) {
    auto& t = *group[static_cast<std::size_t>(rank)];
    if (rank == 0) {
      std::vector<std::byte> buffer = original;
      auto to_one = t.isend(1, 1, buffer);
      to_one->wait(deadline_after(kTimeout));  // written: its checksums are computed
      t.iforward(2, 1, buffer, *to_one)->wait(deadline_after(kTimeout));
      // Other bytes than the earlier send's (a shorter span): a plain send.
      buffer[kBytes / 2] ^= std::byte{0x40};
      t.iforward(2, 2, std::span<const std::byte>(buffer).first(kBytes - 1), *to_one)
          ->wait(deadline_after(kTimeout));
      // Changed bytes claimed to be the earlier send's: its stale checksums go out.
      send_stale_after_ack(t, 2, [&] { return t.iforward(2, kStaleTag, buffer, *to_one); });
    } else if (rank == 1) {
      t.recv(0, 1, at_one, deadline_after(kTimeout));
    } else {
      t.recv(0, 1, at_two, deadline_after(kTimeout));
      t.recv(0, 2, at_two_plain, deadline_after(kTimeout));
      rejection = ack_then_receive_stale(t, 0, kBytes);
    }
  });
  EXPECT_EQ(at_one, original);
  EXPECT_EQ(at_two, original);
  EXPECT_EQ(at_two_plain, shortened_with_a_flipped_bit(original));
  EXPECT_NE(rejection.what.find("payload checksum mismatch"), std::string::npos) << rejection.what;
  EXPECT_EQ(rejection.peer, 0);
}

// Wire bytes are the bytes through the link: frames and handshake messages, without TLS's own
// records and handshake (TransportStats).
TEST_P(OverLinks, StatsCountPayloadAndWireBytesExactly) {
  TransportOptions options = secured(GetParam());
  options.tcp.connections_per_peer = 3;
  options.tcp.stripe_threshold_bytes = 1 << 16;
  options.tcp.stripe_chunk_bytes = 1 << 16;
  auto group = make_loopback_group(2, options);
  const std::vector<std::size_t> sizes = {0, 1, 1000, 65536, 65537, 1'000'000};
  std::uint64_t payload_bytes = 0;
  std::uint64_t frames = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto message = payload(i, sizes[i]);
    std::vector<std::byte> got(sizes[i]);
    auto recv = group[1]->irecv(0, i, got);
    group[0]->send(1, i, message, deadline_after(kTimeout));
    recv->wait(deadline_after(kTimeout));
    payload_bytes += sizes[i];
    frames += tcp::plan_chunks(sizes[i], 3, options.tcp.stripe_threshold_bytes,
                               options.tcp.stripe_chunk_bytes)
                  .count;
  }
  const auto sender = group[0]->stats();
  const auto receiver = group[1]->stats();
  EXPECT_EQ(sender.payload_bytes_sent, payload_bytes);
  EXPECT_EQ(sender.messages_sent, sizes.size());
  EXPECT_EQ(receiver.payload_bytes_received, payload_bytes);
  EXPECT_EQ(receiver.messages_received, sizes.size());
  // Rank 0 opened 3 connections (hello + response out, challenge + verdict in).
  constexpr std::uint64_t kClientSends = tcp::kHelloBytes + tcp::kResponseBytes;
  constexpr std::uint64_t kServerSends = tcp::kChallengeBytes + tcp::kVerdictHeaderBytes;
  const std::uint64_t data_wire = payload_bytes + frames * tcp::kFrameHeaderBytes;
  EXPECT_EQ(sender.wire_bytes_sent, data_wire + 3 * kClientSends);
  EXPECT_EQ(receiver.wire_bytes_received, data_wire + 3 * kClientSends);
  EXPECT_EQ(receiver.wire_bytes_sent, 3 * kServerSends);
  EXPECT_EQ(sender.wire_bytes_received, 3 * kServerSends);
}

TEST(TcpTransport, RandomTrafficBetweenFourRanks) {
  TransportOptions options;
  options.tcp.connections_per_peer = 3;
  options.tcp.stripe_threshold_bytes = 32 * 1024;
  options.tcp.stripe_chunk_bytes = 16 * 1024;
  auto group = make_loopback_group(4, options);
  constexpr int kMessages = 150;
  // Message m from s to d has tag (m % 5) and a size drawn from a seeded generator.
  const auto size_of = [](int s, int d, int m) {
    std::mt19937_64 rng(static_cast<std::uint64_t>(s * 100000 + d * 1000 + m));
    return static_cast<std::size_t>(rng() % 200'000);
  };
  run_parallel(4, [&](int rank) {
    auto& t = *group[static_cast<std::size_t>(rank)];
    std::vector<std::vector<std::byte>> out;
    std::vector<std::vector<std::byte>> in;
    std::vector<std::unique_ptr<Request>> requests;
    out.reserve(4 * kMessages);
    in.reserve(4 * kMessages);
    std::mt19937 order(static_cast<unsigned>(rank));
    for (int m = 0; m < kMessages; ++m) {
      for (int peer = 0; peer < 4; ++peer) {
        // Sends and receives interleave in a rank-specific order.
        if (order() % 2 == 0) {
          out.push_back(payload(pair_seed(rank, peer, m), size_of(rank, peer, m)));
          requests.push_back(t.isend(peer, static_cast<Tag>(m % 5), out.back()));
          in.emplace_back(size_of(peer, rank, m));
          requests.push_back(t.irecv(peer, static_cast<Tag>(m % 5), in.back()));
        } else {
          in.emplace_back(size_of(peer, rank, m));
          requests.push_back(t.irecv(peer, static_cast<Tag>(m % 5), in.back()));
          out.push_back(payload(pair_seed(rank, peer, m), size_of(rank, peer, m)));
          requests.push_back(t.isend(peer, static_cast<Tag>(m % 5), out.back()));
        }
      }
    }
    for (auto& request : requests)
      request->wait(deadline_after(kTimeout));
    std::size_t index = 0;
    for (int m = 0; m < kMessages; ++m)
      for (int peer = 0; peer < 4; ++peer)
        ASSERT_EQ(in[index++], payload(pair_seed(peer, rank, m), size_of(peer, rank, m)))
            << "rank " << rank << " message " << m << " from " << peer;
  });
}

// A formed group carries a message from `sender` to `receiver`.
void expect_a_message_arrives(Transport& sender, Transport& receiver, std::size_t bytes) {
  std::vector<std::byte> got(bytes);
  const auto message = payload(1, bytes);
  auto recv = receiver.irecv(sender.rank(), 1, got);
  sender.send(receiver.rank(), 1, message, deadline_after(kTimeout));
  recv->wait(deadline_after(kTimeout));
  EXPECT_EQ(got, message);
}

TEST(TcpTransport, PeerListRendezvous) {
  // Ports are picked free just before use; a collision with another process is retried.
  for (int attempt = 0;; ++attempt) {
    const std::vector<std::string> peers = testing::free_peer_list(3);
    std::vector<std::unique_ptr<Transport>> group(3);
    try {
      run_parallel(3, [&](int rank) {
        group[static_cast<std::size_t>(rank)] =
            group::make_transport(testing::peer_list_options(peers, rank, "peer-list secret", 20s));
      });
    } catch (const IoError& error) {
      if (attempt < 3) continue;  // a port was taken meanwhile
      throw;
    }
    expect_a_message_arrives(*group[0], *group[2], 100);
    break;
  }
}

TEST(TcpTransport, APeerLostWhileTheGroupFormsEndsTheFormationAtOnce) {
  // Rank 2 never starts. Rank 1 connects to rank 0, gives up waiting for rank 2 after 3 s (time
  // for rank 0's connection and handshake to arrive on a loaded machine) and closes its
  // connections; rank 0, with 30 s to connect, fails as soon as rank 1 is gone and names it,
  // instead of waiting for rank 2 until its own deadline.
  for (int attempt = 0;; ++attempt) {
    const std::vector<std::string> peers = testing::free_peer_list(3);
    std::array<std::string, 2> failures;
    std::array<std::optional<int>, 2> blamed;
    std::array<std::chrono::steady_clock::duration, 2> took{};
    bool port_taken = false;
    run_parallel(2, [&](int rank) {
      const auto start = std::chrono::steady_clock::now();
      try {
        const auto transport = group::make_tcp_transport(
            testing::peer_list_options(peers, rank, "formation", rank == 0 ? 30s : 3s));
      } catch (const IoError&) {
        port_taken = true;  // a free port was taken meanwhile: try again
      } catch (const Error& error) {
        failures[static_cast<std::size_t>(rank)] = error.what();
        blamed[static_cast<std::size_t>(rank)] = error.context().peer;
      }
      took[static_cast<std::size_t>(rank)] = std::chrono::steady_clock::now() - start;
    });
    if (port_taken && attempt < 3) continue;
    EXPECT_NE(failures[1].find("could not connect to peers 2"), std::string::npos) << failures[1];
    EXPECT_EQ(blamed[1], 2);
    EXPECT_EQ(blamed[0], 1) << failures[0];
    EXPECT_LT(took[0], 15s) << failures[0];
    break;
  }
}

TEST(TcpTransport, AFormationWaitingForAPeerSaysWhomItWaitsFor) {
  // Rank 1 starts only once rank 0 has said, at the progress pace, that it waits for rank 1;
  // then the group forms. The test moves on when the line appears, never after a sleep.
  constexpr auto kBound = 120s;  // how long the test waits for a line, on a busy machine
  ::setenv("PULSELOCO_WAIT_LOG_SECONDS", "0.1", 1);
  const pulseloco::testing::LogCapture log;
  for (int attempt = 0;; ++attempt) {
    const std::vector<std::string> peers = testing::free_peer_list(2);
    std::array<std::unique_ptr<Transport>, 2> group;
    std::array<std::exception_ptr, 2> errors;
    const auto form = [&](int rank) {
      try {
        group[static_cast<std::size_t>(rank)] =
            group::make_transport(testing::peer_list_options(peers, rank, "progress", kBound));
      } catch (...) {
        errors[static_cast<std::size_t>(rank)] = std::current_exception();
      }
    };
    std::thread rank_0(form, 0);
    const bool named = log.wait_for("s for peers 1 to connect (", kBound);
    form(1);  // let rank 0 go whatever the log said
    rank_0.join();
    const auto port_taken = [](const std::exception_ptr& error) {
      try {
        if (error) std::rethrow_exception(error);
      } catch (const IoError&) {
        return true;
      } catch (...) {
      }
      return false;
    };
    if ((port_taken(errors[0]) || port_taken(errors[1])) && attempt < 3) continue;
    ::unsetenv("PULSELOCO_WAIT_LOG_SECONDS");
    EXPECT_TRUE(named) << log.text();
    EXPECT_NE(log.text().find("the formation gives up after 120000 ms"), std::string::npos);
    for (const auto& error : errors)
      if (error) std::rethrow_exception(error);
    expect_a_message_arrives(*group[0], *group[1], 10);
    break;
  }
}

TEST(TcpTransport, OptionsAreValidated) {
  TransportOptions options;
  options.tcp.connections_per_peer = 0;
  EXPECT_THROW(group::validate(options), InvalidArgument);
  options = {};
  options.tcp.stripe_chunk_bytes = 100;
  EXPECT_THROW(group::validate(options), InvalidArgument);
  options = {};
  options.tcp.busy_poll = std::chrono::microseconds(-1);
  EXPECT_THROW(group::validate(options), InvalidArgument);
  options = {};
  options.world_size = 2;
  options.rank = 2;
  EXPECT_THROW(group::validate(options), InvalidArgument);
  options = {};
  options.world_size = 3;
  options.rank = 0;
  // Three ranks but no way to find them.
  EXPECT_THROW((void)group::make_transport(options), InvalidArgument);
}

}  // namespace
}  // namespace pulseloco::transport
