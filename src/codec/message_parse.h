// Internal: the steps of parsing and decoding a window message, shared by MessageView (a message
// held whole, message.cpp) and MessageReader (a message read frame by frame, message_reader.cpp),
// so that both validate exactly the same way. Every failure is a ProtocolError naming the reason
// and the byte offset in the message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <pulseloco/codec/message.h>

namespace pulseloco::codec::detail {

[[nodiscard]] std::string frame_text(std::size_t i);

// The header's first kHeaderPrefixBytes, validated (magic, version, encoding, reserved fields,
// counts against the limits).
struct HeaderPrefix {
  Encoding encoding = Encoding::pulse;
  std::uint32_t tensor_count = 0;
  std::uint32_t frame_count = 0;
  std::uint64_t header_bytes = 0;  // the whole header, tensor table and checksum included
};
[[nodiscard]] HeaderPrefix parse_header_prefix(std::span<const std::byte> bytes,
                                               const DecodeLimits& limits);

// The header from the message's first bytes: "truncated" when they are fewer than
// prefix.header_bytes; checks the header's checksum and every tensor's element count.
[[nodiscard]] MessageHeader parse_header(std::span<const std::byte> bytes,
                                         const HeaderPrefix& prefix);

// Validates one frame's prefix and, when `available` holds the whole frame, its structure (the
// pulse stream directory). `available` starts at the frame, at `frame_offset` in the message; it
// may end early, and then `complete` is false, info.byte_size is the frame's announced size and
// `needed` the message bytes needed to complete it.
struct FrameParse {
  FrameInfo info;
  bool complete = false;
  std::uint64_t needed = 0;
};
[[nodiscard]] FrameParse parse_frame(std::span<const std::byte> available,
                                     std::uint64_t frame_offset, const MessageHeader& header,
                                     const DecodeLimits& limits, std::size_t frame_index);

// Frames come in ascending (tensor, begin) order without overlapping: ProtocolError naming frame
// `frame_index` (`next`) when it is out of order or overlaps `previous` (null for the first).
void check_frame_order(const FrameInfo* previous, const FrameInfo& next, std::size_t frame_index);

// The failures that both readers name alike.
// A message of `size` bytes above limits.max_message_bytes.
void check_message_size(std::uint64_t size, const DecodeLimits& limits);
// Frame `frame_index` of `frame_count`, at `frame_offset`, needs bytes up to `needed`.
[[noreturn]] void fail_truncated_frame(std::size_t frame_index, std::uint32_t frame_count,
                                       std::uint64_t frame_offset, std::uint64_t needed,
                                       std::uint64_t size);
// Bytes follow the last of `frame_count` frames, which ends at `end`.
[[noreturn]] void fail_bytes_after_frames(std::uint32_t frame_count, std::uint64_t end,
                                          std::uint64_t size);
// "frame i: checksum mismatch" at the checksum's byte offset.
[[noreturn]] void fail_checksum(std::size_t frame_index, std::uint64_t checksum_offset);

// Decodes a parsed frame, `frame` being its info.byte_size bytes: checksum, streams, entries,
// all before the first write to the outputs (each with room for info.entries). A context frame
// decodes against `context` (info.length values).
std::uint64_t decode_frame(std::span<const std::byte> frame, const FrameInfo& info,
                           std::size_t frame_index, std::span<std::uint32_t> out_offsets,
                           std::span<float> out_values, DecodeScratch& scratch,
                           std::span<const float> context = {});

}  // namespace pulseloco::codec::detail
