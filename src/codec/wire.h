// Internal: the codec's constants, varints and a reader whose every failure is a ProtocolError
// naming the field and its byte offset in the message (fixed fields: base/byte_io.h).
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::codec::wire {

inline constexpr std::byte kMagic[4] = {std::byte{'P'}, std::byte{'L'}, std::byte{'S'},
                                        std::byte{'M'}};

// Number of payload streams of a pulse frame: indices, then value byte planes 0..3.
inline constexpr int kPulseStreams = 5;
inline constexpr int kIndexStream = 0;

// LEB128 of a 64-bit value: at most 10 bytes.
inline constexpr std::size_t kMaxVarint64Bytes = 10;

[[nodiscard]] inline std::size_t varint_size(std::uint64_t value) noexcept {
  // ceil(bit_width / 7), at least 1; branch-free (gap sizes vary unpredictably).
  return (static_cast<std::size_t>(std::bit_width(value | 1)) + 6) / 7;
}

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
