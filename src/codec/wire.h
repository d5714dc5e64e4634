// Internal: the codec's constants, varints and a reader whose every failure is a ProtocolError
// naming the field and its byte offset in the message (fixed fields: base/byte_io.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/codec/message.h>

namespace pulseloco::codec::wire {

inline constexpr std::byte kMagic[4] = {std::byte{'P'}, std::byte{'L'}, std::byte{'S'},
                                        std::byte{'M'}};

// Number of payload streams of a pulse frame: indices, then value byte planes 0..3.
inline constexpr int kPulseStreams = 5;
inline constexpr int kIndexStream = 0;

// LEB128 of a 64-bit value: at most 10 bytes.
inline constexpr std::size_t kMaxVarint64Bytes = 10;

inline std::byte* put_varint(std::byte* p, std::uint64_t value) noexcept {
  while (value >= 0x80) {
    *p++ = static_cast<std::byte>((value & 0x7F) | 0x80);
    value >>= 7;
  }
  *p++ = static_cast<std::byte>(value);
  return p;
}

[[noreturn]] inline void fail(std::string_view reason, std::uint64_t byte_offset) {
  throw ProtocolError(reason, ErrorContext{.byte_offset = byte_offset});
}

// Reads fields from `bytes`, which start at `base_offset` in the message: the base reader plus
// the codec's varints.
class Reader : public ByteReader {
 public:
  Reader(std::span<const std::byte> bytes, std::uint64_t base_offset)
      : ByteReader(bytes, {}, base_offset) {}

  // Canonical LEB128 (no redundant trailing zero groups), at most 64 bits.
  [[nodiscard]] std::uint64_t varint(std::string_view field) {
    const std::uint64_t start = offset();
    std::uint64_t value = 0;
    for (unsigned i = 0; i < kMaxVarint64Bytes; ++i) {
      need(1, field);
      const auto byte = static_cast<std::uint8_t>(next_byte());
      if (i == kMaxVarint64Bytes - 1 && byte > 1) {
        fail_at(std::string(field) + ": varint exceeds 64 bits", start);
      }
      value |= static_cast<std::uint64_t>(byte & 0x7F) << (7 * i);
      if ((byte & 0x80) == 0) {
        if (byte == 0 && i > 0) fail_at(std::string(field) + ": non-canonical varint", start);
        return value;
      }
    }
    fail_at(std::string(field) + ": varint longer than 10 bytes", start);
  }
};

}  // namespace pulseloco::codec::wire

namespace pulseloco::codec {

// Layout constants of the message header and frame prefixes (docs/wire-format.md), shared by
// encoding (message_encode.cpp) and parsing (message.cpp).

// Message header prefix.
inline constexpr std::size_t kHeaderVersionAt = 4;
inline constexpr std::size_t kHeaderEncodingAt = 6;
inline constexpr std::size_t kHeaderFlagsAt = 7;
inline constexpr std::size_t kHeaderWindowAt = 8;
inline constexpr std::size_t kHeaderRankAt = 16;
inline constexpr std::size_t kHeaderTensorCountAt = 20;
inline constexpr std::size_t kHeaderFrameCountAt = 24;
inline constexpr std::size_t kHeaderReservedAt = 28;

// Frame prefix.
inline constexpr std::size_t kFrameTensorAt = 0;
inline constexpr std::size_t kFrameEncodingAt = 4;
inline constexpr std::size_t kFrameIndexCodingAt = 5;
inline constexpr std::size_t kFrameZstdStreamsAt = 6;
inline constexpr std::size_t kFramePlaneOrValueFlagsAt =
    7;  // pulse: sparse planes; context: value flags
inline constexpr std::size_t kFrameBeginAt = 8;
inline constexpr std::size_t kFrameLengthAt = 16;
inline constexpr std::size_t kFrameEntriesAt = 20;
inline constexpr std::size_t kFramePayloadBytesAt = 24;

inline constexpr std::size_t kFrameOverheadBytes = kFramePrefixBytes + kChecksumBytes;
inline constexpr std::uint64_t kMaxNumel = (std::uint64_t{1} << 63) - 1;
inline constexpr std::uint8_t kZstdStreamsMask = (1u << wire::kPulseStreams) - 1;
inline constexpr std::uint8_t kSparsePlanesMask = 0x0F;

static_assert(kHeaderReservedAt + 4 == kHeaderPrefixBytes);
static_assert(kFramePayloadBytesAt + 8 == kFramePrefixBytes);

[[nodiscard]] inline bool valid_encoding(std::uint8_t code) noexcept {
  return code <= 3;
}
[[nodiscard]] inline bool valid_index_coding(std::uint8_t code) noexcept {
  return code <= 2;
}

[[nodiscard]] inline std::uint64_t plain_index_bytes(Encoding encoding) noexcept {
  return encoding == Encoding::plain_i64_f32 ? 8 : 4;
}

// Makes `buffer` at least `size` bytes (never shrinks it: scratch buffers are reused).
inline void grow(std::vector<std::byte>& buffer, std::size_t size) {
  if (buffer.size() < size) buffer.resize(size);
}

}  // namespace pulseloco::codec
