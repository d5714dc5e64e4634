// Internal: the TCP data-plane frame: a fixed 64-byte header, then the payload chunk.
//
//   offset size field
//    0     4    magic "PLT1"
//    4     1    kind (1 data, 2 goodbye, 3 abort)
//    5     1    flags (bit 0: payload_checksum is set)
//    6     2    reserved, zero
//    8     8    tag
//   16     8    sequence: how many earlier messages the sender sent to this peer under this tag
//   24     8    message_bytes: size of the whole message
//   32     8    chunk_offset: where this frame's payload lies in the message
//   40     8    chunk_bytes: payload bytes following this header
//   48     8    payload_checksum: xxh3-64 of the payload chunk (0 when flags bit 0 is clear)
//   56     8    header_checksum: xxh3-64 of bytes 0..55
// All integers little-endian. A message of at most the striping threshold travels as one frame;
// a larger one is cut into chunks that travel over all connections to the peer and are
// reassembled by (tag, sequence, chunk_offset). A goodbye frame (no payload) says the sender
// closes its transport after everything it sent before; an abort frame carries the abort reason
// as its payload (at most kMaxAbortReasonBytes).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include <pulseloco/transport/transport.h>

namespace pulseloco::transport::tcp {

inline constexpr std::size_t kFrameHeaderBytes = 64;
inline constexpr std::uint32_t kFrameMagic = 0x31544C50;  // "PLT1" little-endian
inline constexpr std::size_t kMaxAbortReasonBytes = 1024;
// Sanity bound on a message a peer may announce (256 TiB); larger is a protocol violation.
inline constexpr std::uint64_t kMaxMessageBytes = std::uint64_t{1} << 48;

enum class FrameKind : std::uint8_t { data = 1, goodbye = 2, abort = 3 };

struct FrameHeader {
  FrameKind kind = FrameKind::data;
  bool has_payload_checksum = false;
  Tag tag = 0;
  std::uint64_t sequence = 0;
  std::uint64_t message_bytes = 0;
  std::uint64_t chunk_offset = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint64_t payload_checksum = 0;
};

using EncodedHeader = std::array<std::byte, kFrameHeaderBytes>;

// Writes the header with its header checksum.
[[nodiscard]] EncodedHeader encode_header(const FrameHeader& header) noexcept;

// Parses and validates a header: magic, header checksum, kind, flags, reserved bits and the
// chunk's bounds. On failure returns nullopt and sets `problem` to what was wrong.
[[nodiscard]] std::optional<FrameHeader> decode_header(
    std::span<const std::byte, kFrameHeaderBytes> bytes, std::string& problem);

// How a message is cut into frames: `count` frames of `chunk_bytes` (the last may be shorter).
struct ChunkPlan {
  std::uint64_t chunk_bytes = 0;
  std::uint64_t count = 1;
};

// A message of at most `stripe_threshold` bytes is one frame; a larger one is cut into chunks of
// min(stripe_chunk, ceil(size / connections)) bytes (rounded up to 4 KiB), so that every
// connection to the peer carries some of it. A 0-byte message is one empty frame.
[[nodiscard]] ChunkPlan plan_chunks(std::uint64_t message_bytes, int connections,
                                    std::uint64_t stripe_threshold,
                                    std::uint64_t stripe_chunk) noexcept;

}  // namespace pulseloco::transport::tcp
