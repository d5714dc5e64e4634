// Internal: the three index codings of a pulse frame (docs/wire-format.md, "Index codings").
//
// All three code a strictly ascending list of n offsets below `length` (length <= 2^31):
//   varint      LEB128 of the gaps d_0 = o_0, d_i = o_i - o_{i-1} - 1
//   bitpack     the same gaps in blocks of 128, each block a width byte then the gaps packed
//   elias_fano  Elias-Fano over the offsets: n low parts of l bits, then the high parts in unary
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <pulseloco/codec/message.h>

namespace pulseloco::codec::detail {

inline constexpr std::size_t kBitpackBlock = 128;
// Decoders read whole 64-bit words; raw index streams are staged with this much zero padding.
inline constexpr std::size_t kIndexPadding = 16;

// gaps[i] = offsets[i] - offsets[i-1] - 1 (gaps[0] = offsets[0]); `gaps` has offsets.size().
void compute_gaps(std::span<const std::uint32_t> offsets, std::uint32_t* gaps) noexcept;

// Bytes each coding needs for the offsets (valid: strictly ascending, < length <= 2^31) whose
// gaps are `gaps`.
struct IndexCodingSizes {
  std::uint64_t varint = 0;
  std::uint64_t bitpack = 0;
  std::uint64_t elias_fano = 0;

  [[nodiscard]] std::uint64_t of(IndexCoding coding) const noexcept;
};
[[nodiscard]] IndexCodingSizes index_coding_sizes(std::span<const std::uint32_t> gaps,
                                                  std::uint64_t length) noexcept;

// Elias-Fano's size depends only on n and length (so the decoder can check it exactly).
[[nodiscard]] unsigned elias_fano_low_bits(std::uint64_t n, std::uint64_t length) noexcept;
[[nodiscard]] std::uint64_t elias_fano_bytes(std::uint64_t n, std::uint64_t length) noexcept;

// The range of raw sizes a coding of n offsets below `length` can have (n >= 1).
struct SizeRange {
  std::uint64_t min = 0;
  std::uint64_t max = 0;
};
[[nodiscard]] SizeRange index_raw_size_range(IndexCoding coding, std::uint64_t n,
                                             std::uint64_t length) noexcept;

// Writes exactly index_coding_sizes(gaps, length).of(coding) bytes to `out`.
void encode_indices(IndexCoding coding, std::span<const std::uint32_t> offsets,
                    std::span<const std::uint32_t> gaps, std::uint64_t length,
                    std::byte* out) noexcept;

// Decodes n offsets from `raw` into `out` (room for n) and checks that the stream is exactly
// consumed, canonical, strictly ascending and below `length`. `raw` must be followed by
// kIndexPadding readable zero bytes. Throws ProtocolError; `stream_offset` is where `raw`
// starts in the message (or where its compressed form starts, when it was compressed).
void decode_indices(IndexCoding coding, std::span<const std::byte> raw, std::uint64_t n,
                    std::uint64_t length, std::uint32_t* out, std::uint64_t stream_offset,
                    bool stream_was_compressed);

}  // namespace pulseloco::codec::detail
