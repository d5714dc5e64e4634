// Internal: the context-coded frame (encoding `context`, docs/wire-format.md, "Payload:
// context"). Its values are coded against the fp32 bits every receiver already holds at the same
// element (θ_g, the "context"):
//   D = (exponent(value) - exponent(context)) mod 256          range coded, by context exponent
//   U = (D + trailing zeros of the value's 23-bit mantissa) mod 256   range coded, by D
//   the sign and the mantissa bits above its lowest set bit, raw (1 + 22 - tz bits, or 1)
// A value on the fp32 grid of its context's exponent has a small U; one whose magnitude follows
// the context's has a peaked D. Every fp32 bit pattern codes losslessly against every context
// bit pattern (NaN, infinity, zero and subnormals included): both bytes are taken modulo 256.
// A frame whose values carry their context's bf16 cast residue codes them less it (the value
// flag kContextLessResidue), when the encoder finds that exact.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/codec/range_coder.h>

namespace pulseloco::codec::detail {

// Streams of a context frame: the index coding's bytes, the symbol stream (D and U, range
// coded), the raw bits.
inline constexpr int kContextStreams = 3;
inline constexpr int kContextIndexStream = 0;
inline constexpr int kContextSymbolStream = 1;
inline constexpr int kContextRawBitsStream = 2;
// Only the index stream may be a zstd frame.
inline constexpr std::uint8_t kContextZstdMask = 0x01;
// A context frame's value flags (frame byte 7): bit 0, its values are coded less their
// context's bf16 cast residue (remove_context_residue); bit 1 (only with bit 0), less a multiple
// of it per entry, each entry's multiple coded in the symbol stream (a reduced range's sum of k
// ranks' values carries k residues).
inline constexpr std::uint8_t kContextLessResidue = 0x01;
inline constexpr std::uint8_t kContextResidueMultiples = 0x02;
inline constexpr std::uint8_t kContextValueFlagsMask = 0x03;
// The most raw bits one entry takes: the sign and 22 mantissa bits.
inline constexpr std::uint64_t kContextMaxBitsPerEntry = 23;
// Tree depths of the symbol stream's binarisation (context_coding.cpp).
inline constexpr unsigned kExponentTreeBits = 6;
inline constexpr unsigned kZeroRunTreeBits = 5;
inline constexpr unsigned kMultipleTreeBits = 8;
// The most bytes the symbol stream takes per entry: every decision of both trees at its
// costliest probability (11 bits) and both escapes' 16 direct bits, plus the coder's 5 bytes;
// with residue multiples, their repeat decision and tree (9 decisions) on top.
inline constexpr std::uint64_t kContextMaxSymbolBytesPerEntry = 20;
inline constexpr std::uint64_t kContextMaxMultipleBytesPerEntry = 13;
inline constexpr std::uint64_t kContextSymbolStreamOverhead = 5;

// The split of n values against their contexts. `d` and `u` have n bytes; `bits` receives
// ceil(total / 8) bytes (room: raw_bits_capacity(n)), the last byte's padding zero. Returns the
// number of raw bits written.
[[nodiscard]] inline std::uint64_t raw_bits_capacity(std::uint64_t n) noexcept {
  return (n * kContextMaxBitsPerEntry + 7) / 8 + 8;
}
// Only the context's exponent fields are read: from `exponents` (one byte per chunk element, as
// the exponent_groups coding has computed them) where given, else from `context`, at the
// offsets; the bytes are in cache where θ_g's words at scattered offsets are not. `e` receives
// each entry's context exponent (n bytes).
std::uint64_t split_against_context(std::span<const std::uint32_t> offsets,
                                    std::span<const float> values, std::span<const float> context,
                                    const std::uint8_t* exponents, std::uint8_t* e, std::uint8_t* d,
                                    std::uint8_t* u, std::byte* bits) noexcept;

// The raw bits the entries of symbols d, u need; an invalid pair (trailing zeros above 23)
// gives its entry's index in `bad_entry`, else bad_entry = n.
struct RawBitsNeed {
  std::uint64_t bits = 0;
  std::size_t bad_entry = 0;
};
[[nodiscard]] RawBitsNeed raw_bits_needed(const std::uint8_t* d, const std::uint8_t* u,
                                          std::size_t n) noexcept;

// The context exponents of the entries at `offsets` (what split_against_context gives the
// encoder), for the decoder; `exponents` as there.
void gather_context_exponents(std::span<const std::uint32_t> offsets,
                              std::span<const float> context, const std::uint8_t* exponents,
                              std::uint8_t* e) noexcept;

// Rebuilds n values from their context exponents `e`, validated symbols and raw bits
// (bits.size() == ceil(need / 8), followed by 8 readable bytes). Returns the first entry whose
// value is not finite, or n.
[[nodiscard]] std::size_t join_against_context(std::size_t n, const std::uint8_t* e,
                                               const std::uint8_t* d, const std::uint8_t* u,
                                               const std::byte* bits, float* out) noexcept;

// The context's bf16 cast residue, fl(c - bf16(c)): the part of θ_g a bf16 forward pass does
// not see (exact for finite c). With bf16 local weights and the authors' Δ = θ_g - θ_l, every
// s carries the residue of its element's θ_g, and the residue fills s's low mantissa bits, which
// the receiver can then take from its own θ_g instead of the raw bit stream.
[[nodiscard]] inline float context_residue(float context) noexcept {
  return context - round_to_bf16(context);
}

// An entry's residue multiple k: what its value carries, k times its context's residue r, is
// fl(k · r) (exact: r has at most 16 significant bits, k at most 8).
[[nodiscard]] inline float residue_times(float context, std::uint8_t multiple) noexcept {
  return static_cast<float>(multiple) * context_residue(context);
}

// Encoder: writes fl(v - fl(k·r)) for every value v, its multiple k (multiples[i], or 1 where
// `multiples` is empty) and its context's residue r to `out`, and k to `coded_multiples`; an
// entry for which adding fl(k·r) back does not give v's bits gets k = 0 (its value as it is).
// Returns true when that leaves fewer than half the raw bits of the values themselves over the
// first kResidueProbeEntries entries, and fewer over all; else false (`out` and
// `coded_multiples` are then scratch).
inline constexpr std::size_t kResidueProbeEntries = 64;
[[nodiscard]] bool remove_context_residue(std::span<const std::uint32_t> offsets,
                                          std::span<const float> values,
                                          std::span<const float> context,
                                          std::span<const std::uint8_t> multiples, float* out,
                                          std::uint8_t* coded_multiples) noexcept;

// Decoder: values[i] = fl(values[i] + fl(k·r)) with r the residue of the context at offsets[i]
// and k = multiples[i] (1 where `multiples` is null); values[i] unchanged where k = 0. Returns
// the first entry whose value is then not finite, or offsets.size().
[[nodiscard]] std::size_t add_context_residue(std::span<const std::uint32_t> offsets,
                                              std::span<const float> context,
                                              const std::uint8_t* multiples,
                                              float* values) noexcept;

// The adaptive models of a frame's symbol stream: a tree for D per context exponent, a tree for
// U per bucket of D, and for residue multiples a decision "the previous entry's multiple" and a
// tree for the others. Reset at every frame, so that frames decode independently.
struct SymbolModels {
  std::array<std::array<BitModel, std::size_t{1} << kExponentTreeBits>, 256> exponent{};
  std::array<std::array<BitModel, std::size_t{1} << kZeroRunTreeBits>, 16> zero_run{};
  BitModel multiple_repeats{};
  std::array<BitModel, std::size_t{1} << kMultipleTreeBits> multiple{};
  void reset() noexcept;
};

// Range-codes the n entries' D and U under `models` (reset first) into `out` (room:
// symbol_stream_capacity(n)). Returns the stream's size.
[[nodiscard]] inline std::uint64_t symbol_stream_capacity(std::uint64_t n,
                                                          bool multiples) noexcept {
  return n * (kContextMaxSymbolBytesPerEntry + (multiples ? kContextMaxMultipleBytesPerEntry : 0)) +
         kContextSymbolStreamOverhead;
}
// With `k` (n residue multiples, or null: none coded), each entry's multiple goes before its D.
[[nodiscard]] std::size_t encode_symbols(const std::uint8_t* e, const std::uint8_t* d,
                                         const std::uint8_t* u, const std::uint8_t* k,
                                         std::size_t n, SymbolModels& models,
                                         std::byte* out) noexcept;
// Decodes n entries' D and U (and, with `k`, their multiples) from exactly `in`; false when
// `in` is not a stream that encode_symbols writes for n entries (too short, bytes left over, a
// non-canonical escape or multiple).
[[nodiscard]] bool decode_symbols(std::span<const std::byte> in, const std::uint8_t* e,
                                  std::size_t n, SymbolModels& models, std::uint8_t* d,
                                  std::uint8_t* u, std::uint8_t* k) noexcept;

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
