// Internal: fp32 values as four byte planes (plane k holds byte k of every value's
// little-endian bits), which groups the near-constant sign/exponent bytes and the mostly-zero
// low mantissa bytes of pseudo-gradient values so zstd's entropy stage codes each well.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace pulseloco::codec::detail {

// planes: 4 * values.size() bytes, plane k at planes + k * n.
void split_planes(std::span<const float> values, std::byte* planes) noexcept;

// The four planes of n values, each n bytes (they need not be adjacent).
struct PlanePointers {
  const std::byte* plane[4] = {};
};

// The inverse of split_planes: writes n values.
void merge_planes(const PlanePointers& planes, std::size_t n, float* out) noexcept;

// Index of the first NaN or infinity, or n when all are finite.
[[nodiscard]] std::size_t first_non_finite(std::span<const float> values) noexcept;
[[nodiscard]] std::size_t first_non_finite_in_planes(const PlanePointers& planes,
                                                     std::size_t n) noexcept;

// Sparse form of a plane whose bytes are mostly zero (the low mantissa byte of values on a
// fine power-of-two grid): a bitmap of ceil(n / 8) bytes, bit i (LSB first) set exactly when
// byte i is non-zero, followed by the non-zero bytes in order.
[[nodiscard]] std::size_t count_zero_bytes(const std::byte* plane, std::size_t n) noexcept;
[[nodiscard]] inline std::size_t sparse_plane_bytes(std::size_t n, std::size_t nonzero) noexcept {
  return (n + 7) / 8 + nonzero;
}
// Writes sparse_plane_bytes(n, nonzero) bytes (nonzero = n - count_zero_bytes(plane, n)).
void encode_sparse_plane(const std::byte* plane, std::size_t n, std::byte* out) noexcept;
// Expands `stream` (exactly sparse_plane_bytes(n, nonzero) bytes) into n plane bytes after
// checking it: zero padding bits, exactly `nonzero` bits set, no listed byte zero.
// Throws ProtocolError naming `what` at `byte_offset`.
void decode_sparse_plane(std::span<const std::byte> stream, std::size_t n, std::size_t nonzero,
                         std::byte* out, std::uint64_t byte_offset, const std::string& what);

}  // namespace pulseloco::codec::detail
