// Hostile input: truncations at every byte, every header field corrupted, bit flips in every
// frame (with and without valid checksums), oversized counts and lengths, and invalid content
// behind valid checksums. Each must be rejected with a ProtocolError that carries a byte offset
// inside the message, without a crash and without a single write to the caller's buffers.
// The suite also runs under ASan + UBSan (tests/codec/sanitized).
#include <gtest/gtest.h>

#include <zstd.h>

#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/codec/message.h>
#include "codec/codec_test_util.h"

namespace pulseloco::codec {
namespace {

using testing::Bytes;
using testing::Chunk;
namespace layout = testing::layout;

constexpr std::uint32_t kPoisonOffset = 0xA5A5A5A5u;
constexpr std::uint32_t kPoisonBits = 0x7FC12345u;  // a NaN payload no decoder would write

enum class Outcome { accepted, rejected };

struct Decoded {
  Outcome outcome = Outcome::accepted;
  std::string error;
  std::optional<std::uint64_t> byte_offset;
};

// Parses and decodes every frame into poisoned buffers. A rejection must be a ProtocolError
// with a byte offset inside the message and must leave the frame's buffers untouched; an
// accepted frame must satisfy every invariant the decoder promises.
Decoded decode_everything(const Bytes& message, const DecodeLimits& limits = {}) {
  Decoded result;
  std::optional<MessageView> view;
  try {
    view.emplace(MessageView::parse(message, limits));
  } catch (const ProtocolError& error) {
    result.outcome = Outcome::rejected;
    result.error = error.what();
    result.byte_offset = error.context().byte_offset;
    EXPECT_TRUE(result.byte_offset.has_value()) << error.what();
    if (result.byte_offset) {
      EXPECT_LE(*result.byte_offset, message.size()) << error.what();
    }
    return result;
  }
  DecodeScratch scratch;
  for (std::size_t i = 0; i < view->frame_count(); ++i) {
    const FrameInfo& info = view->frame(i);
    EXPECT_LE(info.entries, info.length);
    EXPECT_LE(info.byte_offset + info.byte_size, message.size());
    const auto n = static_cast<std::size_t>(info.entries);
    std::vector<std::uint32_t> offsets(n + 1, kPoisonOffset);
    std::vector<float> values(n + 1, std::bit_cast<float>(kPoisonBits));
    try {
      const std::uint64_t decoded = view->decode_frame(i, offsets, values, scratch);
      EXPECT_EQ(decoded, info.entries);
      for (std::size_t j = 0; j < n; ++j) {
        EXPECT_LT(offsets[j], info.length) << "entry " << j;
        if (j > 0) {
          EXPECT_LT(offsets[j - 1], offsets[j]) << "entry " << j;
        }
        EXPECT_TRUE(std::isfinite(values[j])) << "entry " << j;
      }
      EXPECT_EQ(offsets[n], kPoisonOffset);
      EXPECT_EQ(std::bit_cast<std::uint32_t>(values[n]), kPoisonBits);
    } catch (const ProtocolError& error) {
      result.outcome = Outcome::rejected;
      result.error = error.what();
      result.byte_offset = error.context().byte_offset;
      EXPECT_TRUE(result.byte_offset.has_value()) << error.what();
      if (result.byte_offset) {
        EXPECT_GE(*result.byte_offset, info.byte_offset) << error.what();
        EXPECT_LT(*result.byte_offset, info.byte_offset + info.byte_size) << error.what();
      }
      std::size_t written = 0;
      for (std::size_t j = 0; j <= n; ++j) {
        written += offsets[j] != kPoisonOffset ? 1 : 0;
        written += std::bit_cast<std::uint32_t>(values[j]) != kPoisonBits ? 1 : 0;
      }
      EXPECT_EQ(written, 0u) << "the decoder wrote to the output before failing: " << error.what();
      return result;
    }
  }
  return result;
}

void expect_rejected(const Bytes& message, const std::string& reason_fragment,
                     const DecodeLimits& limits = {}) {
  const Decoded decoded = decode_everything(message, limits);
  ASSERT_EQ(decoded.outcome, Outcome::rejected) << "accepted; expected: " << reason_fragment;
  EXPECT_NE(decoded.error.find(reason_fragment), std::string::npos)
      << "error '" << decoded.error << "' does not mention '" << reason_fragment << "'";
}

// ---------------------------------------------------------------------------------------------
// Valid sample messages covering every code path.

Chunk random_chunk(std::mt19937_64& rng, std::uint32_t tensor, std::uint64_t begin,
                   std::uint64_t length, double density) {
  Chunk chunk{.tensor = tensor,
              .begin = begin,
              .length = length,
              .offsets = testing::random_offsets(rng, length, density)};
  for (std::size_t i = 0; i < chunk.offsets.size(); ++i) {
    chunk.values.push_back(testing::random_value(rng));
  }
  return chunk;
}

Bytes build(const MessageHeader& header, const std::vector<Chunk>& chunks,
            const EncodeOptions& options) {
  MessageHeader h = header;
  h.encoding = options.encoding;
  Bytes message = encode_header(h, static_cast<std::uint32_t>(chunks.size()));
  for (const Chunk& chunk : chunks)
    testing::append(message, encode_frame(chunk.entries(), options));
  return message;
}

// Small messages (every byte and bit gets corrupted, so they must stay small), one per
// encoding and index coding, with compressed and raw streams and sparse and dense planes.
std::vector<std::pair<std::string, Bytes>> small_samples() {
  std::mt19937_64 rng(42);
  const MessageHeader header{.window = 5, .sender_rank = 1, .tensor_numels = {600, 40, 0}};
  std::vector<Chunk> chunks = {random_chunk(rng, 0, 0, 300, 0.3),
                               random_chunk(rng, 0, 300, 300, 0.0),
                               random_chunk(rng, 1, 0, 40, 0.5)};
  // Grid-like values so plane 0 is sparse in some frames.
  for (float& v : chunks[0].values) {
    v = std::bit_cast<float>(std::bit_cast<std::uint32_t>(v) & 0xFFFFFF00u);
  }
  std::vector<std::pair<std::string, Bytes>> samples;
  samples.emplace_back("pulse", build(header, chunks, {}));
  for (const auto coding : {IndexCoding::varint, IndexCoding::bitpack, IndexCoding::elias_fano}) {
    samples.emplace_back("pulse/" + std::string(index_coding_name(coding)),
                         build(header, chunks, {.index_coding = coding}));
  }
  samples.emplace_back("plain_i64_f32",
                       build(header, chunks, {.encoding = Encoding::plain_i64_f32}));
  samples.emplace_back("plain_i32_f32",
                       build(header, chunks, {.encoding = Encoding::plain_i32_f32}));
  return samples;
}

// A larger pulse message whose streams are zstd-compressed.
Bytes compressed_sample() {
  std::mt19937_64 rng(43);
  Chunk chunk = random_chunk(rng, 0, 0, 20000, 0.2);
  for (float& v : chunk.values)
    v = std::bit_cast<float>(std::bit_cast<std::uint32_t>(v) & 0xFFFF0000u);
  return build(MessageHeader{.tensor_numels = {20000}}, {chunk}, {});
}

TEST(CodecMalformed, SamplesAreValidAndCoverCompressionAndSparsePlanes) {
  for (const auto& [name, message] : small_samples()) {
    EXPECT_EQ(decode_everything(message).outcome, Outcome::accepted) << name;
  }
  const Bytes compressed = compressed_sample();
  EXPECT_EQ(decode_everything(compressed).outcome, Outcome::accepted);
  const MessageView view = MessageView::parse(compressed);
  const std::size_t at = view.frame(0).byte_offset;
  EXPECT_NE(static_cast<std::uint8_t>(compressed[at + layout::kFrameZstdStreams]), 0)
      << "the large sample should have compressed streams";
}

TEST(CodecMalformed, TruncatedAtEveryBytePosition) {
  auto samples = small_samples();
  samples.emplace_back("compressed", compressed_sample());
  for (const auto& [name, message] : samples) {
    SCOPED_TRACE(name);
    const MessageView whole = MessageView::parse(message);
    const std::uint64_t header_bytes = whole.frame(0).byte_offset;
    for (std::size_t size = 0; size < message.size(); ++size) {
      const Bytes truncated(message.begin(), message.begin() + static_cast<std::ptrdiff_t>(size));
      const Decoded decoded = decode_everything(truncated);
      ASSERT_EQ(decoded.outcome, Outcome::rejected) << "accepted at " << size << " bytes";
      ASSERT_NE(decoded.error.find("truncated"), std::string::npos) << decoded.error;
      // The streaming parser accepts every prefix that holds the header.
      if (size >= header_bytes) {
        const MessageView partial = MessageView::parse_prefix(truncated);
        EXPECT_FALSE(partial.complete());
        EXPECT_GT(partial.bytes_needed(), size);
      } else {
        EXPECT_THROW((void)MessageView::parse_prefix(truncated), ProtocolError);
      }
    }
  }
}

TEST(CodecMalformed, EveryHeaderFieldCorrupted) {
  const Bytes original = small_samples()[0].second;
  struct Corruption {
    const char* name;
    std::function<void(Bytes&)> apply;
    const char* reason;  // expected once the checksum is valid again
  };
  const std::vector<Corruption> corruptions = {
      {"magic byte 0", [](Bytes& m) { m[0] = std::byte{'X'}; }, "bad magic"},
      {"magic byte 3", [](Bytes& m) { m[3] = std::byte{0}; }, "bad magic"},
      {"version 0", [](Bytes& m) { testing::poke<std::uint16_t>(m, layout::kVersion, 0); },
       "unsupported format version"},
      {"version 2", [](Bytes& m) { testing::poke<std::uint16_t>(m, layout::kVersion, 2); },
       "unsupported format version"},
      {"version 3", [](Bytes& m) { testing::poke<std::uint16_t>(m, layout::kVersion, 3); },
       "unsupported format version"},
      {"version 4", [](Bytes& m) { testing::poke<std::uint16_t>(m, layout::kVersion, 4); },
       "unsupported format version"},
      {"version 5", [](Bytes& m) { testing::poke<std::uint16_t>(m, layout::kVersion, 5); },
       "unsupported format version"},
      {"version 7", [](Bytes& m) { testing::poke<std::uint16_t>(m, layout::kVersion, 7); },
       "unsupported format version"},
      {"version 6 with a version 1 encoding",
       [](Bytes& m) { testing::poke<std::uint16_t>(m, layout::kVersion, 6); },
       "is not a format version 6 encoding"},
      {"encoding 4", [](Bytes& m) { m[layout::kEncoding] = std::byte{4}; }, "unknown encoding"},
      {"encoding 3 in version 1", [](Bytes& m) { m[layout::kEncoding] = std::byte{3}; },
       "is not a format version 1 encoding"},
      {"encoding of another kind", [](Bytes& m) { m[layout::kEncoding] = std::byte{1}; },
       "differs from the message"},
      {"flags", [](Bytes& m) { m[layout::kFlags] = std::byte{1}; }, "flags"},
      {"reserved", [](Bytes& m) { testing::poke<std::uint32_t>(m, layout::kReserved, 1); },
       "reserved"},
      {"tensor count 0", [](Bytes& m) { testing::poke<std::uint32_t>(m, layout::kTensorCount, 0); },
       ""},
      {"tensor count + 1",
       [](Bytes& m) { testing::poke<std::uint32_t>(m, layout::kTensorCount, 4); }, ""},
      {"tensor count huge",
       [](Bytes& m) { testing::poke<std::uint32_t>(m, layout::kTensorCount, 0xFFFFFFFFu); },
       "tensors exceed the limit"},
      {"frame count 0", [](Bytes& m) { testing::poke<std::uint32_t>(m, layout::kFrameCount, 0); },
       "bytes after the last"},
      {"frame count - 1", [](Bytes& m) { testing::poke<std::uint32_t>(m, layout::kFrameCount, 2); },
       "bytes after the last"},
      {"frame count + 1", [](Bytes& m) { testing::poke<std::uint32_t>(m, layout::kFrameCount, 4); },
       "truncated"},
      {"frame count huge",
       [](Bytes& m) { testing::poke<std::uint32_t>(m, layout::kFrameCount, 0xFFFFFFFFu); },
       "frames exceed the limit"},
      {"numel 0 of tensor 0",
       [](Bytes& m) { testing::poke<std::uint64_t>(m, layout::kHeaderPrefix, 0); },
       "exceeds tensor"},
      {"numel of tensor 1 too small",
       [](Bytes& m) { testing::poke<std::uint64_t>(m, layout::kHeaderPrefix + 8, 39); },
       "exceeds tensor"},
      {"numel 2^63",
       [](Bytes& m) {
         testing::poke<std::uint64_t>(m, layout::kHeaderPrefix + 16, std::uint64_t{1} << 63);
       },
       "more than 2^63 - 1"},
      {"header checksum", [](Bytes& m) { m[layout::kHeaderPrefix + 3 * 8] ^= std::byte{1}; },
       "header checksum"},
  };
  for (const Corruption& c : corruptions) {
    SCOPED_TRACE(c.name);
    Bytes corrupted = original;
    c.apply(corrupted);
    // As received: the checksum (or the field check before it) rejects it.
    expect_rejected(corrupted, "");
    // With a valid checksum, the field's own validation rejects it.
    if (std::string(c.name) != "header checksum") testing::refresh_checksums(corrupted);
    expect_rejected(corrupted, c.reason);
  }
}

TEST(CodecMalformed, EveryBitFlipIsRejectedByTheChecksums) {
  for (const auto& [name, message] : small_samples()) {
    SCOPED_TRACE(name);
    for (std::size_t byte = 0; byte < message.size(); ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        Bytes flipped = message;
        flipped[byte] ^= static_cast<std::byte>(1u << bit);
        const Decoded decoded = decode_everything(flipped);
        ASSERT_EQ(decoded.outcome, Outcome::rejected) << "byte " << byte << " bit " << bit;
      }
    }
  }
}

TEST(CodecMalformed, BitFlipsBehindValidChecksumsAreRejectedOrDecodeToValidEntries) {
  // A hostile sender computes valid checksums: every flipped bit must still be caught by the
  // structural and content checks, or yield entries that satisfy every invariant.
  auto samples = small_samples();
  for (const auto& [name, message] : samples) {
    SCOPED_TRACE(name);
    std::size_t rejected = 0;
    std::size_t flips = 0;
    for (std::size_t byte = 0; byte < message.size(); ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        Bytes flipped = message;
        flipped[byte] ^= static_cast<std::byte>(1u << bit);
        testing::refresh_checksums(flipped);
        const Decoded decoded = decode_everything(flipped);
        ++flips;
        rejected += decoded.outcome == Outcome::rejected ? 1 : 0;
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
    // Value bits, window and rank bits may legitimately change; most structure bits may not.
    EXPECT_GT(rejected, flips / 10) << rejected << " of " << flips;
  }
}

// ---------------------------------------------------------------------------------------------
// Hand-built frames with valid checksums.

struct Crafted {
  MessageHeader header{.tensor_numels = {1000}};
  std::vector<Bytes> frames;
  std::optional<std::uint32_t> frame_count;
  Bytes trailing;

  [[nodiscard]] Bytes message() const {
    testing::RawHeader raw{
        .encoding = static_cast<std::uint8_t>(header.encoding),
        .numels = header.tensor_numels,
        .frame_count = frame_count.value_or(static_cast<std::uint32_t>(frames.size()))};
    Bytes out = testing::make_header(raw);
    for (const Bytes& frame : frames)
      testing::append(out, frame);
    testing::append(out, trailing);
    return out;
  }
};

const std::vector<std::uint32_t> kOffsets = {0, 3, 300, 301, 999};
const std::vector<float> kValues = {1.0f, -2.5f, 3.0e-5f, 1.0e-40f, -0.0f};

// A valid pulse frame with all streams raw; `edit` may change anything before it is sealed.
Bytes pulse_frame(
    IndexCoding coding,
    const std::function<void(testing::RawPulseStreams&, testing::RawFrame&)>& edit = {},
    std::vector<std::uint32_t> offsets = kOffsets, std::vector<float> values = kValues,
    std::uint32_t length = 1000) {
  testing::RawPulseStreams streams;
  switch (coding) {
    case IndexCoding::varint:
      streams.index = testing::varint_index(offsets);
      break;
    case IndexCoding::bitpack:
      streams.index = testing::bitpack_index(offsets);
      break;
    case IndexCoding::elias_fano:
      streams.index = testing::elias_fano_index(offsets, length);
      break;
    case IndexCoding::exponent_groups:  // context frames only: a pulse frame announcing it fails
      streams.index = testing::varint_index(offsets);
      break;
  }
  for (int k = 0; k < 4; ++k)
    streams.planes[k] = testing::plane_of(values, k);
  testing::RawFrame frame{.encoding = 0,
                          .index_coding = static_cast<std::uint8_t>(coding),
                          .length = length,
                          .entries = static_cast<std::uint32_t>(offsets.size())};
  if (edit) edit(streams, frame);
  if (frame.payload.empty()) frame.payload = testing::make_pulse_payload(streams);
  return testing::make_frame(frame);
}

Bytes plain_frame(Encoding encoding, const std::vector<std::int64_t>& indices,
                  const std::vector<float>& values, std::uint64_t begin = 0,
                  std::uint32_t length = 1000) {
  testing::RawFrame frame{.encoding = static_cast<std::uint8_t>(encoding),
                          .begin = begin,
                          .length = length,
                          .entries = static_cast<std::uint32_t>(indices.size())};
  for (const std::int64_t index : indices) {
    if (encoding == Encoding::plain_i64_f32) {
      testing::put<std::int64_t>(frame.payload, index);
    } else {
      testing::put<std::int32_t>(frame.payload, static_cast<std::int32_t>(index));
    }
  }
  for (const float v : values)
    testing::put<float>(frame.payload, v);
  return testing::make_frame(frame);
}

Bytes one_frame(const Bytes& frame, Encoding encoding = Encoding::pulse,
                std::vector<std::uint64_t> numels = {1000}) {
  Crafted crafted;
  crafted.header.encoding = encoding;
  crafted.header.tensor_numels = std::move(numels);
  crafted.frames = {frame};
  return crafted.message();
}

TEST(CodecMalformed, HandBuiltValidFramesDecode) {
  // The test's own writer agrees with the decoder: otherwise the tests below prove nothing.
  for (const auto coding : {IndexCoding::varint, IndexCoding::bitpack, IndexCoding::elias_fano}) {
    const Bytes message = one_frame(pulse_frame(coding));
    const MessageView view = MessageView::parse(message);
    DecodeScratch scratch;
    std::vector<std::uint32_t> offsets(5);
    std::vector<float> values(5);
    ASSERT_EQ(view.decode_frame(0, offsets, values, scratch), 5u);
    EXPECT_EQ(offsets, kOffsets);
    EXPECT_EQ(std::memcmp(values.data(), kValues.data(), sizeof(float) * 5), 0);
  }
  EXPECT_EQ(decode_everything(one_frame(plain_frame(Encoding::plain_i64_f32, {5, 7}, {1, 2}, 5, 10),
                                        Encoding::plain_i64_f32))
                .outcome,
            Outcome::accepted);
  EXPECT_EQ(decode_everything(one_frame(plain_frame(Encoding::plain_i32_f32, {0, 999}, {1, 2}),
                                        Encoding::plain_i32_f32))
                .outcome,
            Outcome::accepted);
}

TEST(CodecMalformed, OversizedCountsAndLengths) {
  const auto with_frame = [](const std::function<void(testing::RawFrame&)>& edit) {
    return one_frame(pulse_frame(
        IndexCoding::varint, [&](testing::RawPulseStreams&, testing::RawFrame& f) { edit(f); }));
  };
  expect_rejected(with_frame([](auto& f) { f.entries = 1001; }), "entries in a chunk of");
  expect_rejected(with_frame([](auto& f) { f.length = 0x80000001u; }), "exceeds the limit");
  expect_rejected(with_frame([](auto& f) { f.length = 1001; }), "exceeds tensor");
  expect_rejected(with_frame([](auto& f) { f.begin = 1; }), "exceeds tensor");
  expect_rejected(with_frame([](auto& f) { f.begin = ~std::uint64_t{0} - 10; }), "exceeds tensor");
  expect_rejected(with_frame([](auto& f) { f.tensor = 1; }), "not in the tensor table");
  expect_rejected(with_frame([](auto& f) {
                    f.override_payload_bytes = true;
                    f.payload_bytes = ~std::uint64_t{0};
                  }),
                  "exceeds the message size limit");
  expect_rejected(with_frame([](auto& f) {
                    f.override_payload_bytes = true;
                    f.payload_bytes = f.payload.size() + 1;
                  }),
                  "");
  expect_rejected(with_frame([](auto& f) {
                    f.override_payload_bytes = true;
                    f.payload_bytes = f.payload.size() + 1000;
                  }),
                  "truncated");
  // A frame longer than the caller's chunk cap.
  DecodeLimits small;
  small.max_frame_elements = 999;
  expect_rejected(with_frame([](auto&) {}), "exceeds the limit", small);
  // Limits on the message as a whole.
  const Bytes valid = with_frame([](auto&) {});
  DecodeLimits tiny;
  tiny.max_message_bytes = valid.size() - 1;
  expect_rejected(valid, "exceeds the limit", tiny);
  DecodeLimits no_tensors;
  no_tensors.max_tensors = 0;
  expect_rejected(valid, "tensors exceed the limit", no_tensors);
  DecodeLimits no_frames;
  no_frames.max_frames = 0;
  expect_rejected(valid, "frames exceed the limit", no_frames);
  // A header announcing more frames than the size limit could hold.
  testing::RawHeader many{.numels = {1000}, .frame_count = 1u << 24};
  DecodeLimits limit_1mb;
  limit_1mb.max_message_bytes = 1 << 20;
  expect_rejected(testing::make_header(many), "exceeds the message size limit", limit_1mb);
}

TEST(CodecMalformed, FrameOrderAndTrailingBytes) {
  Crafted crafted;
  crafted.header.tensor_numels = {2000, 1000};
  const auto frame_at = [](std::uint32_t tensor, std::uint64_t begin) {
    return pulse_frame(IndexCoding::varint, [&](auto&, testing::RawFrame& f) {
      f.tensor = tensor;
      f.begin = begin;
    });
  };
  crafted.frames = {frame_at(0, 0), frame_at(0, 1000), frame_at(1, 0)};
  EXPECT_EQ(decode_everything(crafted.message()).outcome, Outcome::accepted);
  crafted.frames = {frame_at(0, 1000), frame_at(0, 0)};
  expect_rejected(crafted.message(), "out of order or overlaps");
  crafted.frames = {frame_at(0, 0), frame_at(0, 999)};
  expect_rejected(crafted.message(), "out of order or overlaps");
  crafted.frames = {frame_at(1, 0), frame_at(0, 1000)};
  expect_rejected(crafted.message(), "out of order or overlaps");
  crafted.frames = {frame_at(0, 0), frame_at(0, 0)};
  expect_rejected(crafted.message(), "out of order or overlaps");
  crafted.frames = {frame_at(0, 0)};
  crafted.trailing = {std::byte{0}};
  expect_rejected(crafted.message(), "bytes after the last");
}

TEST(CodecMalformed, FlagsAndCodesOutOfRange) {
  const auto edit_frame = [](const std::function<void(testing::RawFrame&)>& edit) {
    return one_frame(pulse_frame(
        IndexCoding::varint, [&](testing::RawPulseStreams&, testing::RawFrame& f) { edit(f); }));
  };
  expect_rejected(edit_frame([](auto& f) { f.encoding = 1; }), "differs from the message");
  expect_rejected(edit_frame([](auto& f) { f.index_coding = 3; }), "unknown index coding");
  expect_rejected(edit_frame([](auto& f) { f.zstd_streams = 1u << 5; }), "unknown stream flags");
  expect_rejected(edit_frame([](auto& f) { f.sparse_planes = 1u << 4; }), "unknown plane flags");
  // Plain frames and empty pulse frames carry no stream flags.
  testing::RawFrame plain{.encoding = 2, .index_coding = 1, .length = 10};
  expect_rejected(one_frame(testing::make_frame(plain), Encoding::plain_i32_f32),
                  "index coding must be 0");
  testing::RawFrame empty{.encoding = 0, .zstd_streams = 1, .length = 10};
  expect_rejected(one_frame(testing::make_frame(empty)), "stream flags must be 0");
  empty.zstd_streams = 0;
  empty.sparse_planes = 1;
  expect_rejected(one_frame(testing::make_frame(empty)), "plane flags must be 0");
  empty.sparse_planes = 0;
  empty.payload = {std::byte{0}};
  expect_rejected(one_frame(testing::make_frame(empty)), "payload of 1 bytes, expected 0");
  // Plain payloads have exactly entries * (index + 4) bytes.
  testing::RawFrame short_plain{.encoding = 1, .length = 10, .entries = 2};
  short_plain.payload.resize(23);
  expect_rejected(one_frame(testing::make_frame(short_plain), Encoding::plain_i64_f32),
                  "expected 24");
}

TEST(CodecMalformed, PulseDirectoryLies) {
  using Streams = testing::RawPulseStreams;
  const auto edited = [](IndexCoding coding, const std::function<void(Streams&)>& edit) {
    return one_frame(pulse_frame(coding, [&](Streams& s, testing::RawFrame&) { edit(s); }));
  };
  const auto with_payload = [](const Bytes& payload) {
    return one_frame(pulse_frame(IndexCoding::varint,
                                 [&](Streams&, testing::RawFrame& f) { f.payload = payload; }));
  };
  // Index stream sizes impossible for 5 entries.
  expect_rejected(edited(IndexCoding::varint, [](Streams& s) { s.index.resize(4); }),
                  "cannot be 4 bytes");
  expect_rejected(edited(IndexCoding::varint, [](Streams& s) { s.index.resize(26); }),
                  "cannot be 26 bytes");
  expect_rejected(
      edited(IndexCoding::elias_fano, [](Streams& s) { s.index.push_back(std::byte{0}); }),
      "index stream of 5 entries cannot be");
  expect_rejected(edited(IndexCoding::bitpack, [](Streams& s) { s.index.resize(21 + 1); }),
                  "cannot be 22 bytes");
  // A raw plane whose size is not the entry count.
  expect_rejected(
      edited(IndexCoding::varint, [](Streams& s) { s.planes[2].push_back(std::byte{1}); }),
      "decodes to 5");
  // A sparse plane claiming more non-zero bytes than entries.
  expect_rejected(one_frame(pulse_frame(IndexCoding::varint,
                                        [](Streams& s, testing::RawFrame& f) {
                                          f.sparse_planes = 1;
                                          s.nonzero = {6};
                                          s.planes[0] = Bytes(1 + 6, std::byte{1});
                                        })),
                  "claims 6 non-zero bytes of 5");
  // Directory varints: truncated, non-canonical, beyond 64 bits.
  expect_rejected(with_payload({std::byte{0x85}}), "truncated");
  expect_rejected(with_payload({std::byte{0x85}, std::byte{0x00}}), "non-canonical varint");
  expect_rejected(with_payload(Bytes(10, std::byte{0xFF})), "varint");
  // Streams that extend past the payload, and bytes after the streams.
  Streams streams;
  streams.index = testing::varint_index(kOffsets);
  for (int k = 0; k < 4; ++k)
    streams.planes[k] = testing::plane_of(kValues, k);
  Bytes payload = testing::make_pulse_payload(streams);
  Bytes longer = payload;
  longer.push_back(std::byte{0});
  expect_rejected(with_payload(longer), "payload bytes after the streams");
  Bytes shorter = payload;
  shorter.pop_back();
  expect_rejected(with_payload(shorter), "truncated");
  // A compressed stream may not be empty.
  expect_rejected(one_frame(pulse_frame(IndexCoding::varint,
                                        [](Streams& s, testing::RawFrame& f) {
                                          f.zstd_streams = 1u << 3;
                                          s.planes[2].clear();
                                        })),
                  "compressed stream 3 is empty");
}

TEST(CodecMalformed, OffsetsOutOfRangeOrNotAscending) {
  using Streams = testing::RawPulseStreams;
  const auto with_index = [](IndexCoding coding, const Bytes& index) {
    return one_frame(pulse_frame(coding, [&](Streams& s, testing::RawFrame&) { s.index = index; }));
  };
  // varint: a gap that runs past the chunk; non-canonical and over-long gaps; leftovers.
  expect_rejected(with_index(IndexCoding::varint, testing::varint_index({0, 3, 300, 301, 1000})),
                  "is not below length 1000");
  expect_rejected(with_index(IndexCoding::varint, {std::byte{0}, std::byte{0}, std::byte{0},
                                                   std::byte{0x80}, std::byte{0x00}}),
                  "non-canonical varint");
  expect_rejected(
      with_index(IndexCoding::varint, {std::byte{0}, std::byte{0xFF}, std::byte{0xFF},
                                       std::byte{0xFF}, std::byte{0xFF}, std::byte{0x1F}}),
      "exceeds 32 bits");
  expect_rejected(with_index(IndexCoding::varint, {std::byte{0}, std::byte{0}, std::byte{0},
                                                   std::byte{0}, std::byte{0}, std::byte{0}}),
                  "bytes left after 5 gaps");
  expect_rejected(with_index(IndexCoding::varint, {std::byte{0}, std::byte{0}, std::byte{0},
                                                   std::byte{0}, std::byte{0x80}}),
                  "truncated varint");
  // bitpack: widths over 32 (a second block of one gap after 128 zero gaps, so that the
  // stream size is still plausible), offsets past the chunk, non-zero padding.
  {
    std::vector<std::uint32_t> offsets(129);
    for (std::uint32_t i = 0; i < 129; ++i)
      offsets[i] = i;
    const std::vector<float> values(129, 1.0f);
    Bytes wide = {std::byte{0}, std::byte{33}, std::byte{0}, std::byte{0},
                  std::byte{0}, std::byte{0},  std::byte{0}};
    expect_rejected(one_frame(pulse_frame(
                        IndexCoding::bitpack,
                        [&](testing::RawPulseStreams& s, testing::RawFrame&) { s.index = wide; },
                        offsets, values)),
                    "width 33 exceeds 32");
    wide[1] = std::byte{0};  // the same stream with a valid width: only the size is wrong now
    wide.resize(2);
    EXPECT_EQ(decode_everything(
                  one_frame(pulse_frame(
                      IndexCoding::bitpack,
                      [&](testing::RawPulseStreams& s, testing::RawFrame&) { s.index = wide; },
                      offsets, values)))
                  .outcome,
              Outcome::accepted);
  }
  expect_rejected(with_index(IndexCoding::bitpack, testing::bitpack_index({0, 3, 300, 301, 1000})),
                  "is not below length 1000");
  Bytes padded = testing::bitpack_index(kOffsets);  // width 10: 50 bits, 6 padding bits
  padded.back() |= std::byte{0x80};
  expect_rejected(with_index(IndexCoding::bitpack, padded), "non-zero padding bits");
  // One coding per block: a width above its widest gap's (697: 10 bits) is refused.
  Bytes wider{std::byte{11}};
  testing::BitSink sink(wider);
  for (const std::uint64_t gap : testing::gaps_of(kOffsets))
    sink.put(gap, 11);
  expect_rejected(with_index(IndexCoding::bitpack, wider), "has width 11, its widest gap needs 10");
  // Elias-Fano: equal offsets, offsets past the chunk, extra or missing high bits, padding.
  const auto ef = [](std::vector<std::uint32_t> offsets) {
    return testing::elias_fano_index(offsets, 1000);
  };
  expect_rejected(with_index(IndexCoding::elias_fano, ef({0, 3, 300, 300, 999})),
                  "does not ascend");
  Bytes past_end = ef({0, 3, 300, 301, 999});
  // l = 7: set every low bit of the last entry (999 -> 1023: high 7, low 127).
  {
    const unsigned l = testing::elias_fano_low_bits(5, 1000);
    for (unsigned b = 0; b < l; ++b) {
      const std::size_t bit = 4 * l + b;
      past_end[bit / 8] |= static_cast<std::byte>(1u << (bit % 8));
    }
  }
  expect_rejected(with_index(IndexCoding::elias_fano, past_end), "is not below length 1000");
  const unsigned l = testing::elias_fano_low_bits(5, 1000);
  const std::size_t upper_at = (5 * l + 7) / 8;
  const std::size_t upper_bits = 5 + (999 >> l);
  Bytes extra = ef(kOffsets);
  // Offsets 0, 3, 300, 301, 999 occupy upper positions 0, 1, 4, 5 and 11 (l = 7): add 10.
  ASSERT_EQ(upper_bits, 12u);
  extra[upper_at + 10 / 8] |= static_cast<std::byte>(1u << (10 % 8));
  expect_rejected(with_index(IndexCoding::elias_fano, extra), "more than 5 high parts");
  Bytes missing = ef(kOffsets);
  for (std::size_t i = upper_at; i < missing.size(); ++i)
    missing[i] = std::byte{0};
  expect_rejected(with_index(IndexCoding::elias_fano, missing), "only 0 of 5 high parts");
  Bytes upper_padding = ef(kOffsets);
  if (upper_bits % 8 != 0) {
    upper_padding.back() |= std::byte{0x80};
    expect_rejected(with_index(IndexCoding::elias_fano, upper_padding), "non-zero padding bits");
  }
  // Plain frames: out of the chunk, below begin, negative, not ascending.
  const auto plain64 = [](std::vector<std::int64_t> indices) {
    return one_frame(plain_frame(Encoding::plain_i64_f32, indices, {1, 2, 3}, 100, 50),
                     Encoding::plain_i64_f32);
  };
  expect_rejected(plain64({100, 120, 150}), "outside the chunk [100, 150)");
  expect_rejected(plain64({99, 120, 140}), "outside the chunk");
  expect_rejected(plain64({-1, 120, 140}), "index -1 is outside the chunk");
  expect_rejected(plain64({100, 120, 120}), "does not ascend");
  const auto plain32 = [](std::vector<std::int64_t> indices) {
    return one_frame(plain_frame(Encoding::plain_i32_f32, indices, {1, 2, 3}, 0, 50),
                     Encoding::plain_i32_f32);
  };
  expect_rejected(plain32({0, 10, 50}), "not below the chunk length 50");
  expect_rejected(plain32({-5, 10, 20}), "offset -5");
  expect_rejected(plain32({3, 2, 20}), "does not ascend");
}

TEST(CodecMalformed, NonFiniteValues) {
  for (const std::uint32_t bad :
       {0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7F800001u, 0xFFFFFFFFu}) {
    SCOPED_TRACE(bad);
    std::vector<float> values = kValues;
    values[3] = std::bit_cast<float>(bad);
    for (const auto coding : {IndexCoding::varint, IndexCoding::bitpack, IndexCoding::elias_fano}) {
      const Bytes message = one_frame(pulse_frame(coding, {}, kOffsets, values));
      expect_rejected(message, "entry 3: value is not finite");
      try {
        const MessageView view = MessageView::parse(message);
        DecodeScratch scratch;
        std::vector<std::uint32_t> o(5);
        std::vector<float> v(5);
        (void)view.decode_frame(0, o, v, scratch);
      } catch (const ProtocolError& error) {
        EXPECT_EQ(error.context().index, std::optional<std::uint64_t>(301)) << error.what();
      }
    }
    expect_rejected(one_frame(plain_frame(Encoding::plain_i64_f32, {0, 1, 2},
                                          {1, std::bit_cast<float>(bad), 2}),
                              Encoding::plain_i64_f32),
                    "entry 1: value is not finite");
    expect_rejected(one_frame(plain_frame(Encoding::plain_i32_f32, {0, 1, 2},
                                          {1, 2, std::bit_cast<float>(bad)}),
                              Encoding::plain_i32_f32),
                    "entry 2: value is not finite");
  }
}

TEST(CodecMalformed, SparsePlaneLies) {
  using Streams = testing::RawPulseStreams;
  // Values whose plane 0 is all zero except entry 2.
  std::vector<float> values = {1.0f, 2.0f, std::bit_cast<float>(0x3F800001u), 4.0f, 5.0f};
  const auto sparse = [&](const std::function<void(Bytes&, std::uint64_t&)>& edit) {
    return one_frame(pulse_frame(
        IndexCoding::varint,
        [&](Streams& s, testing::RawFrame& f) {
          std::uint64_t nonzero = 0;
          Bytes plane = testing::sparse_of(s.planes[0], &nonzero);
          edit(plane, nonzero);
          s.planes[0] = plane;
          s.nonzero = {nonzero};
          f.sparse_planes = 1;
        },
        kOffsets, values));
  };
  EXPECT_EQ(decode_everything(sparse([](Bytes&, std::uint64_t&) {})).outcome, Outcome::accepted);
  expect_rejected(sparse([](Bytes& p, std::uint64_t&) { p[0] |= std::byte{0x01}; }), "");
  // Marking entry 0 and listing its byte is a different, valid value.
  EXPECT_EQ(decode_everything(sparse([](Bytes& p, std::uint64_t& n) {
              p[0] |= std::byte{0x01};
              p.insert(p.begin() + 1, std::byte{7});
              ++n;
            })).outcome,
            Outcome::accepted);
  expect_rejected(sparse([](Bytes& p, std::uint64_t& n) {
                    p[0] |= std::byte{0x20};  // padding bit (5 entries use bits 0..4)
                    p.push_back(std::byte{1});
                    ++n;
                  }),
                  "non-zero padding bits");
  expect_rejected(sparse([](Bytes& p, std::uint64_t& n) {
                    p[0] |= std::byte{0x01};
                    p.insert(p.begin() + 1, std::byte{0});
                    ++n;
                  }),
                  "lists a zero byte");
  expect_rejected(sparse([](Bytes& p, std::uint64_t& n) {
                    p.push_back(std::byte{9});
                    ++n;
                  }),
                  "marks 1 non-zero bytes, the directory 2");
}

Bytes zstd_frame(const Bytes& content, bool with_size = true) {
  Bytes out(ZSTD_compressBound(content.size()) + 64);
  ZSTD_CCtx* cctx = ZSTD_createCCtx();
  ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, with_size ? 1 : 0);
  const std::size_t size =
      with_size ? ZSTD_compress2(cctx, out.data(), out.size(), content.data(), content.size())
                : [&] {
                    ZSTD_outBuffer o{out.data(), out.size(), 0};
                    ZSTD_inBuffer i{content.data(), content.size(), 0};
                    (void)ZSTD_compressStream2(cctx, &o, &i, ZSTD_e_end);
                    return o.pos;
                  }();
  ZSTD_freeCCtx(cctx);
  out.resize(size);
  return out;
}

TEST(CodecMalformed, HostileZstdStreams) {
  using Streams = testing::RawPulseStreams;
  const Bytes plane3 = testing::plane_of(kValues, 3);
  const auto with_plane3 = [](const Bytes& stored) {
    return one_frame(pulse_frame(IndexCoding::varint, [&](Streams& s, testing::RawFrame& f) {
      f.zstd_streams = 1u << 4;
      s.planes[3] = stored;
    }));
  };
  // The valid form first.
  EXPECT_EQ(decode_everything(with_plane3(zstd_frame(plane3))).outcome, Outcome::accepted);
  // Garbage, a frame of the wrong content size, one without a content size, two frames, a
  // frame followed by garbage, a truncated frame, a skippable frame.
  expect_rejected(with_plane3(Bytes(12, std::byte{0x42})), "value plane 3");
  Bytes six = plane3;
  six.push_back(std::byte{1});
  expect_rejected(with_plane3(zstd_frame(six)), "declares 6 bytes, expected 5");
  expect_rejected(with_plane3(zstd_frame(plane3, false)), "does not declare its content size");
  Bytes two = zstd_frame(plane3);
  testing::append(two, zstd_frame(plane3));
  expect_rejected(with_plane3(two), "zstd frame is");
  Bytes tail = zstd_frame(plane3);
  tail.push_back(std::byte{0});
  expect_rejected(with_plane3(tail), "zstd frame is");
  Bytes cut = zstd_frame(plane3);
  cut.pop_back();
  expect_rejected(with_plane3(cut), "value plane 3");
  Bytes skippable(8 + 5);
  testing::poke<std::uint32_t>(skippable, 0, 0x184D2A50u);
  testing::poke<std::uint32_t>(skippable, 4, 5);
  expect_rejected(with_plane3(skippable), "value plane 3");
  // An index stream of `raw_size` bytes stored as `packed` (bit 0 of zstd_streams set).
  const auto with_packed_index = [](std::size_t raw_size, const Bytes& packed) {
    return one_frame(pulse_frame(IndexCoding::varint, [&](Streams& s, testing::RawFrame& f) {
      f.zstd_streams = 1;
      // Directory: raw size of the index, then stored sizes.
      Bytes payload;
      testing::put_leb128(payload, raw_size);
      testing::put_leb128(payload, packed.size());
      for (int k = 0; k < 4; ++k)
        testing::put_leb128(payload, s.planes[k].size());
      testing::append(payload, packed);
      for (int k = 0; k < 4; ++k)
        testing::append(payload, s.planes[k]);
      f.payload = payload;
    }));
  };
  // A valid zstd frame whose content is invalid: the index stream decompresses to bytes with
  // an offset past the chunk.
  const Bytes bad_index = testing::varint_index({0, 3, 300, 301, 1000});
  expect_rejected(with_packed_index(bad_index.size(), zstd_frame(bad_index)),
                  "is not below length 1000");
  // A legacy (zstd v0.7) frame holding a valid index stream (offsets 0-4: five zero gaps), which
  // a libzstd built with legacy support would decode: not the format's RFC 8878 frame.
  const Bytes five_zero_gaps(5, std::byte{0});
  EXPECT_EQ(decode_everything(with_packed_index(5, zstd_frame(five_zero_gaps))).outcome,
            Outcome::accepted);
  Bytes legacy = testing::bytes_of({0x27, 0xB5, 0x2F, 0xFD, 0x20, 0x05, 0x40, 0x00, 0x05});
  testing::append(legacy, five_zero_gaps);
  testing::append(legacy, testing::bytes_of({0xC0, 0x00, 0x00}));
  expect_rejected(with_packed_index(5, legacy), "RFC 8878 magic");
}

// A pulse frame of `n` consecutive entries (chunk and tensor of n elements), every value 1.0f,
// every stream compressed as RLE blocks; `plane3` replaces the stored value plane 3.
Bytes dense_rle_message(std::uint32_t n, std::optional<Bytes> plane3 = std::nullopt) {
  // Varint gaps of consecutive offsets are zero bytes; 1.0f is the bytes 00 00 80 3F.
  const std::array<std::uint8_t, 5> fill = {0x00, 0x00, 0x00, 0x80, 0x3F};
  std::array<Bytes, 5> stored;
  for (std::size_t s = 0; s < stored.size(); ++s)
    stored[s] = testing::rle_zstd_frame(fill[s], n, n);
  if (plane3) stored[4] = *plane3;
  testing::RawFrame frame{.encoding = 0, .zstd_streams = 0x1F, .length = n, .entries = n};
  testing::put_leb128(frame.payload, n);  // the raw index stream: n varint bytes
  for (const Bytes& stream : stored)
    testing::put_leb128(frame.payload, stream.size());
  for (const Bytes& stream : stored)
    testing::append(frame.payload, stream);
  return one_frame(testing::make_frame(frame), Encoding::pulse, {n});
}

TEST(CodecMalformed, AFrameMayAnnounceOnlyWhatItsBytesCanHold) {
  constexpr std::uint32_t n = 1u << 20;
  // Valid: five zstd frames of 46 bytes each decode to 2^20 entries. A reader that checks
  // frames against its own chunks (the engine) decodes it...
  const Bytes valid = dense_rle_message(n);
  ASSERT_LT(valid.size(), 400u);
  const Decoded decoded = decode_everything(valid);
  EXPECT_EQ(decoded.outcome, Outcome::accepted) << decoded.error;
  // ...a reader without a model (a file given to inspect) refuses it before decoding: 2^20
  // entries are more than 2^16 + 8 per byte of its frame.
  expect_rejected(valid, "per frame byte", DecodeLimits::for_file());
  // A zstd frame that declares more than 32 KiB per byte it stores is refused before anything
  // is allocated for its content, by every reader.
  expect_rejected(dense_rle_message(n, testing::rle_zstd_frame(0x3F, 5, n)), "bytes cannot hold");
  // Frames within the bound decode under the file limits: the same frame of 2^16 entries.
  const Bytes small = dense_rle_message(1u << 16);
  const Decoded small_decoded = decode_everything(small, DecodeLimits::for_file());
  EXPECT_EQ(small_decoded.outcome, Outcome::accepted) << small_decoded.error;
}

TEST(CodecMalformed, OutputTooSmallIsACallerErrorAndWritesNothing) {
  const Bytes message = one_frame(pulse_frame(IndexCoding::varint));
  const MessageView view = MessageView::parse(message);
  DecodeScratch scratch;
  std::vector<std::uint32_t> offsets(4, kPoisonOffset);
  std::vector<float> values(5, 0.0f);
  EXPECT_THROW((void)view.decode_frame(0, offsets, values, scratch), InvalidArgument);
  for (const std::uint32_t o : offsets)
    EXPECT_EQ(o, kPoisonOffset);
  EXPECT_THROW((void)view.decode_frame(1, offsets, values, scratch), std::out_of_range);
}

}  // namespace
}  // namespace pulseloco::codec
