// One rank's Diagnosis (diagnosis.h) over the in-process transport, with the test playing the
// other ranks: it sends their notices by hand and reads what the rank sends them. Nothing waits
// on time: every notice the rank needs is sent before it looks.
#include <pulseloco/collectives/detail/diagnosis.h>

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <pulseloco/transport/inproc/inproc.h>

namespace pulseloco::collectives::detail {
namespace {

using namespace std::chrono_literals;

constexpr auto kTimeout = 2000ms;

// Rank 0 of a group of `world`, inside call #0 of an all-gather, with its Diagnosis; the
// other ranks' transports are the test's.
class RankZero {
 public:
  explicit RankZero(int world)
      : group_(transport::inproc::make_group(world)),
        context_(*group_[0], {.timeout = kTimeout}, Op::sparse_allgather),
        diagnosis_(context_, requests_) {
    diagnosis_.post_receives();
  }
  ~RankZero() { diagnosis_.abort_transport("the test is over"); }
  RankZero(const RankZero&) = delete;
  RankZero& operator=(const RankZero&) = delete;

  Diagnosis& diagnosis() { return diagnosis_; }
  transport::Transport& rank0() { return *group_[0]; }

  // Rank `from` sends rank 0 a notice about `subject`.
  void notice_from(int from, NoticeType type, int subject, ErrorKind kind = ErrorKind::peer_lost) {
    const Notice notice{.type = type, .kind = kind, .reporter = from, .subject = subject};
    send_from(from, notice.encode());
  }
  void send_from(int from, const Notice::Bytes& bytes) {
    group_[static_cast<std::size_t>(from)]->send(0, context_.tag(Phase::notice), bytes,
                                                 transport::deadline_after(kTimeout));
  }
  // Waits until rank 0 holds `from`'s notice, then lets it look.
  void deliver(int from) {
    if (transport::Request* pending = diagnosis_.awaited_notice(from)) {
      pending->wait(transport::deadline_after(kTimeout));
    }
  }
  // The next notice rank 0 sent to rank `to` for call #`sequence` (this one is #0).
  Notice notice_to(int to, std::uint64_t sequence = 0) {
    Notice::Bytes bytes{};
    group_[static_cast<std::size_t>(to)]->recv(0, make_tag(0, sequence, Phase::notice), bytes,
                                               transport::deadline_after(kTimeout));
    return Notice::decode(bytes, to, 0, static_cast<int>(group_.size()), sequence);
  }
  // Rank `rank` dies: its connections close.
  void kill(int rank) { group_[static_cast<std::size_t>(rank)]->abort("killed"); }

  // Rank `from` sends rank 0 its header under Phase::diagnosis.
  void header_from(int from, const Header& header) {
    group_[static_cast<std::size_t>(from)]->send(0, context_.tag(Phase::diagnosis), header.encode(),
                                                 transport::deadline_after(kTimeout));
  }
  // The header rank 0 sent rank `to` under Phase::diagnosis.
  Header header_to(int to) {
    Header::Bytes bytes{};
    group_[static_cast<std::size_t>(to)]->recv(0, context_.tag(Phase::diagnosis), bytes,
                                               transport::deadline_after(kTimeout));
    return Header::decode(bytes, to, 0);
  }

  // Runs the failure path for `error`; rank 0's header is `mine`, and a full set of headers
  // disagrees when their values do.
  void fail(std::exception_ptr error, const Header& mine = {}) {
    const Header::Bytes header = mine.encode();
    std::vector<Header> headers(group_.size());
    headers[0] = mine;
    diagnosis_.fail(error, {.header = header,
                            .headers = headers,
                            .left_neighbour_only = false,
                            .waiting_on = -1,
                            .check_all_headers = [](const std::vector<Header>& all) {
                              std::vector<std::string> values;
                              for (const Header& h : all)
                                values.push_back(std::to_string(h.value));
                              if (const auto odd = find_minority(values)) {
                                throw Disagreement(odd->culprit, odd->majority_rank,
                                                   ErrorKind::invalid_argument, "lengths differ");
                              }
                            }});
  }

 private:
  std::vector<std::unique_ptr<transport::Transport>> group_;
  CallContext context_;
  Diagnosis diagnosis_;
  Requests requests_;  // destroyed first: its operations use the diagnosis's buffers
};

template <typename Exception>
std::exception_ptr as_ptr(Exception e) {
  return std::make_exception_ptr(std::move(e));
}

// The pulseloco::Error that `fail` threw.
struct Failed {
  ErrorKind kind;
  std::optional<int> peer;
};
Failed failure_of(RankZero& rank, std::exception_ptr cause, const Header& mine = {}) {
  try {
    rank.fail(std::move(cause), mine);
  } catch (const Error& error) {
    return {error.kind(), error.context().peer};
  }
  ADD_FAILURE() << "fail() returned";
  return {};
}

// `notice` is of `type`, about `subject`, with `kind`.
void expect_notice(const Notice& notice, NoticeType type, int subject, ErrorKind kind) {
  EXPECT_EQ(notice.type, type);
  EXPECT_EQ(notice.subject, subject);
  EXPECT_EQ(notice.kind, kind);
}

TEST(NoticeChannel, DoneNoticesLetTheCallGoOn) {
  RankZero rank(3);
  for (const int peer : {1, 2}) {
    EXPECT_NE(rank.diagnosis().awaited_notice(peer), nullptr);
    rank.notice_from(peer, NoticeType::done, peer);
    rank.deliver(peer);
    rank.diagnosis().poll();
    EXPECT_EQ(rank.diagnosis().awaited_notice(peer), nullptr);
  }
}

TEST(NoticeChannel, AFailureNoticeFailsTheNextPoll) {
  RankZero rank(3);
  rank.notice_from(2, NoticeType::suspect, 1, ErrorKind::timeout);
  rank.deliver(2);
  EXPECT_THROW(rank.diagnosis().poll(), NoticeFailure);
}

TEST(NoticeChannel, GarbageOnTheNoticeTagFailsThePollAndNamesItsSender) {
  RankZero rank(3);
  Notice::Bytes garbage{};
  garbage.fill(std::byte{0x5A});
  rank.send_from(2, garbage);
  rank.deliver(2);
  EXPECT_THROW(rank.diagnosis().poll(), NoticeFailure);
  const Failed failed = failure_of(rank, as_ptr(NoticeFailure()));
  EXPECT_EQ(failed.kind, ErrorKind::protocol);
  EXPECT_EQ(failed.peer, 2);
  // The others learn the verdict.
  expect_notice(rank.notice_to(1), NoticeType::culprit, 2, ErrorKind::protocol);
}

TEST(FailurePath, ADefinitiveCulpritNoticeBeatsALostPeer) {
  // Rank 2 found that rank 1 sent garbage, said so, and closed its connections.
  RankZero rank(4);
  rank.notice_from(2, NoticeType::culprit, 1, ErrorKind::protocol);
  rank.deliver(2);
  const Failed failed =
      failure_of(rank, as_ptr(ObservedFailure(2, ErrorKind::peer_lost, false, "closed")));
  EXPECT_EQ(failed.kind, ErrorKind::protocol);
  EXPECT_EQ(failed.peer, 1);
  for (const int peer : {1, 3})
    expect_notice(rank.notice_to(peer), NoticeType::culprit, 1, ErrorKind::protocol);
}

TEST(FailurePath, OfTwoLostPeersTheOneLostFirstIsTheCulprit) {
  // Rank 2 died; rank 1 failed because of it and left before its culprit notice could say
  // so (or in an earlier call). Rank 0 then sees its wait on rank 1 fail.
  RankZero rank(3);
  rank.kill(2);
  rank.kill(1);
  const Failed failed =
      failure_of(rank, as_ptr(ObservedFailure(1, ErrorKind::peer_lost, false, "closed")));
  EXPECT_EQ(failed.kind, ErrorKind::peer_lost);
  EXPECT_EQ(failed.peer, 2);
}

TEST(FailurePath, ARankThatSaidDoneAlsoTellsTheNextCall) {
  // Rank 0 said `done`, so a peer may have finished this call and started the next one on the
  // same base tag: the verdict goes to that call's notice tag too.
  RankZero rank(3);
  PendingSends sends;
  rank.diagnosis().send_notice(NoticeType::done, ErrorKind::peer_lost, 0, sends);
  rank.kill(2);
  const Failed failed =
      failure_of(rank, as_ptr(ObservedFailure(2, ErrorKind::peer_lost, false, "closed")));
  EXPECT_EQ(failed.peer, 2);
  expect_notice(rank.notice_to(1), NoticeType::done, 0, ErrorKind::peer_lost);
  expect_notice(rank.notice_to(1), NoticeType::culprit, 2, ErrorKind::peer_lost);
  expect_notice(rank.notice_to(1, 1), NoticeType::culprit, 2, ErrorKind::peer_lost);
}

TEST(FailurePath, ATimeoutFollowsTheChainOfSuspectsToTheSilentRank) {
  // Rank 0 timed out on 1, which timed out on 2, which timed out on 3.
  RankZero rank(4);
  rank.notice_from(1, NoticeType::suspect, 2, ErrorKind::timeout);
  rank.notice_from(2, NoticeType::suspect, 3, ErrorKind::timeout);
  rank.deliver(1);
  rank.deliver(2);
  const Failed failed = failure_of(
      rank, as_ptr(ObservedFailure(1, ErrorKind::timeout, true, "no progress from peer 1")));
  EXPECT_EQ(failed.kind, ErrorKind::timeout);
  EXPECT_EQ(failed.peer, 3);
  // First its own suspicion, then the verdict.
  expect_notice(rank.notice_to(2), NoticeType::suspect, 1, ErrorKind::timeout);
  expect_notice(rank.notice_to(2), NoticeType::culprit, 3, ErrorKind::timeout);
}

TEST(FailurePath, ADisagreementWithTheLeftNeighbourIsJudgedFromEveryRanksHeader) {
  // Rank 0's left neighbour (3) called with another length than rank 0; the culprit is the
  // rank that differs from the majority, which takes every rank's header to find.
  RankZero rank(4);
  const auto header = [](std::uint64_t value) {
    return Header{.op = Op::sparse_allgather, .value = value};
  };
  rank.header_from(1, header(9));
  rank.header_from(2, header(8));
  rank.header_from(3, header(9));
  const Failed failed = failure_of(rank, as_ptr(LeftDisagreement()), header(9));
  EXPECT_EQ(failed.kind, ErrorKind::invalid_argument);
  EXPECT_EQ(failed.peer, 2);
  for (const int peer : {1, 2, 3}) {
    EXPECT_EQ(rank.header_to(peer).value, 9U);
    expect_notice(rank.notice_to(peer), NoticeType::disagreement, 0, ErrorKind::invalid_argument);
    expect_notice(rank.notice_to(peer), NoticeType::culprit, 2, ErrorKind::invalid_argument);
  }
}

TEST(FailurePath, ALocalErrorIsRethrownAfterTellingThePeers) {
  RankZero rank(3);
  EXPECT_THROW(rank.fail(as_ptr(std::runtime_error("decoder rejected the message"))),
               std::runtime_error);
  for (const int peer : {1, 2})
    expect_notice(rank.notice_to(peer), NoticeType::aborted, 0, ErrorKind::peer_lost);
  // The transport is aborted afterwards.
  try {
    Notice::Bytes bytes{};
    rank.rank0().recv(1, 99, bytes, transport::deadline_after(kTimeout));
    ADD_FAILURE() << "the transport still works";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::aborted);
  }
}

TEST(FailurePath, ALocalAbortIsRethrownUnchanged) {
  RankZero rank(3);
  rank.rank0().abort("the engine gave up");
  try {
    rank.fail(as_ptr(AbortedError("the engine gave up", {.rank = 0})));
    ADD_FAILURE() << "fail() returned";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::aborted);
  }
}

}  // namespace
}  // namespace pulseloco::collectives::detail
