// MessageReader, the frame-by-frame reader of messages that are not held whole: it reads what
// MessageView reads, fails where it fails, and never reads more than one piece of a frame before
// the frame's checksum matched, whatever the message announces.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/codec/message_reader.h>
#include "codec/codec_test_util.h"

namespace pulseloco::codec {
namespace {

using testing::Bytes;

// A message of `size` bytes whose first bytes are `bytes` and the rest zeros (a sparse file),
// read through a callback that records the largest single read.
struct VirtualMessage {
  Bytes bytes;
  std::uint64_t size = 0;
  std::uint64_t largest_read = 0;
  std::uint64_t bytes_read = 0;

  MessageReader::ReadAt read_at() {
    return [this](std::uint64_t offset, std::span<std::byte> destination) {
      ASSERT_LE(offset + destination.size(), size) << "a read beyond the message";
      largest_read = std::max<std::uint64_t>(largest_read, destination.size());
      bytes_read += destination.size();
      std::fill(destination.begin(), destination.end(), std::byte{0});
      if (offset < bytes.size()) {
        const std::size_t n = std::min<std::size_t>(destination.size(), bytes.size() - offset);
        std::memcpy(destination.data(), bytes.data() + offset, n);
      }
    };
  }
  MessageReader reader() { return MessageReader(read_at(), size, DecodeLimits::for_file()); }
};

VirtualMessage whole(const Bytes& bytes) {
  return {.bytes = bytes, .size = bytes.size()};
}

struct ReadFrame {
  FrameInfo info;
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
  std::string error;  // empty when it decoded
};

// Every frame through the reader; structural errors escape.
std::vector<ReadFrame> read_every_frame(MessageReader& reader) {
  std::vector<ReadFrame> frames;
  DecodeScratch scratch;
  while (const auto announced = reader.next_frame()) {
    ReadFrame frame{.info = *announced};
    try {
      frame.info = reader.decode_frame(frame.offsets, frame.values, scratch);
    } catch (const ProtocolError& error) {
      frame.error = error.what();
    }
    frames.push_back(std::move(frame));
  }
  return frames;
}

// What MessageView::parse throws for `bytes`, or "" when it parses.
std::string view_error(const Bytes& bytes) {
  try {
    (void)MessageView::parse(bytes, DecodeLimits::for_file());
  } catch (const ProtocolError& error) {
    return error.what();
  }
  return {};
}

// What reading `bytes` frame by frame throws, or "".
std::string reader_error(const Bytes& bytes) {
  try {
    VirtualMessage message = whole(bytes);
    MessageReader reader = message.reader();
    (void)read_every_frame(reader);
  } catch (const ProtocolError& error) {
    return error.what();
  }
  return {};
}

Bytes random_message(Encoding encoding, std::uint64_t chunk_length, double density,
                     std::uint32_t seed) {
  std::mt19937_64 rng(seed);
  const MessageHeader header{
      .window = 9, .sender_rank = 2, .encoding = encoding, .tensor_numels = {3 * chunk_length, 10}};
  std::vector<testing::Chunk> chunks;
  for (std::uint64_t begin = 0; begin < 3 * chunk_length; begin += chunk_length) {
    chunks.push_back({.tensor = 0,
                      .begin = begin,
                      .length = chunk_length,
                      .offsets = testing::random_offsets(rng, chunk_length, density)});
  }
  chunks.push_back({.tensor = 1, .begin = 0, .length = 10});  // an empty frame
  Bytes out = encode_header(header, static_cast<std::uint32_t>(chunks.size()));
  for (auto& chunk : chunks) {
    for (std::size_t i = 0; i < chunk.offsets.size(); ++i)
      chunk.values.push_back(testing::random_value(rng));
    testing::append(out, encode_frame(chunk.entries(), {.encoding = encoding}));
  }
  return out;
}

TEST(MessageReader, ReadsWhatMessageViewReadsInEveryEncoding) {
  for (const Encoding encoding :
       {Encoding::pulse, Encoding::plain_i64_f32, Encoding::plain_i32_f32}) {
    SCOPED_TRACE(std::string(encoding_name(encoding)));
    const Bytes bytes = random_message(encoding, 5000, 0.05, 3);
    const MessageView view = MessageView::parse(bytes, DecodeLimits::for_file());
    VirtualMessage message = whole(bytes);
    MessageReader reader = message.reader();
    EXPECT_EQ(reader.header(), view.header());
    EXPECT_EQ(reader.announced_frame_count(), view.frame_count());
    EXPECT_EQ(reader.header_bytes(), view.frame(0).byte_offset);
    const std::vector<ReadFrame> frames = read_every_frame(reader);
    ASSERT_EQ(frames.size(), view.frame_count());
    DecodeScratch scratch;
    for (std::size_t i = 0; i < frames.size(); ++i) {
      const FrameInfo& expected = view.frame(i);
      EXPECT_EQ(frames[i].error, "") << "frame " << i;
      EXPECT_EQ(frames[i].info.byte_offset, expected.byte_offset);
      EXPECT_EQ(frames[i].info.byte_size, expected.byte_size);
      EXPECT_EQ(frames[i].info.entries, expected.entries);
      EXPECT_EQ(frames[i].info.index_bytes, expected.index_bytes);
      EXPECT_EQ(frames[i].info.value_bytes, expected.value_bytes);
      std::vector<std::uint32_t> offsets(expected.entries);
      std::vector<float> values(expected.entries);
      (void)view.decode_frame(i, offsets, values, scratch);
      EXPECT_EQ(frames[i].offsets, offsets);
      ASSERT_EQ(frames[i].values.size(), values.size());
      EXPECT_TRUE(values.empty() ||
                  std::memcmp(frames[i].values.data(), values.data(), 4 * values.size()) == 0);
    }
    // Every frame is smaller than a piece: no read is larger.
    EXPECT_LE(message.largest_read, MessageReader::kReadPieceBytes);
  }
}

TEST(MessageReader, AFrameLargerThanAPieceIsVerifiedInPiecesThenDecoded) {
  // A plain frame of 2^18 entries: 3 MiB, three pieces.
  const Bytes bytes = random_message(Encoding::plain_i64_f32, 1u << 18, 1.0, 5);
  ASSERT_GT(bytes.size(), 3 * MessageReader::kReadPieceBytes);
  VirtualMessage message = whole(bytes);
  MessageReader reader = message.reader();
  const std::vector<ReadFrame> frames = read_every_frame(reader);
  ASSERT_EQ(frames.size(), 4u);
  for (const ReadFrame& frame : frames) {
    EXPECT_EQ(frame.error, "");
    EXPECT_EQ(frame.offsets.size(), frame.info.entries);
  }
  EXPECT_EQ(frames[0].info.entries, std::uint64_t{1} << 18);

  // One flipped byte in the middle of the first frame: it does not decode, the others do.
  Bytes flipped = bytes;
  flipped[frames[0].info.byte_offset + frames[0].info.byte_size / 2] ^= std::byte{0x01};
  VirtualMessage damaged = whole(flipped);
  MessageReader damaged_reader = damaged.reader();
  const std::vector<ReadFrame> read = read_every_frame(damaged_reader);
  ASSERT_EQ(read.size(), 4u);
  EXPECT_NE(read[0].error.find("frame 0: checksum mismatch"), std::string::npos) << read[0].error;
  EXPECT_TRUE(read[0].offsets.empty()) << "outputs sized before the checksum matched";
  for (std::size_t i = 1; i < read.size(); ++i)
    EXPECT_EQ(read[i].error, "") << "frame " << i;
}

// A message of 512 MiB that is all zeros after a valid header and one frame prefix announcing
// all of it: the reader hashes it piece by piece and never holds more than a piece.
TEST(MessageReader, AFrameThatAnnouncesHundredsOfMegabytesCostsOnePieceUntilItsChecksumMatches) {
  constexpr std::uint64_t size = std::uint64_t{512} << 20;
  const MessageHeader header{.tensor_numels = {std::uint64_t{1} << 31}};
  Bytes bytes = encode_header(header, 1);
  testing::RawFrame frame{.encoding = 0, .length = 1u << 31, .entries = 1000};
  frame.override_payload_bytes = true;
  frame.payload_bytes = size - bytes.size() - kFramePrefixBytes - kChecksumBytes;
  Bytes prefix = testing::make_frame(frame);
  prefix.resize(kFramePrefixBytes);  // the rest is the zeros of the virtual message
  testing::append(bytes, prefix);
  VirtualMessage message{.bytes = bytes, .size = size};
  MessageReader reader = message.reader();
  const std::vector<ReadFrame> frames = read_every_frame(reader);
  ASSERT_EQ(frames.size(), 1u);
  EXPECT_NE(frames[0].error.find("frame 0: checksum mismatch"), std::string::npos)
      << frames[0].error;
  EXPECT_LE(message.largest_read, MessageReader::kReadPieceBytes);
  EXPECT_GE(message.bytes_read, size - bytes.size());
}

TEST(MessageReader, FailsWhereMessageViewFailsWithTheSameReason) {
  const Bytes valid = random_message(Encoding::pulse, 5000, 0.05, 7);
  const MessageView view = MessageView::parse(valid, DecodeLimits::for_file());
  std::vector<std::pair<std::string, Bytes>> cases;
  Bytes foreign = valid;
  foreign[0] = std::byte{'X'};
  cases.emplace_back("bad magic", foreign);
  cases.emplace_back("a header cut short", Bytes(valid.begin(), valid.begin() + 20));
  cases.emplace_back("a tensor table cut short", Bytes(valid.begin(), valid.begin() + 40));
  cases.emplace_back("a frame cut short", Bytes(valid.begin(), valid.end() - 3));
  cases.emplace_back("a frame prefix cut short",
                     Bytes(valid.begin(), valid.begin() + view.frame(1).byte_offset + 10));
  Bytes trailing = valid;
  trailing.push_back(std::byte{0});
  cases.emplace_back("a byte after the last frame", trailing);
  Bytes beyond = valid;  // frame 1 announces a payload past the end of the message
  testing::poke<std::uint64_t>(beyond, view.frame(1).byte_offset + kFramePrefixBytes - 8,
                               std::uint64_t{1} << 32);
  cases.emplace_back("a frame beyond the message", beyond);
  Bytes unordered = random_message(Encoding::plain_i32_f32, 5000, 0.01, 8);
  const MessageView unordered_view = MessageView::parse(unordered, DecodeLimits::for_file());
  testing::poke<std::uint64_t>(unordered, unordered_view.frame(1).byte_offset + 8, 0);  // begin
  testing::refresh_checksums(unordered);
  cases.emplace_back("frames out of order", unordered);
  for (const auto& [what, bytes] : cases) {
    const std::string expected = view_error(bytes);
    ASSERT_NE(expected, "") << what;
    EXPECT_EQ(reader_error(bytes), expected) << what;
  }
}

}  // namespace
}  // namespace pulseloco::codec
