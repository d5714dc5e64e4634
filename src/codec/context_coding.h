// Internal: the context-coded frame (encoding `context`, docs/wire-format.md, "Payload:
// context"). Its values are coded against the fp32 bits every receiver already holds at the same
// element (θ_g, the "context"):
//   D = (exponent(value) - exponent(context)) mod 256          one byte per entry (entropy-coded)
//   U = (D + trailing zeros of the value's 23-bit mantissa) mod 256   one byte (entropy-coded)
//   the sign and the mantissa bits above its lowest set bit, raw (1 + 22 - tz bits, or 1)
// A value on the fp32 grid of its context's exponent has a small U; one whose magnitude follows
// the context's has a peaked D. Every fp32 bit pattern codes losslessly against every context
// bit pattern (NaN, infinity, zero and subnormals included): both bytes are taken modulo 256.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <pulseloco/codec/message.h>

namespace pulseloco::codec::detail {

// Streams of a context frame: the index coding's bytes, the D bytes, the U bytes, the raw bits.
inline constexpr int kContextStreams = 4;
inline constexpr int kContextIndexStream = 0;
inline constexpr int kContextRawBitsStream = 3;
// Streams 0-2 may be zstd frames; the raw bits never are.
inline constexpr std::uint8_t kContextZstdMask = 0x07;
// The most raw bits one entry takes: the sign and 22 mantissa bits.
inline constexpr std::uint64_t kContextMaxBitsPerEntry = 23;

// The split of n values against their contexts. `d` and `u` have n bytes; `bits` receives
// ceil(total / 8) bytes (room: raw_bits_capacity(n)), the last byte's padding zero. Returns the
// number of raw bits written.
[[nodiscard]] inline std::uint64_t raw_bits_capacity(std::uint64_t n) noexcept {
  return (n * kContextMaxBitsPerEntry + 7) / 8 + 8;
}
// Only the context's exponent fields are read: from `exponents` (one byte per chunk element, as
// the exponent_groups coding has computed them) where given, else from `context`, at the
// offsets; the bytes are in cache where θ_g's words at scattered offsets are not.
std::uint64_t split_against_context(std::span<const std::uint32_t> offsets,
                                    std::span<const float> values, std::span<const float> context,
                                    const std::uint8_t* exponents, std::uint8_t* d, std::uint8_t* u,
                                    std::byte* bits) noexcept;

// The raw bits the entries of symbols d, u need; an invalid pair (trailing zeros above 23)
// gives its entry's index in `bad_entry`, else bad_entry = n.
struct RawBitsNeed {
  std::uint64_t bits = 0;
  std::size_t bad_entry = 0;
};
[[nodiscard]] RawBitsNeed raw_bits_needed(const std::uint8_t* d, const std::uint8_t* u,
                                          std::size_t n) noexcept;

// Rebuilds n values from validated symbols and raw bits (bits.size() == ceil(need / 8), followed
// by 8 readable bytes) against the contexts at `offsets`. Returns the first entry whose value is
// not finite, or n. `exponents` as in split_against_context.
std::size_t join_against_context(std::span<const std::uint32_t> offsets,
                                 std::span<const float> context, const std::uint8_t* exponents,
                                 const std::uint8_t* d, const std::uint8_t* u,
                                 const std::byte* bits, float* out) noexcept;

// The xxh3-64 of n values' bit patterns (little-endian), carried by a context frame so that a
// receiver decoding against different context bits fails instead of returning other values.
// A frame whose indices are coded against the context (exponent_groups) digests its offsets too:
// the xxh3-64 of the values seeded with the xxh3-64 of the offsets (uint32, little-endian).
[[nodiscard]] std::uint64_t values_digest(std::span<const float> values) noexcept;
[[nodiscard]] std::uint64_t entries_digest(std::span<const std::uint32_t> offsets,
                                           std::span<const float> values) noexcept;

// Where the streams of a context frame are, after its directory was checked against the frame.
struct ContextLayout {
  std::uint64_t index_raw_bytes = 0;
  std::uint64_t directory_bytes = 0;
  std::uint64_t digest = 0;
  std::array<std::uint64_t, kContextStreams> decoded{};  // raw bits: stored size
  std::array<std::span<const std::byte>, kContextStreams> stored{};
  std::array<std::uint64_t, kContextStreams> offset{};  // in the message
  std::array<bool, kContextStreams> compressed{};
};

// Parses and checks the directory of a context frame with entries >= 1.
[[nodiscard]] ContextLayout parse_context_layout(std::span<const std::byte> payload,
                                                 std::uint64_t payload_offset,
                                                 const FrameInfo& info, std::uint8_t zstd_streams,
                                                 std::size_t frame_index);

}  // namespace pulseloco::codec::detail
