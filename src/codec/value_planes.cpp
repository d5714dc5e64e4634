#include <pulseloco/codec/value_planes.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include <pulseloco/codec/wire.h>

namespace pulseloco::codec::detail {

// The loops below are written so that GCC and Clang vectorise them at -O2/-O3 with the
// baseline ISA (no run-time dispatch needed: they are bound by memory, not by arithmetic).

void split_planes(std::span<const float> values, std::byte* planes) noexcept {
  const std::size_t n = values.size();
  auto* p0 = reinterpret_cast<std::uint8_t*>(planes);
  auto* p1 = p0 + n;
  auto* p2 = p1 + n;
  auto* p3 = p2 + n;
  const float* v = values.data();
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, v + i, sizeof bits);
    p0[i] = static_cast<std::uint8_t>(bits);
    p1[i] = static_cast<std::uint8_t>(bits >> 8);
    p2[i] = static_cast<std::uint8_t>(bits >> 16);
    p3[i] = static_cast<std::uint8_t>(bits >> 24);
  }
}

void merge_planes(const PlanePointers& planes, std::size_t n, float* out) noexcept {
  const auto* p0 = reinterpret_cast<const std::uint8_t*>(planes.plane[0]);
  const auto* p1 = reinterpret_cast<const std::uint8_t*>(planes.plane[1]);
  const auto* p2 = reinterpret_cast<const std::uint8_t*>(planes.plane[2]);
  const auto* p3 = reinterpret_cast<const std::uint8_t*>(planes.plane[3]);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t bits = std::uint32_t{p0[i]} | (std::uint32_t{p1[i]} << 8) |
                               (std::uint32_t{p2[i]} << 16) | (std::uint32_t{p3[i]} << 24);
    std::memcpy(out + i, &bits, sizeof bits);
  }
}

std::size_t first_non_finite(std::span<const float> values) noexcept {
  const std::size_t n = values.size();
  std::uint32_t any = 0;
  for (std::size_t i = 0; i < n; ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, values.data() + i, sizeof bits);
    any |= static_cast<std::uint32_t>((bits & 0x7F800000u) == 0x7F800000u);
  }
  if (any == 0) return n;
  for (std::size_t i = 0; i < n; ++i) {
    if ((std::bit_cast<std::uint32_t>(values[i]) & 0x7F800000u) == 0x7F800000u) return i;
  }
  return n;
}

std::size_t first_non_finite_in_planes(const PlanePointers& planes, std::size_t n) noexcept {
  // The exponent is all ones exactly when plane 3 has its low 7 bits set and plane 2 its top bit.
  const auto* p2 = reinterpret_cast<const std::uint8_t*>(planes.plane[2]);
  const auto* p3 = reinterpret_cast<const std::uint8_t*>(planes.plane[3]);
  std::uint8_t any = 0;
  for (std::size_t i = 0; i < n; ++i) {
    any |= static_cast<std::uint8_t>(((p3[i] | 0x80) & (p2[i] | 0x7F)) == 0xFF);
  }
  if (any == 0) return n;
  for (std::size_t i = 0; i < n; ++i) {
    if (((p3[i] | 0x80) & (p2[i] | 0x7F)) == 0xFF) return i;
  }
  return n;
}

std::size_t count_zero_bytes(const std::byte* plane, std::size_t n) noexcept {
  const auto* p = reinterpret_cast<const std::uint8_t*>(plane);
  std::size_t zeros = 0;
  for (std::size_t i = 0; i < n; ++i)
    zeros += static_cast<std::size_t>(p[i] == 0);
  return zeros;
}

namespace {

// Population count without relying on the POPCNT instruction (the library is built for the
// x86-64 baseline, where std::popcount becomes a libgcc call).
[[nodiscard]] inline unsigned popcount64(std::uint64_t x) noexcept {
  x = x - ((x >> 1) & 0x5555555555555555ull);
  x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
  x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
  return static_cast<unsigned>((x * 0x0101010101010101ull) >> 56);
}

// Bit i of the result is set when byte i of the 8 bytes at p is non-zero.
[[nodiscard]] inline std::uint8_t nonzero_mask8(const std::uint8_t* p) noexcept {
  std::uint64_t word;
  std::memcpy(&word, p, sizeof word);
  // High bit of each byte: set when the byte is non-zero.
  const std::uint64_t high = ((word & 0x7F7F7F7F7F7F7F7Full) + 0x7F7F7F7F7F7F7F7Full) | word;
  const std::uint64_t bits = high & 0x8080808080808080ull;
  // Gather the 8 high bits into one byte (bit 7 of byte i -> bit i).
  return static_cast<std::uint8_t>((bits * 0x0002040810204081ull) >> 56);
}

}  // namespace

void encode_sparse_plane(const std::byte* plane, std::size_t n, std::byte* out) noexcept {
  const auto* p = reinterpret_cast<const std::uint8_t*>(plane);
  auto* bitmap = reinterpret_cast<std::uint8_t*>(out);
  const std::size_t bitmap_bytes = (n + 7) / 8;
  std::uint8_t* listed = bitmap + bitmap_bytes;
  const std::size_t whole = n / 8;
  for (std::size_t b = 0; b < whole; ++b) {
    std::uint8_t mask = nonzero_mask8(p + 8 * b);
    bitmap[b] = mask;
    while (mask != 0) {
      *listed++ = p[8 * b + static_cast<unsigned>(std::countr_zero(mask))];
      mask = static_cast<std::uint8_t>(mask & (mask - 1));
    }
  }
  if (whole != bitmap_bytes) {
    std::uint8_t mask = 0;
    for (std::size_t i = 8 * whole; i < n; ++i) {
      if (p[i] != 0) {
        mask = static_cast<std::uint8_t>(mask | (1u << (i - 8 * whole)));
        *listed++ = p[i];
      }
    }
    bitmap[whole] = mask;
  }
}

void decode_sparse_plane(std::span<const std::byte> stream, std::size_t n, std::size_t nonzero,
                         std::byte* out, std::uint64_t byte_offset, const std::string& what) {
  const std::size_t bitmap_bytes = (n + 7) / 8;
  if (stream.size() != bitmap_bytes + nonzero) {
    wire::fail(what + ": sparse plane of " + std::to_string(stream.size()) + " bytes, expected " +
                   std::to_string(bitmap_bytes + nonzero),
               byte_offset);
  }
  const auto* bitmap = reinterpret_cast<const std::uint8_t*>(stream.data());
  const std::uint8_t* listed = bitmap + bitmap_bytes;
  if (n % 8 != 0 && (bitmap[bitmap_bytes - 1] >> (n % 8)) != 0) {
    wire::fail(what + ": non-zero padding bits in the sparse plane bitmap", byte_offset);
  }
  std::size_t set = 0;
  std::size_t b = 0;
  for (; b + 8 <= bitmap_bytes; b += 8) {
    std::uint64_t word;
    std::memcpy(&word, bitmap + b, sizeof word);
    set += popcount64(word);
  }
  for (; b < bitmap_bytes; ++b)
    set += popcount64(bitmap[b]);
  if (set != nonzero) {
    wire::fail(what + ": sparse plane bitmap marks " + std::to_string(set) +
                   " non-zero bytes, the directory " + std::to_string(nonzero),
               byte_offset);
  }
  std::uint8_t any_zero = 0;
  for (std::size_t j = 0; j < nonzero; ++j)
    any_zero |= static_cast<std::uint8_t>(listed[j] == 0);
  if (any_zero != 0) {
    wire::fail(what + ": sparse plane lists a zero byte", byte_offset);
  }
  // Valid: expand 64 entries at a time, zero-filling and then placing each listed byte.
  auto* o = reinterpret_cast<std::uint8_t*>(out);
  std::memset(o, 0, n);
  for (b = 0; b < bitmap_bytes; b += 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, bitmap + b, std::min<std::size_t>(8, bitmap_bytes - b));
    std::uint8_t* base = o + 8 * b;
    while (word != 0) {
      *(base + std::countr_zero(word)) = *listed++;
      word &= word - 1;
    }
  }
}

}  // namespace pulseloco::codec::detail
