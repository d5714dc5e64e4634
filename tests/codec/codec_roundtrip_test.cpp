// Round trips: every encoding, index coding and zstd level returns the same indices and the
// same value bits, on random and adversarial messages; plus the encoder's argument checks,
// determinism, streaming parses and golden bytes pinning the documented layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
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

struct Config {
  Encoding encoding = Encoding::pulse;
  std::optional<IndexCoding> index_coding;
  int zstd_level = 0;
};

std::string config_name(const Config& c) {
  std::string name(encoding_name(c.encoding));
  if (c.index_coding) name += "/" + std::string(index_coding_name(*c.index_coding));
  if (c.zstd_level != 0) name += "/zstd" + std::to_string(c.zstd_level);
  return name;
}

std::vector<Config> all_configs() {
  std::vector<Config> configs = {{Encoding::pulse, std::nullopt, 0},
                                 {Encoding::plain_i64_f32, std::nullopt, 0},
                                 {Encoding::plain_i32_f32, std::nullopt, 0}};
  for (const auto coding : {IndexCoding::varint, IndexCoding::bitpack, IndexCoding::elias_fano}) {
    configs.push_back({Encoding::pulse, coding, 0});
  }
  configs.push_back({Encoding::pulse, std::nullopt, 3});
  configs.push_back({Encoding::pulse, std::nullopt, kMaxZstdLevel});
  return configs;
}

Bytes encode_message(const MessageHeader& header, const std::vector<Chunk>& chunks,
                     const Config& config) {
  MessageHeader h = header;
  h.encoding = config.encoding;
  Bytes message = encode_header(h, static_cast<std::uint32_t>(chunks.size()));
  const EncodeOptions options{.encoding = config.encoding,
                              .zstd_level = config.zstd_level,
                              .index_coding = config.index_coding};
  for (const Chunk& chunk : chunks)
    testing::append(message, encode_frame(chunk.entries(), options));
  return message;
}

// Encodes, parses and decodes; every frame must come back bit for bit.
void expect_round_trip(const MessageHeader& header, const std::vector<Chunk>& chunks,
                       const Config& config) {
  SCOPED_TRACE(config_name(config));
  const Bytes message = encode_message(header, chunks, config);
  const MessageView view = MessageView::parse(message);
  EXPECT_EQ(view.header().window, header.window);
  EXPECT_EQ(view.header().sender_rank, header.sender_rank);
  EXPECT_EQ(view.header().encoding, config.encoding);
  EXPECT_EQ(view.header().tensor_numels, header.tensor_numels);
  ASSERT_EQ(view.frame_count(), chunks.size());
  ASSERT_TRUE(view.complete());
  EXPECT_EQ(view.bytes_needed(), message.size());
  DecodeScratch scratch;
  std::uint64_t offset = view.frame_count() == 0 ? message.size() : view.frame(0).byte_offset;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    SCOPED_TRACE("frame " + std::to_string(i));
    const Chunk& chunk = chunks[i];
    const FrameInfo& info = view.frame(i);
    EXPECT_EQ(info.tensor, chunk.tensor);
    EXPECT_EQ(info.begin, chunk.begin);
    EXPECT_EQ(info.length, chunk.length);
    EXPECT_EQ(info.entries, chunk.offsets.size());
    EXPECT_EQ(info.encoding, config.encoding);
    EXPECT_EQ(info.byte_offset, offset);
    offset += info.byte_size;
    EXPECT_LE(info.index_bytes + info.value_bytes + kFramePrefixBytes + kChecksumBytes,
              info.byte_size);
    if (config.encoding == Encoding::pulse && config.index_coding && !chunk.offsets.empty()) {
      EXPECT_EQ(info.index_coding, *config.index_coding);
    }
    // Poison the outputs (one spare slot each) to see exactly what the decoder writes.
    std::vector<std::uint32_t> offsets(chunk.offsets.size() + 1, 0xDEADBEEFu);
    std::vector<float> values(chunk.values.size() + 1, -1234.5f);
    ASSERT_EQ(view.decode_frame(i, offsets, values, scratch), chunk.offsets.size());
    EXPECT_EQ(offsets.back(), 0xDEADBEEFu) << "wrote past the entries";
    EXPECT_EQ(values.back(), -1234.5f) << "wrote past the entries";
    offsets.pop_back();
    values.pop_back();
    EXPECT_EQ(offsets, chunk.offsets);
    ASSERT_EQ(values.size(), chunk.values.size());
    EXPECT_EQ(std::memcmp(values.data(), chunk.values.data(), values.size() * sizeof(float)), 0)
        << "value bits differ";
  }
  EXPECT_EQ(offset, message.size());
}

void expect_round_trip_all(const MessageHeader& header, const std::vector<Chunk>& chunks) {
  for (const Config& config : all_configs())
    expect_round_trip(header, chunks, config);
}

Chunk make_chunk(std::uint32_t tensor, std::uint64_t begin, std::uint64_t length,
                 std::vector<std::uint32_t> offsets, std::mt19937_64& rng) {
  Chunk chunk{.tensor = tensor, .begin = begin, .length = length, .offsets = std::move(offsets)};
  for (std::size_t i = 0; i < chunk.offsets.size(); ++i) {
    chunk.values.push_back(testing::random_value(rng));
  }
  return chunk;
}

TEST(CodecRoundTrip, EmptyMessageAndEmptyTensors) {
  std::mt19937_64 rng(1);
  // No tensors, no frames.
  expect_round_trip_all(MessageHeader{.window = 3, .sender_rank = 1}, {});
  // A zero-element tensor, an empty chunk of a real tensor, a chunk of length 0.
  const MessageHeader header{.window = 7, .sender_rank = 2, .tensor_numels = {0, 100, 5}};
  expect_round_trip_all(header, {make_chunk(0, 0, 0, {}, rng), make_chunk(1, 0, 100, {}, rng),
                                 make_chunk(2, 0, 5, {}, rng)});
}

TEST(CodecRoundTrip, OneEntry) {
  std::mt19937_64 rng(2);
  const MessageHeader header{.tensor_numels = {1, 1000}};
  for (const std::uint32_t where : {0u, 1u, 500u, 999u}) {
    SCOPED_TRACE(where);
    expect_round_trip_all(header,
                          {make_chunk(0, 0, 1, {0}, rng), make_chunk(1, 0, 1000, {where}, rng)});
  }
}

TEST(CodecRoundTrip, EveryElementSetAndDenseRuns) {
  std::mt19937_64 rng(3);
  const std::uint64_t length = 70000;
  std::vector<std::uint32_t> all(length);
  std::iota(all.begin(), all.end(), 0u);
  std::vector<std::uint32_t> runs;
  for (std::uint32_t start = 17; start + 3000 < length; start += 9000) {
    for (std::uint32_t i = 0; i < 3000; ++i)
      runs.push_back(start + i);
  }
  const MessageHeader header{.tensor_numels = {length, 2 * length}};
  expect_round_trip_all(header,
                        {make_chunk(0, 0, length, all, rng), make_chunk(1, 0, length, runs, rng),
                         make_chunk(1, length, length, all, rng)});
  // Every element set with one repeated value: zstd shrinks this to almost nothing, and the
  // decoder must still produce every entry.
  Chunk constant = make_chunk(0, 0, length, all, rng);
  std::fill(constant.values.begin(), constant.values.end(), 1.5f);
  expect_round_trip_all(MessageHeader{.tensor_numels = {length}}, {constant});
}

TEST(CodecRoundTrip, LargestGapsAndTheLargestChunk) {
  std::mt19937_64 rng(4);
  const std::uint64_t length = kMaxFrameElements;  // 2^31 elements, offsets up to 2^31 - 1
  const auto last = static_cast<std::uint32_t>(length - 1);
  const MessageHeader header{.tensor_numels = {length}};
  for (const auto& offsets : std::vector<std::vector<std::uint32_t>>{
           {0, last}, {last}, {0}, {0, 1, last - 1, last}, {1u << 30, last}}) {
    expect_round_trip_all(header, {make_chunk(0, 0, length, offsets, rng)});
  }
}

TEST(CodecRoundTrip, TensorsLargerThan2To31Elements) {
  // A 5e9-element tensor: chunks beyond 2^31 and 2^32 use 64-bit tensor indices (only the
  // sparse entries are materialised).
  std::mt19937_64 rng(5);
  const std::uint64_t numel = 5'000'000'000ull;
  const MessageHeader header{.window = 1u << 20, .tensor_numels = {3, numel}};
  const std::uint64_t chunk = kMaxFrameElements;
  std::vector<Chunk> chunks = {make_chunk(0, 0, 3, {0, 2}, rng)};
  for (std::uint64_t begin = 0; begin < numel; begin += chunk) {
    const std::uint64_t length = std::min(chunk, numel - begin);
    std::vector<std::uint32_t> offsets = {0};
    for (std::uint64_t o = 12345; o + 1 < length; o += 1 + rng() % 50'000'000) {
      offsets.push_back(static_cast<std::uint32_t>(o));
    }
    offsets.push_back(static_cast<std::uint32_t>(length - 1));
    chunks.push_back(make_chunk(1, begin, length, offsets, rng));
  }
  ASSERT_GE(chunks.back().begin, std::uint64_t{1} << 32);
  expect_round_trip_all(header, chunks);

  // plain_i64_f32 carries the tensor index itself: check the bytes of the last chunk.
  const Bytes frame = encode_frame(chunks.back().entries(), {.encoding = Encoding::plain_i64_f32});
  const auto first_index = testing::peek<std::int64_t>(frame, testing::layout::kFramePrefix);
  EXPECT_EQ(static_cast<std::uint64_t>(first_index),
            chunks.back().begin + chunks.back().offsets[0]);
}

TEST(CodecRoundTrip, ExtremeValues) {
  const std::vector<std::uint32_t> patterns = {0x00000000u, 0x80000000u, 0x00000001u, 0x80000001u,
                                               0x007FFFFFu, 0x807FFFFFu, 0x00800000u, 0x7F7FFFFFu,
                                               0xFF7FFFFFu, 0x3F800000u, 0x7F000000u, 0x00400000u};
  Chunk chunk{.tensor = 0, .begin = 0, .length = 4096};
  for (std::size_t i = 0; i < 4096 && chunk.offsets.size() < 1200; i += 3) {
    chunk.offsets.push_back(static_cast<std::uint32_t>(i));
    float value;
    std::memcpy(&value, &patterns[chunk.offsets.size() % patterns.size()], sizeof value);
    chunk.values.push_back(value);
  }
  expect_round_trip_all(MessageHeader{.tensor_numels = {4096}}, {chunk});
}

// Many random messages: random tensor tables, chunkings, densities and value kinds.
TEST(CodecRoundTrip, RandomMessages) {
  std::mt19937_64 rng(6);
  for (int trial = 0; trial < 40; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    MessageHeader header{.window = rng(), .sender_rank = static_cast<std::uint32_t>(rng())};
    std::vector<Chunk> chunks;
    const int tensors = 1 + static_cast<int>(rng() % 5);
    for (int t = 0; t < tensors; ++t) {
      const std::uint64_t numel = rng() % 3 == 0 ? rng() % 64 : rng() % 40000;
      header.tensor_numels.push_back(numel);
      const std::uint64_t chunk_size = 1 + rng() % 20000;
      for (std::uint64_t begin = 0; begin < numel; begin += chunk_size) {
        const std::uint64_t length = std::min(chunk_size, numel - begin);
        static constexpr double kDensities[] = {0.0, 0.001, 0.014, 0.03, 0.2, 0.7, 1.0};
        const double density = kDensities[rng() % std::size(kDensities)];
        chunks.push_back(make_chunk(static_cast<std::uint32_t>(t), begin, length,
                                    testing::random_offsets(rng, length, density), rng));
      }
    }
    expect_round_trip_all(header, chunks);
  }
}

TEST(CodecRoundTrip, MostlyZeroPlanesUseTheSparseFormAndRoundTrip) {
  // Values on a coarse grid: the low mantissa byte is zero for most entries.
  std::mt19937_64 rng(7);
  Chunk chunk{.tensor = 0, .begin = 0, .length = 100000};
  chunk.offsets = testing::random_offsets(rng, chunk.length, 0.05);
  for (std::size_t i = 0; i < chunk.offsets.size(); ++i) {
    const std::uint32_t bits =
        0x37000000u | (static_cast<std::uint32_t>(rng()) & 0x7FFF00u) | (i % 9 == 0 ? 0x80u : 0u);
    float value;
    std::memcpy(&value, &bits, sizeof value);
    chunk.values.push_back(value);
  }
  const Bytes frame = encode_frame(chunk.entries(), {});
  EXPECT_EQ(static_cast<std::uint8_t>(frame[testing::layout::kFrameSparsePlanes]) & 1u, 1u)
      << "plane 0 is 89% zero bytes and should be stored sparse";
  expect_round_trip_all(MessageHeader{.tensor_numels = {chunk.length}}, {chunk});
}

TEST(CodecEncode, IsDeterministic) {
  std::mt19937_64 rng(8);
  const Chunk chunk = make_chunk(0, 0, 50000, testing::random_offsets(rng, 50000, 0.02), rng);
  for (const Config& config : all_configs()) {
    const EncodeOptions options{.encoding = config.encoding,
                                .zstd_level = config.zstd_level,
                                .index_coding = config.index_coding};
    EXPECT_EQ(encode_frame(chunk.entries(), options), encode_frame(chunk.entries(), options))
        << config_name(config);
  }
}

// The documented rule: compressed varint gaps against the raw sizes of bit-packing and
// Elias-Fano; the smallest wins (then compressed when that helps).
TEST(CodecEncode, PicksTheSmallestIndexCoding) {
  std::mt19937_64 rng(9);
  int chose_other_than_varint = 0;
  for (const double density : {0.0005, 0.02, 0.3, 0.9, 1.0}) {
    SCOPED_TRACE(density);
    const Chunk chunk =
        make_chunk(0, 0, 200000, testing::random_offsets(rng, 200000, density), rng);
    const MessageHeader header{.tensor_numels = {200000}};
    const auto index_bytes = [&](const EncodeOptions& options) {
      const Bytes message = encode_message(
          header, {chunk}, {.encoding = Encoding::pulse, .index_coding = options.index_coding});
      return MessageView::parse(message).frame(0).index_bytes;
    };
    const auto info_of = [&](std::optional<IndexCoding> coding) {
      const Bytes message =
          encode_message(header, {chunk}, {.encoding = Encoding::pulse, .index_coding = coding});
      return MessageView::parse(message).frame(0);
    };
    const FrameInfo automatic = info_of(std::nullopt);
    EXPECT_LE(automatic.index_bytes, index_bytes({.index_coding = IndexCoding::varint}));
    // Raw sizes of the other two codings (the test's own writers).
    const std::size_t bitpack_raw = testing::bitpack_index(chunk.offsets).size();
    const std::size_t elias_fano_raw =
        testing::elias_fano_index(chunk.offsets, chunk.length).size();
    // index_bytes includes the stream directory (a few bytes).
    EXPECT_LE(automatic.index_bytes, bitpack_raw + 40);
    EXPECT_LE(automatic.index_bytes, elias_fano_raw + 40);
    chose_other_than_varint += automatic.index_coding != IndexCoding::varint ? 1 : 0;
  }
  EXPECT_GT(chose_other_than_varint, 0) << "some density should favour another coding";
}

TEST(CodecEncode, NoFrameExceedsTheLargestEncodingOfItsChunk) {
  // Incompressible values (random bits), every density, every encoding and index coding: the
  // bound receivers hold message sizes to is never exceeded.
  std::mt19937_64 rng(23);
  for (const std::uint64_t length : {1u, 2u, 3u, 9u, 130u, 1000u, 70000u}) {
    for (const double density : {1.0, 0.5, 0.01, 0.0}) {
      std::vector<std::uint32_t> offsets = testing::random_offsets(rng, length, density);
      if (offsets.empty()) offsets.push_back(static_cast<std::uint32_t>(length - 1));
      std::vector<float> values;
      for (std::size_t i = 0; i < offsets.size(); ++i) {
        std::uint32_t bits = static_cast<std::uint32_t>(rng()) & 0xBF7FFFFFu;  // finite
        if (i % 3 == 0) bits &= 0xFFFF0000u;  // some mostly-zero planes: the sparse form
        float value = 0;
        std::memcpy(&value, &bits, sizeof value);
        values.push_back(value);
      }
      const FrameEntries entries{.length = length, .offsets = offsets, .values = values};
      for (const Encoding encoding :
           {Encoding::pulse, Encoding::plain_i64_f32, Encoding::plain_i32_f32}) {
        for (const auto coding :
             {std::optional<IndexCoding>{}, std::optional(IndexCoding::varint),
              std::optional(IndexCoding::bitpack), std::optional(IndexCoding::elias_fano)}) {
          if (encoding != Encoding::pulse && coding) continue;
          const auto frame = encode_frame(entries, {.encoding = encoding, .index_coding = coding});
          EXPECT_LE(frame.size(), max_encoded_frame_bytes(length))
              << "length " << length << ", " << offsets.size() << " entries, "
              << encoding_name(encoding);
        }
      }
    }
  }
  const MessageHeader header{.tensor_numels = {1, 2, 3}};
  EXPECT_EQ(encode_header(header, 3).size(), max_encoded_header_bytes(3));
}

TEST(CodecEncode, RejectsInvalidEntries) {
  const std::vector<std::uint32_t> offsets = {1, 5, 9};
  const std::vector<float> values = {1.0f, 2.0f, 3.0f};
  const FrameEntries good{
      .tensor = 0, .begin = 0, .length = 10, .offsets = offsets, .values = values};
  EXPECT_NO_THROW((void)encode_frame(good, {}));

  const auto expect_invalid = [](const FrameEntries& entries, const EncodeOptions& options,
                                 const char* what) {
    for (const Encoding encoding :
         {Encoding::pulse, Encoding::plain_i64_f32, Encoding::plain_i32_f32}) {
      EncodeOptions o = options;
      o.encoding = encoding;
      EXPECT_THROW((void)encode_frame(entries, o), InvalidArgument) << what;
    }
  };
  FrameEntries e = good;
  e.length = 9;  // offset 9 is not below the length
  expect_invalid(e, {}, "offset >= length");
  const std::vector<std::uint32_t> unsorted = {1, 9, 5};
  e = good;
  e.offsets = unsorted;
  expect_invalid(e, {}, "not ascending");
  const std::vector<std::uint32_t> repeated = {1, 5, 5};
  e = good;
  e.offsets = repeated;
  expect_invalid(e, {}, "repeated offset");
  e = good;
  e.values = std::span<const float>(values).first(2);
  expect_invalid(e, {}, "size mismatch");
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
        -std::numeric_limits<float>::infinity()}) {
    const std::vector<float> with_bad = {1.0f, bad, 3.0f};
    e = good;
    e.values = with_bad;
    expect_invalid(e, {}, "non-finite value");
  }
  e = good;
  e.length = kMaxFrameElements + 1;
  expect_invalid(e, {}, "chunk too long");
  e = good;
  e.begin = std::numeric_limits<std::uint64_t>::max() - 5;
  expect_invalid(e, {}, "chunk beyond 2^63");
  expect_invalid(good, {.zstd_level = -1}, "zstd level -1");
  expect_invalid(good, {.zstd_level = kMaxZstdLevel + 1}, "zstd level too high");
  try {
    (void)encode_frame(
        FrameEntries{.begin = 100, .length = 10, .offsets = unsorted, .values = values}, {});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& error) {
    EXPECT_EQ(error.context().index, std::optional<std::uint64_t>(105)) << error.what();
    EXPECT_NE(std::string(error.what()).find("entry 2"), std::string::npos) << error.what();
  }
}

TEST(CodecEncode, RejectsInvalidHeaders) {
  EXPECT_THROW((void)encode_header(MessageHeader{.tensor_numels = {std::uint64_t{1} << 63}}, 0),
               InvalidArgument);
  EXPECT_NO_THROW(
      (void)encode_header(MessageHeader{.tensor_numels = {(std::uint64_t{1} << 63) - 1}}, 0));
  EXPECT_THROW((void)encode_header(MessageHeader{.encoding = static_cast<Encoding>(9)}, 0),
               InvalidArgument);
}

TEST(CodecDecode, StreamingParseSeesEachFrameOnceItHasArrived) {
  std::mt19937_64 rng(10);
  const MessageHeader header{.window = 9, .tensor_numels = {3000, 10}};
  std::vector<Chunk> chunks = {
      make_chunk(0, 0, 1000, testing::random_offsets(rng, 1000, 0.1), rng),
      make_chunk(0, 1000, 1000, {}, rng),
      make_chunk(0, 2000, 1000, testing::random_offsets(rng, 1000, 0.5), rng),
      make_chunk(1, 0, 10, {3, 4}, rng)};
  for (const Config& config : all_configs()) {
    SCOPED_TRACE(config_name(config));
    const Bytes message = encode_message(header, chunks, config);
    const MessageView whole = MessageView::parse(message);
    const std::span<const std::byte> bytes(message);
    EXPECT_EQ(message_header_size(bytes.first(kHeaderPrefixBytes)), whole.frame(0).byte_offset);
    DecodeScratch scratch;
    std::vector<std::uint32_t> offsets(1000);
    std::vector<float> values(1000);
    for (std::size_t received = whole.frame(0).byte_offset; received <= message.size();
         ++received) {
      const MessageView partial = MessageView::parse_prefix(bytes.first(received));
      std::size_t complete = 0;
      while (complete < whole.frame_count() &&
             whole.frame(complete).byte_offset + whole.frame(complete).byte_size <= received) {
        ++complete;
      }
      ASSERT_EQ(partial.frame_count(), complete) << received;
      EXPECT_EQ(partial.complete(), complete == chunks.size());
      EXPECT_EQ(partial.announced_frame_count(), chunks.size());
      EXPECT_GT(partial.bytes_needed(), complete == chunks.size() ? 0 : received);
      if (complete < chunks.size()) {
        EXPECT_LE(partial.bytes_needed(),
                  whole.frame(complete).byte_offset + whole.frame(complete).byte_size);
      }
      for (std::size_t i = 0; i < complete; ++i) {
        ASSERT_EQ(partial.decode_frame(i, offsets, values, scratch), chunks[i].offsets.size());
      }
    }
  }
}

// Golden bytes: the layout in docs/wire-format.md, byte for byte.
TEST(CodecGolden, HeaderBytes) {
  const Bytes header = encode_header(MessageHeader{.window = 0x0102030405060708ull,
                                                   .sender_rank = 0x0A0B0C0Du,
                                                   .encoding = Encoding::plain_i32_f32,
                                                   .tensor_numels = {5, 0x100000000ull}},
                                     3);
  Bytes expected = {std::byte{'P'}, std::byte{'L'}, std::byte{'S'}, std::byte{'M'},
                    std::byte{1},   std::byte{0},   std::byte{2},   std::byte{0}};
  testing::put<std::uint64_t>(expected, 0x0102030405060708ull);
  testing::put<std::uint32_t>(expected, 0x0A0B0C0Du);
  testing::put<std::uint32_t>(expected, 2);  // tensors
  testing::put<std::uint32_t>(expected, 3);  // frames
  testing::put<std::uint32_t>(expected, 0);  // reserved
  testing::put<std::uint64_t>(expected, 5);
  testing::put<std::uint64_t>(expected, 0x100000000ull);
  testing::put<std::uint64_t>(expected, testing::xxh3(expected));
  EXPECT_EQ(header, expected);
  EXPECT_EQ(header.size(), 32u + 2 * 8 + 8);
}

TEST(CodecGolden, PlainFrameBytes) {
  const std::vector<std::uint32_t> offsets = {2, 7};
  const std::vector<float> values = {0.5f, -2.0f};
  const FrameEntries entries{
      .tensor = 4, .begin = 0x100000000ull, .length = 8, .offsets = offsets, .values = values};
  for (const Encoding encoding : {Encoding::plain_i64_f32, Encoding::plain_i32_f32}) {
    testing::RawFrame raw{.tensor = 4,
                          .encoding = static_cast<std::uint8_t>(encoding),
                          .begin = 0x100000000ull,
                          .length = 8,
                          .entries = 2};
    for (const std::uint32_t o : offsets) {
      if (encoding == Encoding::plain_i64_f32) {
        testing::put<std::int64_t>(raw.payload, static_cast<std::int64_t>(0x100000000ull + o));
      } else {
        testing::put<std::int32_t>(raw.payload, static_cast<std::int32_t>(o));
      }
    }
    for (const float v : values)
      testing::put<float>(raw.payload, v);
    EXPECT_EQ(encode_frame(entries, {.encoding = encoding}), testing::make_frame(raw))
        << encoding_name(encoding);
  }
}

TEST(CodecGolden, SmallPulseFrameBytes) {
  // Three entries: every stream is too small for zstd to help, so all are stored raw; no plane
  // is mostly zero bytes... except plane 0 (values 1.0, 2.0, -3.0 have zero low bytes).
  const std::vector<std::uint32_t> offsets = {0, 3, 300};
  const std::vector<float> values = {1.0f, 2.0f, -3.0f};
  const FrameEntries entries{
      .tensor = 1, .begin = 10, .length = 1000, .offsets = offsets, .values = values};
  testing::RawPulseStreams streams;
  // Index coding: varint gaps 0, 2, 296 -> 00 02 A8 02 (4 bytes); bit-packing needs
  // 1 + ceil(3 * 9 / 8) = 5 bytes; Elias-Fano with l = floor(log2(1000 / 3)) = 8 needs
  // ceil(24 / 8) + ceil((3 + (999 >> 8)) / 8) = 4 bytes, which ties with varint: varint wins.
  streams.index = {std::byte{0x00}, std::byte{0x02}, std::byte{0xA8}, std::byte{0x02}};
  // Planes: bytes 0 and 1 of all three values are zero, so planes 0 and 1 are sparse (bitmap
  // 0x00, no listed bytes); plane 2 holds 80 00 40 and plane 3 holds 3F 40 C0.
  streams.planes[0] = {std::byte{0x00}};
  streams.planes[1] = {std::byte{0x00}};
  streams.planes[2] = {std::byte{0x80}, std::byte{0x00}, std::byte{0x40}};
  streams.planes[3] = {std::byte{0x3F}, std::byte{0x40}, std::byte{0xC0}};
  streams.nonzero = {0, 0};
  const testing::RawFrame raw{.tensor = 1,
                              .encoding = 0,
                              .index_coding = 0,
                              .zstd_streams = 0,
                              .sparse_planes = 0b0011,
                              .begin = 10,
                              .length = 1000,
                              .entries = 3,
                              .payload = testing::make_pulse_payload(streams)};
  EXPECT_EQ(encode_frame(entries, {}), testing::make_frame(raw));

  // The same entries with each index coding forced (docs/wire-format.md, the worked example).
  const Bytes bitpack = {std::byte{0x09}, std::byte{0x00}, std::byte{0x04}, std::byte{0xA0},
                         std::byte{0x04}};
  const Bytes elias_fano = {std::byte{0x00}, std::byte{0x03}, std::byte{0x2C}, std::byte{0x0B}};
  EXPECT_EQ(testing::bitpack_index(offsets), bitpack);
  EXPECT_EQ(testing::elias_fano_index(offsets, 1000), elias_fano);
  for (const auto& [coding, index] :
       {std::pair{IndexCoding::bitpack, bitpack}, std::pair{IndexCoding::elias_fano, elias_fano}}) {
    testing::RawPulseStreams forced = streams;
    forced.index = index;
    testing::RawFrame forced_raw = raw;
    forced_raw.index_coding = static_cast<std::uint8_t>(coding);
    forced_raw.payload = testing::make_pulse_payload(forced);
    EXPECT_EQ(encode_frame(entries, {.index_coding = coding}), testing::make_frame(forced_raw))
        << index_coding_name(coding);
  }
}

}  // namespace
}  // namespace pulseloco::codec
