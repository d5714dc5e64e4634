// The context encoding: values coded against the receiver's θ_g (docs/wire-format.md, "Payload:
// context"). Round trips of every kind of bit pattern, the per-chunk fallback to pulse frames,
// the version rules, and what a receiver whose context differs from the sender's gets.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/codec/context_coding.h>
#include <pulseloco/codec/message.h>
#include "codec_test_util.h"

namespace pulseloco::codec::context_test {

using testing::Bytes;

float from_bits(std::uint32_t bits) {
  return std::bit_cast<float>(bits);
}

// A chunk as the gate gives it: θ_g rounded to bf16 values, the fired values near half an ulp
// of bf16(θ_g) or more, on θ_g's fp32 grid.
struct Chunk {
  std::vector<float> context;
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
  std::vector<std::uint8_t> residue_multiples;  // FrameEntries::residue_multiples
};

Chunk realistic_chunk(std::uint32_t length, double density, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> weight(0.0f, 0.02f);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  Chunk chunk;
  chunk.context.resize(length);
  for (float& w : chunk.context) {
    w = round_to_bf16(weight(rng));
  }
  for (std::uint32_t i = 0; i < length; ++i) {
    if (uniform(rng) >= density) continue;
    const float theta = chunk.context[i];
    const float ulp = std::ldexp(1.0f, std::ilogb(theta) - 7);  // bf16 ulp of θ_g
    const float grid = std::ldexp(1.0f, std::ilogb(theta) - 23);
    const double scale = 0.5 + 3.0 * uniform(rng) * uniform(rng);
    float s = static_cast<float>(scale * ulp * (uniform(rng) < 0.5 ? -1 : 1));
    s = std::round(s / grid) * grid;
    if (s == 0.0f) s = grid;
    chunk.offsets.push_back(i);
    chunk.values.push_back(s);
  }
  return chunk;
}

Bytes encode_message(const Chunk& chunk, Encoding encoding = Encoding::context,
                     std::optional<IndexCoding> index_coding = {}) {
  const auto length = static_cast<std::uint64_t>(chunk.context.size());
  MessageHeader header{
      .window = 3, .sender_rank = 1, .encoding = encoding, .tensor_numels = {length}};
  Bytes message = encode_header(header, 1);
  const Bytes frame = encode_frame({.tensor = 0,
                                    .begin = 0,
                                    .length = length,
                                    .offsets = chunk.offsets,
                                    .values = chunk.values,
                                    .context = chunk.context,
                                    .residue_multiples = chunk.residue_multiples},
                                   {.encoding = encoding, .index_coding = index_coding});
  message.insert(message.end(), frame.begin(), frame.end());
  return message;
}

struct Decoded {
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
};

Decoded decode_message(const Bytes& message, std::span<const float> context) {
  const MessageView view = MessageView::parse(message);
  Decoded out;
  out.offsets.resize(view.frame(0).entries);
  out.values.resize(view.frame(0).entries);
  DecodeScratch scratch;
  EXPECT_EQ(view.decode_frame(0, out.offsets, out.values, scratch, context), out.offsets.size());
  return out;
}

void expect_same_bits(const Chunk& chunk, const Decoded& decoded) {
  ASSERT_EQ(decoded.offsets, chunk.offsets);
  ASSERT_EQ(decoded.values.size(), chunk.values.size());
  for (std::size_t i = 0; i < chunk.values.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(decoded.values[i]),
              std::bit_cast<std::uint32_t>(chunk.values[i]))
        << "entry " << i;
  }
}

Encoding frame_encoding(const Bytes& message) {
  return MessageView::parse(message).frame(0).encoding;
}

// Frame byte 7: a context frame's value flags.
std::uint8_t frame_value_flags(const Bytes& message) {
  return std::to_integer<std::uint8_t>(
      message[MessageView::parse(message).frame(0).byte_offset + 7]);
}

TEST(CodecContext, RealisticChunkRoundTripsAndBeatsPulse) {
  for (const double density : {0.003, 0.01, 0.03, 0.2}) {
    const Chunk chunk = realistic_chunk(1 << 16, density, 7);
    const Bytes context = encode_message(chunk);
    EXPECT_EQ(frame_encoding(context), Encoding::context) << density;
    expect_same_bits(chunk, decode_message(context, chunk.context));
    EXPECT_LT(context.size(), encode_message(chunk, Encoding::pulse).size()) << density;
  }
}

// A chunk whose firing θ_g's exponent nearly decides, as with bf16 local weights: elements of
// small magnitude fire, the largest never do, the middle ones at `middle_density`.
Chunk exponent_decided_chunk(std::uint32_t length, double middle_density, std::uint64_t seed) {
  Chunk chunk = realistic_chunk(length, 0.0, seed);
  std::mt19937_64 rng(seed + 1);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (std::uint32_t i = 0; i < length; ++i) {
    const int e = std::ilogb(chunk.context[i]);
    const double p = e < -9 ? 1.0 : e < -6 ? middle_density : 0.0;
    if (uniform(rng) >= p) continue;
    chunk.offsets.push_back(i);
    chunk.values.push_back(std::ldexp(1.0f, e - 8));
  }
  return chunk;
}

IndexCoding frame_index_coding(const Bytes& message) {
  return MessageView::parse(message).frame(0).index_coding;
}

TEST(CodecContext, IndicesTheExponentPredictsAreCodedByExponentGroups) {
  for (const double density : {0.0, 0.01, 0.3, 0.9}) {
    const Chunk chunk = exponent_decided_chunk(1 << 16, density, 4);
    const Bytes message = encode_message(chunk);
    ASSERT_EQ(frame_encoding(message), Encoding::context) << density;
    EXPECT_EQ(frame_index_coding(message), IndexCoding::exponent_groups) << density;
    expect_same_bits(chunk, decode_message(message, chunk.context));
    EXPECT_LT(message.size(), encode_message(chunk, Encoding::pulse).size()) << density;
  }
}

TEST(CodecContext, ForcedExponentGroupsRoundTripAtEveryDensity) {
  // Sparse groups (fired ranks coded), dense ones (the ranks that did not fire), whole ones.
  for (const double density : {0.0005, 0.01, 0.2, 0.6, 0.97, 1.0}) {
    const Chunk chunk = realistic_chunk(5000, density, 12);
    if (chunk.offsets.empty()) continue;
    const Bytes message = encode_message(chunk, Encoding::context, IndexCoding::exponent_groups);
    if (frame_encoding(message) != Encoding::context) continue;  // the values fell back
    EXPECT_EQ(frame_index_coding(message), IndexCoding::exponent_groups) << density;
    expect_same_bits(chunk, decode_message(message, chunk.context));
  }
}

TEST(CodecContext, ExponentGroupsNeedTheContextEncoding) {
  const Chunk chunk = realistic_chunk(100, 0.1, 1);
  EXPECT_THROW((void)encode_message(chunk, Encoding::pulse, IndexCoding::exponent_groups),
               InvalidArgument);
}

// Where the index stream of a one-frame context message starts, when stored uncompressed.
std::size_t index_stream_of(const Bytes& message) {
  const MessageView view = MessageView::parse(message);
  auto p = static_cast<std::size_t>(view.frame(0).byte_offset) + 32;
  const auto varint = [&] {
    std::uint64_t v = 0;
    for (unsigned k = 0;; ++k) {
      const auto b = std::to_integer<std::uint8_t>(message[p++]);
      v |= static_cast<std::uint64_t>(b & 0x7F) << (7 * k);
      if ((b & 0x80) == 0) return v;
    }
  };
  const std::uint64_t raw = varint();
  const std::uint64_t stored = varint();
  for (int s = 1; s < detail::kContextStreams; ++s)
    (void)varint();
  EXPECT_EQ(raw, stored) << "the index stream is compressed";
  return p + 8;
}

void expect_refused(const Bytes& message, std::span<const float> context,
                    const std::string& reason) {
  const MessageView view = MessageView::parse(message);
  std::vector<std::uint32_t> offsets(view.frame(0).entries);
  std::vector<float> values(offsets.size());
  DecodeScratch scratch;
  try {
    (void)view.decode_frame(0, offsets, values, scratch, context);
    ADD_FAILURE() << "accepted; expected: " << reason;
  } catch (const ProtocolError& e) {
    EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
  }
}

TEST(CodecContext, MalformedExponentGroupsAreRefusedNamingTheField) {
  const Chunk chunk = exponent_decided_chunk(4096, 0.05, 6);
  const Bytes message = encode_message(chunk, Encoding::context, IndexCoding::exponent_groups);
  ASSERT_EQ(frame_encoding(message), Encoding::context);
  const std::size_t index = index_stream_of(message);
  const auto groups = std::to_integer<std::size_t>(message[index]);
  ASSERT_GE(groups, 2u);
  ASSERT_LT(groups, 128u);
  // Group 0: exponent, count (one byte when below 128), parameter.
  const std::size_t group0 = index + 1;
  const auto edited = [&](std::size_t at, std::byte value) {
    Bytes bad = message;
    bad[at] = value;
    testing::refresh_checksums(bad);
    return bad;
  };
  const auto count0 = std::to_integer<unsigned>(message[group0 + 1]);
  ASSERT_LT(count0, 127u);
  expect_refused(edited(index, static_cast<std::byte>(groups - 1)), chunk.context, "counts sum to");
  expect_refused(edited(group0 + 1, static_cast<std::byte>(count0 + 1)), chunk.context,
                 "fired (allowed 1..");
  expect_refused(edited(group0 + 1, std::byte{0}), chunk.context, "fired (allowed 1..");
  expect_refused(edited(group0 + 2, message[group0 + 2] | std::byte{0x20}), chunk.context,
                 "unknown parameter bits");
  expect_refused(edited(group0 + 3, message[group0]), chunk.context, "does not ascend");
  // A receiver whose context lacks the groups' elements.
  const std::vector<float> other(chunk.context.size(), 1.0f);
  expect_refused(message, other, "in this receiver's context");
}

// The decoder finds a common group's members (an exponent a sample of the chunk shows often)
// with a pass over the chunk each, and the rare groups' all at once: every kind of group on both
// sides, in a chunk whose length is not a multiple of 64 words' elements.
TEST(CodecContext, CommonAndRareGroupsOfEveryKindRoundTrip) {
  Chunk chunk = realistic_chunk(3 * 65536 + 37, 0.0, 21);
  std::mt19937_64 rng(22);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  const auto density_of = [](int e) {
    switch (e) {
      case -4:
        return 0.3;  // rare (|θ| ≥ 1/16), sparse
      case -6:
        return 0.9;  // common, the members that did not fire coded
      case -7:
        return 1.0;  // common, fired whole
      case -8:
        return 0.02;  // common, sparse
      case -13:
        return 0.05;  // rare, sparse
      case -14:
        return 0.8;  // rare, complement
      default:
        return e <= -16 ? 1.0 : 0.0;  // rare, whole
    }
  };
  for (std::uint32_t i = 0; i < chunk.context.size(); ++i) {
    const int e = std::ilogb(chunk.context[i]);
    if (uniform(rng) >= density_of(e)) continue;
    chunk.offsets.push_back(i);
    chunk.values.push_back(std::ldexp(1.0f, e - 8));
  }
  const Bytes message = encode_message(chunk, Encoding::context, IndexCoding::exponent_groups);
  ASSERT_EQ(frame_encoding(message), Encoding::context);
  ASSERT_EQ(frame_index_coding(message), IndexCoding::exponent_groups);
  expect_same_bits(chunk, decode_message(message, chunk.context));
  // A receiver whose context lacks one member of a group that fired whole, common or rare.
  for (const bool common : {true, false}) {
    std::vector<float> other = chunk.context;
    const auto member = std::find_if(other.rbegin(), other.rend(), [&](float c) {
      return common ? std::ilogb(c) == -7 : std::ilogb(c) <= -16;
    });
    ASSERT_NE(member, other.rend());
    *member = 1e30f;
    expect_refused(message, other, "in this receiver's context");
  }
}

TEST(CodecContext, EveryBitPatternOfValueAndContextRoundTrips) {
  // Contexts: NaN, ±infinity, ±0, subnormals, the extremes; values: ±0, subnormals, the
  // largest finite, and random bits, against every context.
  const std::vector<std::uint32_t> special = {0x00000000, 0x80000000, 0x00000001, 0x807FFFFF,
                                              0x00400000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000,
                                              0xFF800000, 0x7FC00000, 0xFFFFFFFF, 0x7F800001,
                                              0x3F800000, 0x00800000, 0x3C23D70A, 0xBC23D70A};
  std::mt19937_64 rng(11);
  Chunk chunk;
  for (const std::uint32_t c : special) {
    for (int k = 0; k < 40; ++k) {
      std::uint32_t v = k < static_cast<int>(special.size()) ? special[k] : rng();
      if ((v & 0x7F800000u) == 0x7F800000u) v &= 0xBFFFFFFFu;  // keep values finite
      chunk.offsets.push_back(static_cast<std::uint32_t>(chunk.context.size()));
      chunk.context.push_back(from_bits(c));
      chunk.values.push_back(from_bits(v));
    }
  }
  chunk.context.push_back(0.0f);  // an element that did not fire
  for (const auto& [offsets, values] :
       {std::pair{chunk.offsets, chunk.values},
        std::pair{std::vector<std::uint32_t>{}, std::vector<float>{}}}) {
    Chunk c = chunk;
    c.offsets = offsets;
    c.values = values;
    for (const auto coding :
         {std::optional<IndexCoding>{}, std::optional(IndexCoding::exponent_groups)}) {
      const Bytes message = encode_message(c, Encoding::context, coding);
      expect_same_bits(c, decode_message(message, c.context));
    }
  }
}

TEST(CodecContext, ValuesTheContextDoesNotPredictFallBackToAPulseFrame) {
  // Random value bits against an all-zero context: a context frame would cost more than the
  // pulse frame, so the chunk goes as a pulse frame, which decodes without a context.
  std::mt19937 rng(3);
  Chunk chunk;
  chunk.context.assign(5000, 0.0f);
  for (std::uint32_t i = 0; i < 5000; i += 3) {
    chunk.offsets.push_back(i);
    chunk.values.push_back(from_bits(rng() & 0xBF7FFFFFu));
  }
  const Bytes message = encode_message(chunk);
  EXPECT_EQ(frame_encoding(message), Encoding::pulse);
  expect_same_bits(chunk, decode_message(message, {}));
  expect_same_bits(chunk, decode_message(message, chunk.context));
}

TEST(CodecContext, AnEmptyChunkIsAnEmptyPulseFrame) {
  Chunk chunk;
  chunk.context.assign(100, 1.0f);
  const Bytes message = encode_message(chunk);
  EXPECT_EQ(frame_encoding(message), Encoding::pulse);
  EXPECT_EQ(MessageView::parse(message).frame(0).entries, 0u);
}

TEST(CodecContext, MessagesOfTheContextEncodingAreVersion6) {
  const Chunk chunk = realistic_chunk(4096, 0.05, 1);
  Bytes message = encode_message(chunk);
  EXPECT_EQ(load_le<std::uint16_t>(message.data() + 4), kContextFormatVersion);
  EXPECT_EQ(load_le<std::uint16_t>(encode_message(chunk, Encoding::pulse).data() + 4),
            kFormatVersion);
  // Versions 1-5 with the context encoding, or version 6 with another, are refused.
  for (const std::uint16_t version : {1, 2, 3, 4, 5}) {
    Bytes older = message;
    testing::poke<std::uint16_t>(older, 4, version);
    testing::refresh_checksums(older);
    EXPECT_THROW((void)MessageView::parse(older), ProtocolError) << version;
  }
  Bytes v6 = encode_message(chunk, Encoding::pulse);
  testing::poke<std::uint16_t>(v6, 4, 6);
  testing::refresh_checksums(v6);
  EXPECT_THROW((void)MessageView::parse(v6), ProtocolError);
}

TEST(CodecContext, DecodingWithoutTheContextIsRefused) {
  const Chunk chunk = realistic_chunk(4096, 0.05, 2);
  const Bytes message = encode_message(chunk);
  const MessageView view = MessageView::parse(message);
  std::vector<std::uint32_t> offsets(view.frame(0).entries);
  std::vector<float> values(offsets.size());
  DecodeScratch scratch;
  EXPECT_THROW((void)view.decode_frame(0, offsets, values, scratch), InvalidArgument);
  const std::vector<float> short_context(chunk.context.begin(), chunk.context.end() - 1);
  EXPECT_THROW((void)view.decode_frame(0, offsets, values, scratch, short_context),
               InvalidArgument);
}

// Frame 0 of `message` decoded against the context of `chunk` with `bit` flipped at a fired
// element (picked by `rng`): its entries, or the ProtocolError's text.
struct Attempt {
  std::optional<Decoded> decoded;
  std::string error;
};

Attempt decode_with_flipped_bit(const Bytes& message, const Chunk& chunk, std::uint32_t bit,
                                std::mt19937& rng) {
  std::vector<float> other = chunk.context;
  const std::uint32_t at = chunk.offsets[rng() % chunk.offsets.size()];
  other[at] = from_bits(std::bit_cast<std::uint32_t>(other[at]) ^ bit);
  const MessageView view = MessageView::parse(message);
  Decoded decoded;
  decoded.offsets.resize(view.frame(0).entries);
  decoded.values.resize(decoded.offsets.size());
  DecodeScratch scratch;
  try {
    (void)view.decode_frame(0, decoded.offsets, decoded.values, scratch, other);
    return {.decoded = std::move(decoded), .error = {}};
  } catch (const ProtocolError& e) {
    return {.decoded = std::nullopt, .error = e.what()};
  }
}

TEST(CodecContext, AReceiverWithOtherContextBitsFailsOrGetsTheSameValues) {
  // A receiver whose θ_g differs from the sender's: every change of one element's bits either
  // leaves the decoded values as sent (a frame whose values keep their bits reads only θ_g's
  // exponents) or is refused by the frame's value digest. It never yields other values.
  const Chunk chunk = realistic_chunk(2048, 0.1, 5);
  const Bytes message = encode_message(chunk);
  ASSERT_EQ(frame_encoding(message), Encoding::context);
  ASSERT_EQ(frame_value_flags(message), 0);
  std::mt19937 rng(9);
  int refused = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const std::uint32_t bit = 1u << (rng() % 32);
    const Attempt attempt = decode_with_flipped_bit(message, chunk, bit, rng);
    if (attempt.decoded) {
      expect_same_bits(chunk, *attempt.decoded);
      // Only θ_g's exponent bits are read: a changed exponent bit must have been refused.
      EXPECT_EQ(bit & 0x7F800000u, 0u) << "an exponent bit of θ_g changed unnoticed";
    } else {
      ++refused;
      EXPECT_TRUE(attempt.error.find("digest") != std::string::npos ||
                  attempt.error.find("receiver's context") != std::string::npos)
          << attempt.error;
    }
  }
  EXPECT_GT(refused, 0);
}

// A chunk as the authors' Δ = θ_g - θ_l gives it with bf16 local weights from window 1 on: θ_g
// off the bf16 grid, and every fired s its element's cast residue θ_g - bf16(θ_g) plus a few
// bf16 ulps of θ_g.
Chunk residue_chunk(std::uint32_t length, double density, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> weight(0.0f, 0.02f);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::uniform_int_distribution<int> steps(1, 6);
  Chunk chunk;
  chunk.context.resize(length);
  for (float& w : chunk.context)
    w = weight(rng);
  for (std::uint32_t i = 0; i < length; ++i) {
    if (uniform(rng) >= density) continue;
    const float theta = chunk.context[i];
    const float ulp = std::ldexp(1.0f, std::ilogb(theta) - 7);
    const float step = static_cast<float>(steps(rng) * (uniform(rng) < 0.5 ? -1 : 1)) * ulp;
    chunk.offsets.push_back(i);
    chunk.values.push_back(detail::context_residue(theta) + step);
  }
  return chunk;
}

TEST(CodecContext, ValuesCarryingTheirContextsCastResidueAreCodedLessIt) {
  for (const double density : {0.01, 0.05, 0.2}) {
    const Chunk chunk = residue_chunk(1 << 16, density, 12);
    const Bytes message = encode_message(chunk);
    ASSERT_EQ(frame_encoding(message), Encoding::context) << density;
    EXPECT_EQ(frame_value_flags(message), detail::kContextLessResidue) << density;
    EXPECT_TRUE(MessageView::parse(message).frame(0).values_less_residue) << density;
    expect_same_bits(chunk, decode_message(message, chunk.context));
    // The residue is most of each value's mantissa bits: without it a value takes a few bits.
    EXPECT_LT(2 * message.size(), encode_message(chunk, Encoding::pulse).size()) << density;
  }
  // Values against a context on the bf16 grid (no residue) keep their bits.
  const Bytes plain = encode_message(realistic_chunk(1 << 16, 0.02, 12));
  ASSERT_EQ(frame_encoding(plain), Encoding::context);
  EXPECT_EQ(frame_value_flags(plain), 0);
  EXPECT_FALSE(MessageView::parse(plain).frame(0).values_less_residue);
}

TEST(CodecContext, AValueTheResidueCannotBeRemovedFromExactlyKeepsItsOwnBits) {
  // fl(fl(v - r) + r) differs from v for a value far below its residue, for -0 against a
  // positive residue, and against a context that is not finite: that entry goes as it is
  // (residue multiple 0), the others less their residue.
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (const auto& [value, theta] :
       {std::pair{1e-30f, 0.0123f}, std::pair{-0.0f, 0.0123f}, std::pair{1e-3f, kInf},
        std::pair{-1e-3f, -kInf}, std::pair{1e-3f, std::numeric_limits<float>::quiet_NaN()}}) {
    Chunk chunk = residue_chunk(1 << 14, 0.05, 13);
    ASSERT_GT(chunk.offsets.size(), 100u);
    chunk.values[50] = value;
    chunk.context[chunk.offsets[50]] = theta;
    const Bytes message = encode_message(chunk);
    EXPECT_EQ(frame_value_flags(message),
              detail::kContextLessResidue | detail::kContextResidueMultiples)
        << value << " against " << theta;
    expect_same_bits(chunk, decode_message(message, chunk.context));
  }
}

TEST(CodecContext, AReceiverWithOtherContextBitsGetsNoValuesOfAResidueCodedFrame) {
  // Values coded less their residue depend on all of θ_g's bits at the fired elements. Here a
  // value is a few bf16 ulps of θ_g, so a flip of any residue bit moves fl(w + r) by more than
  // the value's own fp32 ulp: every flip gives other values, which the digest refuses.
  const Chunk chunk = residue_chunk(2048, 0.1, 14);
  const Bytes message = encode_message(chunk);
  ASSERT_EQ(frame_value_flags(message), detail::kContextLessResidue);
  std::mt19937 rng(15);
  int refused = 0;
  for (int trial = 0; trial < 200; ++trial) {
    // A bit below bf16's: the residue changes.
    const Attempt attempt = decode_with_flipped_bit(message, chunk, 1u << (rng() % 16), rng);
    if (attempt.decoded) {
      expect_same_bits(chunk, *attempt.decoded);
    } else {
      ++refused;
      EXPECT_NE(attempt.error.find("digest"), std::string::npos) << attempt.error;
    }
  }
  EXPECT_EQ(refused, 200);
}

// An owner's sums as the reduction gives them in the authors' configuration: at each element
// that k of `ranks` ranks fired, the sum of their k values, each its residue plus a few bf16
// ulps of θ_g; `residue_multiples` holds each sum's k.
Chunk summed_residue_chunk(std::uint32_t length, double density, int ranks, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::uniform_int_distribution<int> steps(1, 6);
  std::uniform_int_distribution<int> contributors(1, ranks);
  Chunk chunk = residue_chunk(length, density, seed);
  for (std::size_t j = 0; j < chunk.offsets.size(); ++j) {
    const float theta = chunk.context[chunk.offsets[j]];
    const float ulp = std::ldexp(1.0f, std::ilogb(theta) - 7);
    const int k = contributors(rng);
    for (int more = 1; more < k; ++more) {
      const float step = static_cast<float>(steps(rng) * (uniform(rng) < 0.5 ? -1 : 1)) * ulp;
      chunk.values[j] += detail::context_residue(theta) + step;
    }
    chunk.residue_multiples.push_back(static_cast<std::uint8_t>(k));
  }
  return chunk;
}

TEST(CodecContext, SumsCarryingSeveralResiduesAreCodedLessTheirMultiples) {
  for (const int ranks : {2, 4, 16}) {
    const Chunk chunk = summed_residue_chunk(1 << 16, 0.05, ranks, 17);
    const Bytes message = encode_message(chunk);
    ASSERT_EQ(frame_encoding(message), Encoding::context) << ranks;
    EXPECT_EQ(frame_value_flags(message),
              detail::kContextLessResidue | detail::kContextResidueMultiples)
        << ranks;
    EXPECT_TRUE(MessageView::parse(message).frame(0).residue_multiples) << ranks;
    expect_same_bits(chunk, decode_message(message, chunk.context));
    // Without the multiples one residue is not what the sums carry: they keep their bits.
    Chunk without = chunk;
    without.residue_multiples.clear();
    const Bytes whole = encode_message(without);
    EXPECT_EQ(frame_value_flags(whole), 0) << ranks;
    EXPECT_LT(10 * message.size(), 7 * whole.size()) << ranks;
  }
  // Multiples that are all 1 are not coded: the frame is the one without them.
  Chunk single = residue_chunk(1 << 14, 0.05, 18);
  const Bytes plain = encode_message(single);
  single.residue_multiples.assign(single.offsets.size(), 1);
  EXPECT_EQ(encode_message(single), plain);
  EXPECT_EQ(frame_value_flags(plain), detail::kContextLessResidue);
}

TEST(CodecContext, ResidueMultiplesOfAnotherCountAreRefusedAtEncoding) {
  Chunk chunk = summed_residue_chunk(4096, 0.05, 4, 19);
  chunk.residue_multiples.pop_back();
  EXPECT_THROW((void)encode_message(chunk), InvalidArgument);
}

TEST(CodecContext, UnknownValueFlagsAreRefused) {
  for (const auto& [chunk, flag, reason] :
       {std::tuple{residue_chunk(4096, 0.05, 16), 0x04, "unknown value flags"},
        // Multiples without the residue they multiply.
        std::tuple{realistic_chunk(4096, 0.05, 16), 0x02, "residue multiples without"}}) {
    Bytes message = encode_message(chunk);
    ASSERT_EQ(frame_encoding(message), Encoding::context);
    message[MessageView::parse(message).frame(0).byte_offset + 7] |= std::byte(flag);
    testing::refresh_checksums(message);
    try {
      (void)MessageView::parse(message);
      ADD_FAILURE() << "value flag " << flag << " accepted";
    } catch (const ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  }
}

TEST(CodecContext, CorruptedFramesAreRefusedOrDecodeToValidEntries) {
  // Every byte of a context message changed, the checksums recomputed: the decoder refuses the
  // message (ProtocolError) or returns entries that keep its promises (offsets ascending below
  // the chunk length, finite values).
  const Chunk chunk = realistic_chunk(1024, 0.1, 8);
  const Bytes message = encode_message(chunk);
  ASSERT_EQ(frame_encoding(message), Encoding::context);
  int refused = 0;
  for (std::size_t at = 0; at < message.size(); ++at) {
    for (const unsigned flip : {0x01u, 0x80u, 0xFFu}) {
      Bytes bad = message;
      bad[at] ^= static_cast<std::byte>(flip);
      testing::refresh_checksums(bad);
      try {
        const MessageView view = MessageView::parse(bad);
        const FrameInfo& info = view.frame(0);
        std::vector<std::uint32_t> offsets(info.entries);
        std::vector<float> values(offsets.size());
        DecodeScratch scratch;
        std::vector<float> context(chunk.context);
        context.resize(info.length, 0.0f);
        (void)view.decode_frame(0, offsets, values, scratch, context);
        for (std::size_t i = 0; i < offsets.size(); ++i) {
          ASSERT_LT(offsets[i], info.length);
          if (i > 0) {
            ASSERT_GT(offsets[i], offsets[i - 1]);
          }
          ASSERT_TRUE(std::isfinite(values[i]));
        }
      } catch (const ProtocolError&) {
        ++refused;
      }
    }
  }
  EXPECT_GT(refused, 0);
}

}  // namespace pulseloco::codec::context_test
