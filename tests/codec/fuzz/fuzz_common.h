// Shared by the libFuzzer targets: decode everything in a message under strict checks.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/codec/message_reader.h>
#include "codec/codec_test_util.h"

namespace pulseloco::codec::fuzz {

// Bounds the memory a hostile header can make the harness allocate for outputs.
inline DecodeLimits fuzz_limits() {
  DecodeLimits limits;
  limits.max_message_bytes = std::uint64_t{1} << 24;
  limits.max_frame_elements = std::uint64_t{1} << 20;
  limits.max_tensors = 1u << 16;
  limits.max_frames = 1u << 16;
  return limits;
}

[[noreturn]] inline void violated(const char* what) {
  std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
  std::abort();
}

// The context (θ_g) the harnesses encode and decode context frames against: a fixed function
// of the element, mostly weights' exponents with every other bit pattern (NaN, infinity, zero,
// subnormals) among them.
inline std::vector<float> fuzz_context(std::uint64_t begin, std::uint64_t length) {
  std::vector<float> context(length);
  for (std::uint64_t i = 0; i < length; ++i) {
    std::uint64_t z = (begin + i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
    const auto bits = static_cast<std::uint32_t>(z >> 32);
    context[i] = std::bit_cast<float>((bits >> 28) == 0xF
                                          ? bits * 0x85EBCA6Bu
                                          : ((112u + (bits & 15u)) << 23) | (bits & 0x807FFFFFu));
  }
  return context;
}

// Frames longer than this are not encoded with a context by the harnesses (its memory).
inline constexpr std::uint64_t kMaxFuzzContext = std::uint64_t{1} << 20;

struct DecodedFrame {
  FrameInfo info;
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
  std::vector<std::uint8_t> residue_multiples;  // what check_round_trip encodes with
};

constexpr std::uint32_t kPoison = 0xA5A5A5A5u;

// Parses and decodes every frame. Any exception other than ProtocolError escapes (libFuzzer
// reports it). Returns true when the whole message decoded.
inline bool decode_all(std::span<const std::byte> bytes, std::vector<DecodedFrame>& out,
                       MessageHeader& header, const DecodeLimits& limits = fuzz_limits()) {
  std::optional<MessageView> view;
  try {
    view.emplace(MessageView::parse(bytes, limits));
  } catch (const ProtocolError& error) {
    if (!error.context().byte_offset || *error.context().byte_offset > bytes.size()) {
      violated("protocol error without a byte offset inside the message");
    }
    return false;
  }
  header = view->header();
  DecodeScratch scratch;
  for (std::size_t i = 0; i < view->frame_count(); ++i) {
    const FrameInfo& info = view->frame(i);
    if (info.entries > info.length || info.length > limits.max_frame_elements ||
        info.byte_offset + info.byte_size > bytes.size()) {
      violated("frame info out of range");
    }
    DecodedFrame frame{.info = info};
    frame.offsets.assign(info.entries, kPoison);
    frame.values.assign(info.entries, std::bit_cast<float>(kPoison));
    const std::vector<float> context = info.encoding == Encoding::context
                                           ? fuzz_context(info.begin, info.length)
                                           : std::vector<float>{};
    try {
      if (view->decode_frame(i, frame.offsets, frame.values, scratch, context) != info.entries) {
        violated("entry count");
      }
    } catch (const ProtocolError&) {
      for (std::size_t j = 0; j < info.entries; ++j) {
        if (frame.offsets[j] != kPoison ||
            std::bit_cast<std::uint32_t>(frame.values[j]) != kPoison) {
          violated("output written before a protocol error");
        }
      }
      return false;
    }
    for (std::size_t j = 0; j < info.entries; ++j) {
      if (frame.offsets[j] >= info.length) violated("offset not below length");
      if (j > 0 && frame.offsets[j] <= frame.offsets[j - 1]) violated("offsets not ascending");
      if ((std::bit_cast<std::uint32_t>(frame.values[j]) & 0x7F800000u) == 0x7F800000u) {
        violated("non-finite value");
      }
    }
    out.push_back(std::move(frame));
  }
  return true;
}

// The frame-by-frame reader (codec/message_reader.h) on the same bytes must accept exactly the
// messages that decode_all() accepts (`decoded`), with the same header and entries: both run the
// same checks, in another order.
inline void check_reader_agrees(std::span<const std::byte> bytes, bool decoded,
                                const std::vector<DecodedFrame>& frames,
                                const MessageHeader& header) {
  bool read_whole = true;
  std::vector<DecodedFrame> read;
  std::optional<MessageHeader> read_header;
  try {
    MessageReader reader(
        [&](std::uint64_t offset, std::span<std::byte> destination) {
          if (offset > bytes.size() || destination.size() > bytes.size() - offset) {
            violated("reader read beyond the message");
          }
          std::memcpy(destination.data(), bytes.data() + offset, destination.size());
        },
        bytes.size(), fuzz_limits());
    read_header = reader.header();
    DecodeScratch scratch;
    while (const std::optional<FrameInfo> announced = reader.next_frame()) {
      DecodedFrame frame;
      const std::vector<float> context = announced->encoding == Encoding::context
                                             ? fuzz_context(announced->begin, announced->length)
                                             : std::vector<float>{};
      try {
        frame.info = reader.decode_frame(frame.offsets, frame.values, scratch, context);
      } catch (const ProtocolError& error) {
        if (!error.context().byte_offset || *error.context().byte_offset > bytes.size()) {
          violated("reader: frame error without a byte offset inside the message");
        }
        read_whole = false;
      }
      read.push_back(std::move(frame));
    }
  } catch (const ProtocolError& error) {
    if (!error.context().byte_offset || *error.context().byte_offset > bytes.size()) {
      violated("reader: protocol error without a byte offset inside the message");
    }
    read_whole = false;
  }
  if (read_whole != decoded) violated("reader and view disagree on whether the message is valid");
  if (!decoded) return;
  if (!(*read_header == header) || read.size() != frames.size()) violated("reader: header");
  for (std::size_t i = 0; i < frames.size(); ++i) {
    if (read[i].info.byte_offset != frames[i].info.byte_offset ||
        read[i].info.byte_size != frames[i].info.byte_size ||
        read[i].info.index_bytes != frames[i].info.index_bytes ||
        read[i].offsets != frames[i].offsets || read[i].values.size() != frames[i].values.size() ||
        (!read[i].values.empty() && std::memcmp(read[i].values.data(), frames[i].values.data(),
                                                read[i].values.size() * sizeof(float)) != 0)) {
      violated("reader: frames differ from the view's");
    }
  }
}

// Re-encodes decoded frames and checks that they decode to the same bits.
inline void check_round_trip(const MessageHeader& header, const std::vector<DecodedFrame>& frames,
                             const EncodeOptions& options) {
  MessageHeader h = header;
  h.encoding = options.encoding;
  testing::Bytes message = encode_header(h, static_cast<std::uint32_t>(frames.size()));
  for (const DecodedFrame& f : frames) {
    const std::vector<float> context = options.encoding == Encoding::context
                                           ? fuzz_context(f.info.begin, f.info.length)
                                           : std::vector<float>{};
    testing::append(message, encode_frame({.tensor = f.info.tensor,
                                           .begin = f.info.begin,
                                           .length = f.info.length,
                                           .offsets = f.offsets,
                                           .values = f.values,
                                           .context = context,
                                           .residue_multiples = f.residue_multiples},
                                          options));
  }
  std::vector<DecodedFrame> again;
  MessageHeader header_again;
  // Default limits: these frames came from the caller, not from a hostile peer.
  if (!decode_all(message, again, header_again, DecodeLimits{})) {
    violated("re-encoded message does not decode");
  }
  if (!(header_again == h) || again.size() != frames.size()) violated("header round trip");
  for (std::size_t i = 0; i < frames.size(); ++i) {
    if (again[i].offsets != frames[i].offsets ||
        again[i].values.size() != frames[i].values.size() ||
        (!frames[i].values.empty() && std::memcmp(again[i].values.data(), frames[i].values.data(),
                                                  frames[i].values.size() * sizeof(float)) != 0)) {
      violated("round trip is not lossless");
    }
  }
}

}  // namespace pulseloco::codec::fuzz
