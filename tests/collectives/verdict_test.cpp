// The rules by which a failing rank names the culprit of a collective call (verdict.h), driven
// directly with the notices and lost channels a rank has: no transport, no timing.
#include <pulseloco/collectives/detail/verdict.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace pulseloco::collectives::detail {
namespace {

using namespace std::chrono_literals;

// What one rank has heard from each of `world` ranks.
class Heard_ {
 public:
  Heard_(int rank, int world) : rank_(rank), heard_(static_cast<std::size_t>(world)) {}

  // `peer` sent a notice of `type` about `subject`.
  Heard_& notice(int peer, NoticeType type, int subject, ErrorKind kind = ErrorKind::peer_lost) {
    Heard& heard = at(peer);
    heard.latest = Notice{.type = type, .kind = kind, .reporter = peer, .subject = subject};
    if (type == NoticeType::suspect && subject == rank_) heard.timed_out_on_me = true;
    return *this;
  }
  Heard_& done(int peer) { return notice(peer, NoticeType::done, peer); }
  Heard_& suspects(int peer, int subject) {
    return notice(peer, NoticeType::suspect, subject, ErrorKind::timeout);
  }
  Heard_& blames(int peer, int culprit, ErrorKind kind) {
    return notice(peer, NoticeType::culprit, culprit, kind);
  }
  Heard_& aborted(int peer) { return notice(peer, NoticeType::aborted, peer); }
  // `peer`'s notice channel failed.
  Heard_& lost(int peer, ErrorKind kind = ErrorKind::peer_lost) {
    at(peer).broken = kind;
    at(peer).broken_detail = "channel failed";
    return *this;
  }

  // The transport lost these peers, in this order.
  Heard_& lost_in_order(std::vector<int> peers) {
    lost_order_ = std::move(peers);
    return *this;
  }

  [[nodiscard]] Evidence evidence() const {
    return {.rank = rank_, .heard = heard_, .lost_order = lost_order_};
  }

 private:
  Heard& at(int peer) { return heard_[static_cast<std::size_t>(peer)]; }
  int rank_;
  std::vector<Heard> heard_;
  std::vector<int> lost_order_;
};

constexpr auto kCallTimeout = 1000ms;

// ---------------------------------------------------------------------------------------------
// Weights and the strongest verdict

TEST(Weight, GarbageAndDisagreementOutweighATimeoutWhichOutweighsALoss) {
  EXPECT_EQ(weight(ErrorKind::protocol), weight(ErrorKind::invalid_argument));
  EXPECT_GT(weight(ErrorKind::protocol), weight(ErrorKind::timeout));
  EXPECT_GT(weight(ErrorKind::timeout), weight(ErrorKind::peer_lost));
  EXPECT_GT(weight(ErrorKind::peer_lost), weight(ErrorKind::io));
  EXPECT_GT(weight(ErrorKind::peer_lost), weight(ErrorKind::aborted));
  EXPECT_TRUE(worth_settling({.kind = ErrorKind::peer_lost}));
  EXPECT_TRUE(worth_settling({.kind = ErrorKind::io}));
  EXPECT_FALSE(worth_settling({.kind = ErrorKind::timeout}));
}

TEST(StrongestVerdict, IsTheMostIncriminatingCulpritNotice) {
  // Evidence views what Heard_ holds: the Heard_ must outlive it.
  Heard_ heard(0, 4);
  heard.blames(1, 3, ErrorKind::peer_lost)
      .blames(2, 1, ErrorKind::protocol)
      .blames(3, 2, ErrorKind::timeout);
  const auto best = strongest_verdict(heard.evidence());
  ASSERT_TRUE(best);
  EXPECT_EQ(best->culprit, 1);
  EXPECT_EQ(best->kind, ErrorKind::protocol);
  EXPECT_EQ(best->reporter, 2);
}

TEST(StrongestVerdict, AmongEqualNoticesTheLowestRanksWins) {
  const auto best = strongest_verdict(
      Heard_(0, 4).blames(3, 1, ErrorKind::timeout).blames(2, 3, ErrorKind::timeout).evidence());
  ASSERT_TRUE(best);
  EXPECT_EQ(best->reporter, 2);
  EXPECT_EQ(best->culprit, 3);
}

TEST(StrongestVerdict, AnAbortedNoticeNamesItsSenderAsLost) {
  const auto best = strongest_verdict(Heard_(0, 3).aborted(2).evidence());
  ASSERT_TRUE(best);
  EXPECT_EQ(best->culprit, 2);
  EXPECT_EQ(best->kind, ErrorKind::peer_lost);
  EXPECT_EQ(best->reporter, 2);
}

TEST(StrongestVerdict, ANoticeOutweighsALostChannelOfAnyKind) {
  const auto best = strongest_verdict(
      Heard_(0, 4).lost(1, ErrorKind::protocol).blames(3, 2, ErrorKind::peer_lost).evidence());
  ASSERT_TRUE(best);
  EXPECT_EQ(best->culprit, 2);
  EXPECT_EQ(best->reporter, 3);
}

TEST(StrongestVerdict, WithoutNoticesTheMostIncriminatingLostChannelIsTheCulprit) {
  const auto best = strongest_verdict(
      Heard_(0, 4).lost(1).lost(2, ErrorKind::protocol).suspects(3, 2).evidence());
  ASSERT_TRUE(best);
  EXPECT_EQ(best->culprit, 2);
  EXPECT_EQ(best->kind, ErrorKind::protocol);
  EXPECT_EQ(best->reporter, 0);
  // Among equals, without an order of losses: the lowest rank.
  EXPECT_EQ(strongest_verdict(Heard_(0, 4).lost(3).lost(2).evidence())->culprit, 2);
}

TEST(StrongestVerdict, AmongLostChannelsThePeerTheTransportLostFirstIsTheCulprit) {
  // Rank 3 died; rank 1 failed because of it and left afterwards.
  const auto best =
      strongest_verdict(Heard_(0, 4).lost(1).lost(3).lost_in_order({3, 1}).evidence());
  ASSERT_TRUE(best);
  EXPECT_EQ(best->culprit, 3);
  EXPECT_EQ(best->kind, ErrorKind::peer_lost);
  EXPECT_EQ(best->reporter, 0);
  // A channel the transport never reported lost (a peer that closed in an orderly way) comes
  // after those it did.
  EXPECT_EQ(strongest_verdict(Heard_(0, 4).lost(1).lost(3).lost_in_order({3}).evidence())->culprit,
            3);
  // Garbage still outweighs an earlier loss.
  EXPECT_EQ(strongest_verdict(
                Heard_(0, 4).lost(1, ErrorKind::protocol).lost(3).lost_in_order({3, 1}).evidence())
                ->culprit,
            1);
}

TEST(StrongestVerdict, DoneAndSuspectNoticesSayNothingDefinitive) {
  EXPECT_FALSE(strongest_verdict(Heard_(0, 3).done(1).suspects(2, 1).evidence()));
  EXPECT_FALSE(strongest_verdict(Heard_(0, 3).evidence()));
}

TEST(BetterVerdict, OnlyAStrictlyMoreIncriminatingOne) {
  const Verdict lost{.culprit = 1, .kind = ErrorKind::peer_lost, .reporter = 0};
  EXPECT_FALSE(better_verdict(Heard_(0, 3).blames(2, 1, ErrorKind::peer_lost).evidence(), lost));
  const auto better =
      better_verdict(Heard_(0, 3).blames(2, 1, ErrorKind::timeout).evidence(), lost);
  ASSERT_TRUE(better);
  EXPECT_EQ(better->kind, ErrorKind::timeout);
}

// ---------------------------------------------------------------------------------------------
// What this rank saw first-hand

TEST(FirstHand, ADefinitiveCulpritNoticeBeatsALostPeer) {
  // Rank 2 closed its connections after finding that rank 1 sent garbage.
  const Ruling ruling = first_hand_ruling(Heard_(0, 4).blames(3, 1, ErrorKind::protocol).evidence(),
                                          2, ErrorKind::peer_lost, "lost");
  EXPECT_EQ(ruling.verdict.culprit, 1);
  EXPECT_EQ(ruling.verdict.kind, ErrorKind::protocol);
  EXPECT_EQ(ruling.verdict.reporter, 3);
}

TEST(FirstHand, TheLostPeersOwnCulpritNoticeExplainsItsLoss) {
  const Ruling ruling = first_hand_ruling(
      Heard_(0, 4).blames(2, 3, ErrorKind::timeout).blames(1, 2, ErrorKind::peer_lost).evidence(),
      2, ErrorKind::peer_lost, "lost");
  EXPECT_EQ(ruling.verdict.culprit, 3);
  EXPECT_EQ(ruling.verdict.kind, ErrorKind::timeout);
  EXPECT_EQ(ruling.verdict.reporter, 2);
}

TEST(FirstHand, GarbageStandsWithoutWaiting) {
  const Ruling ruling = first_hand_ruling(Heard_(0, 4).blames(3, 1, ErrorKind::timeout).evidence(),
                                          2, ErrorKind::protocol, "checksum");
  EXPECT_EQ(ruling.verdict.culprit, 2);
  EXPECT_EQ(ruling.verdict.kind, ErrorKind::protocol);
  EXPECT_EQ(ruling.verdict.reporter, 0);
  EXPECT_EQ(ruling.verdict.detail, "checksum");
  EXPECT_FALSE(ruling.settle);
}

TEST(FirstHand, APeerLostBeforeTheObservedOneIsTheCulprit) {
  // This rank's wait on rank 1 failed, but rank 2 was lost first: rank 1 left because of it.
  const Ruling ruling =
      first_hand_ruling(Heard_(0, 3).lost(1).lost(2).lost_in_order({2, 1}).evidence(), 1,
                        ErrorKind::peer_lost, "closed");
  EXPECT_EQ(ruling.verdict.culprit, 2);
  EXPECT_EQ(ruling.verdict.kind, ErrorKind::peer_lost);
  EXPECT_TRUE(ruling.settle);
  // Lost first itself, the observed peer stands.
  const Ruling itself =
      first_hand_ruling(Heard_(0, 3).lost(1).lost(2).lost_in_order({1, 2}).evidence(), 1,
                        ErrorKind::peer_lost, "closed");
  EXPECT_EQ(itself.verdict.culprit, 1);
}

TEST(FirstHand, ALostPeerWithNothingElseToGoOnIsTheCulpritAfterSettling) {
  const Ruling ruling =
      first_hand_ruling(Heard_(0, 3).done(1).evidence(), 2, ErrorKind::peer_lost, "closed");
  EXPECT_EQ(ruling.verdict.culprit, 2);
  EXPECT_EQ(ruling.verdict.kind, ErrorKind::peer_lost);
  EXPECT_TRUE(ruling.settle);
  // Another rank that blames the same peer confirms it.
  const Ruling same = first_hand_ruling(Heard_(0, 3).blames(1, 2, ErrorKind::peer_lost).evidence(),
                                        2, ErrorKind::peer_lost, "closed");
  EXPECT_EQ(same.verdict.culprit, 2);
  EXPECT_EQ(same.verdict.reporter, 0);
}

// ---------------------------------------------------------------------------------------------
// The chain of suspects

TEST(Suspects, AChainLeadsToTheSilentRank) {
  // Rank 0 timed out on 1, which timed out on 2, which timed out on 3; 3 says nothing.
  const ChainEnd end =
      follow_suspects(Heard_(0, 5).suspects(1, 2).suspects(2, 3).evidence(), 1, 1, kCallTimeout);
  ASSERT_EQ(end.end, ChainEnd::End::candidate);
  EXPECT_EQ(end.ruling.verdict.culprit, 3);
  EXPECT_EQ(end.ruling.verdict.kind, ErrorKind::timeout);
  EXPECT_FALSE(end.others_reported);  // rank 4 has said nothing yet
}

TEST(Suspects, TheSilentRankIsCertainOnceEveryOtherRankHasReported) {
  const ChainEnd end =
      follow_suspects(Heard_(0, 4).suspects(1, 2).suspects(2, 3).evidence(), 1, 1, kCallTimeout);
  ASSERT_EQ(end.end, ChainEnd::End::candidate);
  EXPECT_EQ(end.ruling.verdict.culprit, 3);
  EXPECT_TRUE(end.others_reported);
}

TEST(Suspects, AChainBackToThisRankNamesTheRankThatWaitedForIt) {
  const ChainEnd end =
      follow_suspects(Heard_(0, 4).suspects(1, 2).suspects(2, 0).evidence(), 1, 1, kCallTimeout);
  ASSERT_EQ(end.end, ChainEnd::End::ruling);
  EXPECT_EQ(end.ruling.verdict.culprit, 2);
  EXPECT_EQ(end.ruling.verdict.kind, ErrorKind::timeout);
  EXPECT_EQ(end.ruling.verdict.reporter, 0);
}

TEST(Suspects, AChainThatReachesAVerdictAdoptsIt) {
  const ChainEnd end =
      follow_suspects(Heard_(0, 4).suspects(1, 2).blames(2, 3, ErrorKind::peer_lost).evidence(), 1,
                      1, kCallTimeout);
  ASSERT_EQ(end.end, ChainEnd::End::ruling);
  EXPECT_EQ(end.ruling.verdict.culprit, 3);
  EXPECT_EQ(end.ruling.verdict.reporter, 2);
}

TEST(Suspects, AChainThatReachesALostChannelNamesThatRankAfterSettling) {
  const ChainEnd end =
      follow_suspects(Heard_(0, 4).suspects(1, 2).lost(2).evidence(), 1, 1, kCallTimeout);
  ASSERT_EQ(end.end, ChainEnd::End::ruling);
  EXPECT_EQ(end.ruling.verdict.culprit, 2);
  EXPECT_EQ(end.ruling.verdict.kind, ErrorKind::peer_lost);
  EXPECT_TRUE(end.ruling.settle);
}

TEST(Suspects, ACycleNamesTheFallback) {
  // 1 and 2 wait on each other: a message between them was lost.
  const ChainEnd end =
      follow_suspects(Heard_(0, 4).suspects(1, 2).suspects(2, 1).evidence(), 1, 1, kCallTimeout);
  ASSERT_EQ(end.end, ChainEnd::End::ruling);
  EXPECT_EQ(end.ruling.verdict.culprit, 1);
  EXPECT_EQ(end.ruling.verdict.kind, ErrorKind::timeout);
}

TEST(Suspects, WithoutAChainTheFirstRankThatSaidNothingIsTheCandidate) {
  // A native collective timed out without naming a peer: "suspect: unknown" is a suspect
  // notice about its sender itself, which ends the chain.
  const ChainEnd end =
      follow_suspects(Heard_(0, 4).suspects(1, 1).suspects(3, 3).evidence(), -1, -1, kCallTimeout);
  ASSERT_EQ(end.end, ChainEnd::End::candidate);
  EXPECT_EQ(end.ruling.verdict.culprit, 2);
  EXPECT_TRUE(end.others_reported);
  const ChainEnd from_unknown =
      follow_suspects(Heard_(0, 4).suspects(1, 1).evidence(), 1, 1, kCallTimeout);
  ASSERT_EQ(from_unknown.end, ChainEnd::End::candidate);
  EXPECT_EQ(from_unknown.ruling.verdict.culprit, 2);
  EXPECT_FALSE(from_unknown.others_reported);
}

TEST(Suspects, WhenEveryRankStalledNobodyIsToBlame) {
  const ChainEnd end =
      follow_suspects(Heard_(0, 3).suspects(1, 1).suspects(2, 2).evidence(), -1, -1, kCallTimeout);
  EXPECT_EQ(end.end, ChainEnd::End::nobody);
  EXPECT_EQ(end.ruling.verdict.culprit, -1);
  EXPECT_EQ(end.ruling.verdict.kind, ErrorKind::timeout);
}

// ---------------------------------------------------------------------------------------------
// Disagreements

TEST(Minority, IsTheFirstRankThatDiffersFromTheMajority) {
  const std::vector<std::string> keys = {"8", "8", "9", "8", "7"};
  const auto odd = find_minority(keys);
  ASSERT_TRUE(odd);
  EXPECT_EQ(odd->culprit, 2);
  EXPECT_EQ(odd->majority_rank, 0);
  EXPECT_EQ(odd->majority_count, 3U);
  // The majority need not include rank 0.
  const std::vector<std::string> first_odd = {"9", "8", "8"};
  const auto first = find_minority(first_odd);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->culprit, 0);
  EXPECT_EQ(first->majority_rank, 1);
}

TEST(Minority, ATieGoesToTheLowestRanksValue) {
  const std::vector<std::string> keys = {"b", "a", "a", "b"};
  const auto odd = find_minority(keys);
  ASSERT_TRUE(odd);
  EXPECT_EQ(odd->majority_rank, 0);
  EXPECT_EQ(odd->culprit, 1);
}

TEST(Minority, NoneWhenAllAgree) {
  const std::vector<std::string> keys = {"x", "x", "x"};
  EXPECT_FALSE(find_minority(keys));
  EXPECT_FALSE(find_minority(std::vector<std::string>{"x"}));
}

// ---------------------------------------------------------------------------------------------
// The error a rank throws

struct Thrown {
  ErrorKind kind;
  std::optional<int> peer;
  std::optional<int> rank;
};

Thrown thrown_by(const Evidence& evidence, const Verdict& verdict, int waiting_on = -1) {
  try {
    throw_verdict(evidence, verdict, waiting_on, "sparse_allgather call #0 under tag 0");
  } catch (const Error& error) {
    return {error.kind(), error.context().peer, error.context().rank};
  }
  ADD_FAILURE() << "throw_verdict returned";
  return {};
}

TEST(Thrown, NamesTheCulpritWithTheVerdictsKind) {
  const auto evidence = Heard_(0, 4).evidence();
  for (const ErrorKind kind : {ErrorKind::timeout, ErrorKind::protocol, ErrorKind::invalid_argument,
                               ErrorKind::peer_lost, ErrorKind::io}) {
    const Thrown error = thrown_by(evidence, {.culprit = 2, .kind = kind, .reporter = 1});
    EXPECT_EQ(error.kind, kind);
    EXPECT_EQ(error.peer, 2);
    EXPECT_EQ(error.rank, 0);
  }
  // Kinds without an error class of their own are reported as a lost peer.
  EXPECT_EQ(thrown_by(evidence, {.culprit = 2, .kind = ErrorKind::aborted, .reporter = 2}).kind,
            ErrorKind::peer_lost);
}

TEST(Thrown, TheOddOneOutNamesARankOfTheMajority) {
  const Thrown error =
      thrown_by(Heard_(1, 3).evidence(),
                {.culprit = 1, .kind = ErrorKind::invalid_argument, .reporter = 1, .majority = 0});
  EXPECT_EQ(error.kind, ErrorKind::invalid_argument);
  EXPECT_EQ(error.peer, 0);
}

TEST(Thrown, ARankAccusedOfATimeoutNamesThePeerItWaitedFor) {
  const Thrown error = thrown_by(Heard_(1, 4).suspects(0, 1).evidence(),
                                 {.culprit = 1, .kind = ErrorKind::timeout, .reporter = 3}, 2);
  EXPECT_EQ(error.kind, ErrorKind::timeout);
  EXPECT_EQ(error.peer, 2);
}

TEST(Thrown, AnAccusedRankNamesAPeerThatTimedOutWaitingForIt) {
  const Thrown error = thrown_by(Heard_(1, 4).suspects(3, 1).evidence(),
                                 {.culprit = 1, .kind = ErrorKind::protocol, .reporter = 2});
  EXPECT_EQ(error.kind, ErrorKind::protocol);
  EXPECT_EQ(error.peer, 3);
  // Else the accuser.
  EXPECT_EQ(
      thrown_by(Heard_(1, 4).evidence(), {.culprit = 1, .kind = ErrorKind::protocol, .reporter = 2})
          .peer,
      2);
}

TEST(Thrown, AStallOnEveryRankNamesNoPeer) {
  const Thrown error = thrown_by(Heard_(0, 3).evidence(),
                                 {.culprit = -1, .kind = ErrorKind::timeout, .reporter = 0});
  EXPECT_EQ(error.kind, ErrorKind::timeout);
  EXPECT_FALSE(error.peer);
  EXPECT_EQ(error.rank, 0);
}

}  // namespace
}  // namespace pulseloco::collectives::detail
