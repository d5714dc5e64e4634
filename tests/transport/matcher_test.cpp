// The TCP transport's message matcher on its own: receives posted before and after their
// messages, early messages and their cap, a receive posted while its message arrives, sizes
// that do not match, and frames that break the rules.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include <pulseloco/transport/tcp/matcher.h>

namespace pulseloco::transport::tcp {
namespace {

constexpr int kPeer = 1;

struct MatcherTest : ::testing::Test {
  UnexpectedBytes unexpected{1000};
  MessageMatcher matcher{ErrorContext{.rank = 0, .peer = kPeer}, unexpected};

  std::shared_ptr<Operation> receive(Tag tag, std::vector<std::byte>& buffer) {
    auto op = std::make_shared<Operation>();
    op->peer = kPeer;
    op->tag = tag;
    op->bytes = buffer.size();
    op->recv_buffer = buffer;
    return op;
  }
  MatchOutcome post(const std::shared_ptr<Operation>& op) {
    std::optional<MessageKey> nothing_arrived;
    return matcher.post_receive(op, nullptr, nothing_arrived);
  }
  static FrameHeader frame(Tag tag, std::uint64_t sequence, std::uint64_t message_bytes,
                           std::uint64_t offset, std::uint64_t bytes) {
    FrameHeader header;
    header.tag = tag;
    header.sequence = sequence;
    header.message_bytes = message_bytes;
    header.chunk_offset = offset;
    header.chunk_bytes = bytes;
    return header;
  }
  // A whole frame arriving: where it goes, the bytes written there, and what finishing it did.
  MatchOutcome arrive(const FrameHeader& header, std::byte fill) {
    const FrameTarget target = matcher.begin_frame(header);
    EXPECT_EQ(target.action, FrameTarget::Action::read);
    if (target.target != nullptr)
      std::memset(target.target, static_cast<int>(fill), header.chunk_bytes);
    return matcher.finish_frame({header.tag, header.sequence}, header, false);
  }
};

TEST_F(MatcherTest, AReceivePostedFirstTakesItsMessageInPlace) {
  std::vector<std::byte> buffer(10);
  const auto op = receive(7, buffer);
  EXPECT_EQ(post(op).completed, nullptr);
  const FrameTarget target = matcher.begin_frame(frame(7, 0, 10, 0, 10));
  EXPECT_EQ(target.target, buffer.data());
  EXPECT_FALSE(target.stashed);
  const auto finished = matcher.finish_frame({7, 0}, frame(7, 0, 10, 0, 10), true);
  EXPECT_EQ(finished.completed, op.get());
  EXPECT_TRUE(finished.receive_changed);
  EXPECT_EQ(unexpected.held(), 0U);
}

TEST_F(MatcherTest, AnEarlyMessageIsKeptUntilItsReceiveIsPosted) {
  const auto finished = arrive(frame(7, 0, 10, 0, 10), std::byte{5});
  EXPECT_EQ(finished.completed, nullptr);
  EXPECT_EQ(unexpected.held(), 10U);
  std::vector<std::byte> buffer(10);
  const auto op = receive(7, buffer);
  const auto posted = post(op);
  EXPECT_EQ(posted.completed, nullptr);  // the waiting thread copies it
  ASSERT_TRUE(op->stash_to_copy);
  EXPECT_EQ(op->stash_bytes, 10U);
  EXPECT_EQ(op->stash_to_copy[9], std::byte{5});
}

TEST_F(MatcherTest, MessagesUnderOneTagMatchReceivesInOrder) {
  (void)arrive(frame(7, 1, 4, 0, 4), std::byte{2});  // the second message overtook the first
  std::vector<std::byte> first(3);
  std::vector<std::byte> second(4);
  const auto a = receive(7, first);
  const auto b = receive(7, second);
  (void)post(a);
  (void)post(b);
  EXPECT_EQ(a->sequence, 0U);
  EXPECT_EQ(b->sequence, 1U);
  EXPECT_FALSE(a->stash_to_copy);
  ASSERT_TRUE(b->stash_to_copy);
  EXPECT_EQ(arrive(frame(7, 0, 3, 0, 3), std::byte{1}).completed, a.get());
  EXPECT_EQ(first[2], std::byte{1});
}

TEST_F(MatcherTest, EarlyBytesBeyondTheCapPauseTheConnection) {
  EXPECT_EQ(matcher.begin_frame(frame(7, 0, 1001, 0, 1001)).action, FrameTarget::Action::pause);
  EXPECT_EQ(unexpected.held(), 0U);
  std::vector<std::byte> buffer(1001);
  std::optional<MessageKey> nothing_arrived;
  (void)matcher.post_receive(receive(7, buffer), nullptr, nothing_arrived);
  ASSERT_TRUE(nothing_arrived);  // the paused connection waits for exactly this message
  EXPECT_EQ(nothing_arrived->sequence, 0U);
  EXPECT_EQ(matcher.begin_frame(frame(7, 0, 1001, 0, 1001)).target, buffer.data());
}

TEST_F(MatcherTest, AReceivePostedWhileItsMessageArrivesTakesTheRestInPlace) {
  const auto header = frame(7, 0, 100, 0, 100);
  const FrameTarget target = matcher.begin_frame(header);
  ASSERT_TRUE(target.stashed);
  std::memset(target.target, 3, 40);  // 40 bytes arrived early
  std::vector<std::byte> buffer(100);
  const auto op = receive(7, buffer);
  (void)post(op);
  std::byte* rest = matcher.redirect_rest({7, 0}, header, 60);
  ASSERT_EQ(rest, buffer.data() + 40);
  std::memset(rest, 4, 60);
  const auto finished = matcher.finish_frame({7, 0}, header, false);
  EXPECT_TRUE(finished.receive_changed);
  ASSERT_TRUE(op->stash_to_copy);
  ASSERT_EQ(op->copy_ranges.size(), 1U);
  EXPECT_EQ(op->copy_ranges[0], (std::pair<std::uint64_t, std::uint64_t>{0, 40}));
  EXPECT_EQ(buffer[99], std::byte{4});
}

TEST_F(MatcherTest, ASizeMismatchFailsThatReceiveOnly) {
  std::vector<std::byte> wrong(5);
  std::vector<std::byte> right(6);
  const auto a = receive(7, wrong);
  const auto b = receive(8, right);
  (void)post(a);
  (void)post(b);
  const FrameTarget target = matcher.begin_frame(frame(7, 0, 6, 0, 6));
  EXPECT_TRUE(target.receive_failed);
  EXPECT_EQ(target.target, nullptr);  // read and dropped
  EXPECT_TRUE(a->error);
  EXPECT_EQ(arrive(frame(8, 0, 6, 0, 6), std::byte{1}).completed, b.get());
}

TEST_F(MatcherTest, OverlappingChunksAndChangingSizesAreViolations) {
  EXPECT_EQ(matcher.begin_frame(frame(7, 0, 100, 0, 60)).action, FrameTarget::Action::read);
  const FrameTarget overlap = matcher.begin_frame(frame(7, 0, 100, 50, 50));
  EXPECT_EQ(overlap.action, FrameTarget::Action::violate);
  EXPECT_EQ(overlap.violation_offset, 50U);
  EXPECT_EQ(matcher.begin_frame(frame(7, 0, 90, 60, 30)).action, FrameTarget::Action::violate);
}

TEST_F(MatcherTest, ClosingDropsWhatCannotCompleteAndKeepsWhatArrived) {
  (void)arrive(frame(7, 0, 10, 0, 10), std::byte{1});  // complete, early: kept
  (void)matcher.begin_frame(frame(8, 0, 20, 0, 10));   // half arrived: dropped
  std::vector<std::byte> buffer(4);
  const auto waiting = receive(9, buffer);
  (void)post(waiting);
  const auto lost = std::make_exception_ptr(PeerLostError("gone"));
  EXPECT_EQ(matcher.drop_incomplete(lost), 20U);
  EXPECT_TRUE(waiting->error);
  EXPECT_EQ(unexpected.held(), 10U);
  std::vector<std::byte> early(10);
  const auto op = receive(7, early);
  (void)post(op);
  EXPECT_TRUE(op->stash_to_copy);
}

}  // namespace
}  // namespace pulseloco::transport::tcp
