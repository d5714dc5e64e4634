#include <pulseloco/codec/context_coding.h>

#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/codec/index_coding.h>
#include <pulseloco/codec/message_parse.h>
#include <pulseloco/codec/wire.h>

namespace pulseloco::codec::detail {

namespace {

constexpr std::uint32_t kMantissaMask = 0x7FFFFFu;
constexpr std::size_t kPrefetchAhead = 16;  // entries

inline std::uint32_t exponent_of(std::uint32_t bits) noexcept {
  return (bits >> 23) & 0xFFu;
}

// Raw bits of an entry whose mantissa has `tz` trailing zeros (23: the mantissa is zero): the
// sign, then the mantissa bits above the lowest set one.
inline unsigned raw_width(unsigned tz) noexcept {
  return tz >= 22 ? 1u : 23u - tz;
}

// Fired elements are tens of elements apart: each read of θ_g is a cache miss unless fetched
// ahead.
inline void prefetch_context(const float* context, std::span<const std::uint32_t> offsets,
                             std::size_t i) noexcept {
  if (i + kPrefetchAhead < offsets.size())
    __builtin_prefetch(context + offsets[i + kPrefetchAhead]);
}

// The exponent field of the context at an offset: from the exponent bytes where given, else
// from θ_g's word.
struct ContextExponent {
  const float* context;
  const std::uint8_t* exponents;
  std::uint32_t operator()(std::uint32_t offset) const noexcept {
    return exponents != nullptr ? exponents[offset]
                                : exponent_of(std::bit_cast<std::uint32_t>(context[offset]));
  }
  // The exponent bytes of a chunk are few enough to stay cached; θ_g's words are not.
  void prefetch(std::span<const std::uint32_t> offsets, std::size_t i) const noexcept {
    if (exponents == nullptr) prefetch_context(context, offsets, i);
  }
};

}  // namespace

std::uint64_t split_against_context(std::span<const std::uint32_t> offsets,
                                    std::span<const float> values, std::span<const float> context,
                                    const std::uint8_t* exponents, std::uint8_t* e, std::uint8_t* d,
                                    std::uint8_t* u, std::byte* bits) noexcept {
  const std::size_t n = values.size();
  const ContextExponent context_exponent{context.data(), exponents};
  std::uint64_t acc = 0;
  unsigned pending = 0;  // bits in acc, < 32 between entries
  std::byte* out = bits;
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    context_exponent.prefetch(offsets, i);
    const auto v = std::bit_cast<std::uint32_t>(values[i]);
    const std::uint32_t c = context_exponent(offsets[i]);
    const std::uint32_t delta = (exponent_of(v) - c) & 0xFFu;
    e[i] = static_cast<std::uint8_t>(c);
    const std::uint32_t mantissa = v & kMantissaMask;
    const auto tz = static_cast<unsigned>(std::countr_zero(mantissa | (kMantissaMask + 1)));
    d[i] = static_cast<std::uint8_t>(delta);
    u[i] = static_cast<std::uint8_t>(delta + tz);
    const unsigned width = raw_width(tz);
    const std::uint64_t payload =
        (v >> 31) | (tz >= 22 ? 0u : static_cast<std::uint64_t>(mantissa >> (tz + 1)) << 1);
    acc |= payload << pending;
    pending += width;
    total += width;
    if (pending >= 32) {
      store_le<std::uint32_t>(out, static_cast<std::uint32_t>(acc));
      out += 4;
      acc >>= 32;
      pending -= 32;
    }
  }
  for (; pending > 0; pending = pending > 8 ? pending - 8 : 0) {
    *out++ = static_cast<std::byte>(acc & 0xFFu);
    acc >>= 8;
  }
  return total;
}

RawBitsNeed raw_bits_needed(const std::uint8_t* d, const std::uint8_t* u, std::size_t n) noexcept {
  RawBitsNeed need{.bits = 0, .bad_entry = n};
  for (std::size_t i = 0; i < n; ++i) {
    const auto tz = static_cast<std::uint8_t>(u[i] - d[i]);
    if (tz > 23) {
      need.bad_entry = i;
      return need;
    }
    need.bits += raw_width(tz);
  }
  return need;
}

void gather_context_exponents(std::span<const std::uint32_t> offsets,
                              std::span<const float> context, const std::uint8_t* exponents,
                              std::uint8_t* e) noexcept {
  const ContextExponent context_exponent{context.data(), exponents};
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    context_exponent.prefetch(offsets, i);
    e[i] = static_cast<std::uint8_t>(context_exponent(offsets[i]));
  }
}

std::size_t join_against_context(std::size_t n, const std::uint8_t* e, const std::uint8_t* d,
                                 const std::uint8_t* u, const std::byte* bits,
                                 float* out) noexcept {
  std::size_t first_bad = n;
  std::uint64_t position = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const auto tz = static_cast<unsigned>(static_cast<std::uint8_t>(u[i] - d[i]));
    const std::uint32_t exponent = (e[i] + d[i]) & 0xFFu;
    const unsigned width = raw_width(tz);
    const std::uint64_t word = load_le<std::uint64_t>(bits + (position >> 3)) >> (position & 7);
    const auto x = static_cast<std::uint32_t>(word & ((std::uint64_t{1} << width) - 1));
    position += width;
    const std::uint32_t mantissa =
        tz == 23 ? 0u : ((tz == 22 ? 0u : (x >> 1) << (tz + 1)) | (1u << tz));
    const std::uint32_t v = ((x & 1u) << 31) | (exponent << 23) | mantissa;
    if (exponent == 0xFFu && first_bad == n) first_bad = i;
    out[i] = std::bit_cast<float>(v);
  }
  return first_bad;
}

namespace {

// The raw bits split_against_context takes for a value.
inline unsigned raw_width_of(float value) noexcept {
  const std::uint32_t mantissa = std::bit_cast<std::uint32_t>(value) & kMantissaMask;
  return raw_width(static_cast<unsigned>(std::countr_zero(mantissa | (kMantissaMask + 1))));
}

}  // namespace

bool remove_context_residue(std::span<const std::uint32_t> offsets, std::span<const float> values,
                            std::span<const float> context, std::span<const std::uint8_t> multiples,
                            float* out, std::uint8_t* coded_multiples) noexcept {
  std::uint64_t bits_kept = 0;
  std::uint64_t bits_removed = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    // Values that carry the residue lose most of their raw bits without it; values that do not
    // (fp32 local weights, `exact` Δ) keep about as many, and show it in their first entries:
    // the rest of θ_g's words are then not read.
    if (i == kResidueProbeEntries && 2 * bits_removed >= bits_kept) return false;
    prefetch_context(context.data(), offsets, i);
    std::uint8_t multiple = multiples.empty() ? std::uint8_t{1} : multiples[i];
    const float residue = residue_times(context[offsets[i]], multiple);
    float removed = values[i] - residue;
    // fp32 arithmetic does not promise the round trip (a value whose own ulp lies above the
    // residue's lowest bits, -0, a context that is not finite): such an entry keeps its value.
    if (std::bit_cast<std::uint32_t>(removed + residue) !=
        std::bit_cast<std::uint32_t>(values[i])) {
      multiple = 0;
      removed = values[i];
    }
    bits_kept += raw_width_of(values[i]);
    bits_removed += raw_width_of(removed);
    out[i] = removed;
    coded_multiples[i] = multiple;
  }
  return bits_removed < bits_kept;
}

std::size_t add_context_residue(std::span<const std::uint32_t> offsets,
                                std::span<const float> context, const std::uint8_t* multiples,
                                float* values) noexcept {
  std::size_t first_bad = offsets.size();
  for (std::size_t i = 0; i < offsets.size(); ++i) {
    prefetch_context(context.data(), offsets, i);
    const std::uint8_t multiple = multiples == nullptr ? std::uint8_t{1} : multiples[i];
    // Multiple 0: the value as coded (adding 0 · r could turn -0 into +0, or a value into NaN).
    if (multiple != 0) values[i] = values[i] + residue_times(context[offsets[i]], multiple);
    if (!std::isfinite(values[i]) && first_bad == offsets.size()) first_bad = i;
  }
  return first_bad;
}

namespace {

// The symbols' binarisation (docs/wire-format.md, "Symbol stream"): D as a 6-bit tree symbol
// (D + 24) mod 256 under the context exponent's models, U as a 5-bit tree symbol (U + 8) mod 256
// under the models of D's bucket; the tree's last symbol escapes to the byte's 8 bits, coded
// directly.
constexpr unsigned kExponentBias = 24;
constexpr unsigned kZeroRunBias = 8;

inline unsigned zero_run_context(std::uint8_t d) noexcept {
  const int delta = static_cast<std::int8_t>(d);
  return static_cast<unsigned>(std::clamp(delta, -12, 3) + 12);
}

}  // namespace

void SymbolModels::reset() noexcept {
  for (auto& tree : exponent)
    tree.fill(BitModel{});
  for (auto& tree : zero_run)
    tree.fill(BitModel{});
  multiple_repeats = BitModel{};
  multiple.fill(BitModel{});
}

std::size_t encode_symbols(const std::uint8_t* e, const std::uint8_t* d, const std::uint8_t* u,
                           const std::uint8_t* k, std::size_t n, SymbolModels& models,
                           std::byte* out) noexcept {
  models.reset();
  RangeEncoder encoder(out);
  // A multiple repeats the previous entry's (1 before the first) or is coded on its tree.
  std::uint8_t previous_multiple = 1;
  const auto code = [&encoder](BitModel* tree, unsigned bits, std::uint8_t symbol, unsigned bias) {
    const unsigned escape = (1u << bits) - 1;
    const unsigned mapped = static_cast<std::uint8_t>(symbol + bias);
    encoder.encode_tree(tree, bits, mapped < escape ? mapped : escape);
    if (mapped >= escape) {
      for (unsigned b = 8; b-- > 0;)
        encoder.encode_direct((symbol >> b) & 1u);
    }
  };
  for (std::size_t i = 0; i < n; ++i) {
    if (k != nullptr) {
      const bool repeats = k[i] == previous_multiple;
      encoder.encode(models.multiple_repeats, repeats ? 0u : 1u);
      if (!repeats) encoder.encode_tree(models.multiple.data(), kMultipleTreeBits, k[i]);
      previous_multiple = k[i];
    }
    code(models.exponent[e[i]].data(), kExponentTreeBits, d[i], kExponentBias);
    code(models.zero_run[zero_run_context(d[i])].data(), kZeroRunTreeBits, u[i], kZeroRunBias);
  }
  return static_cast<std::size_t>(encoder.finish() - out);
}

bool decode_symbols(std::span<const std::byte> in, const std::uint8_t* e, std::size_t n,
                    SymbolModels& models, std::uint8_t* d, std::uint8_t* u,
                    std::uint8_t* k) noexcept {
  models.reset();
  RangeDecoder decoder(in);
  bool canonical = true;
  std::uint8_t previous_multiple = 1;
  const auto decode = [&decoder, &canonical](BitModel* tree, unsigned bits, unsigned bias) {
    const unsigned escape = (1u << bits) - 1;
    const unsigned mapped = decoder.decode_tree(tree, bits);
    if (mapped < escape) return static_cast<std::uint8_t>(mapped - bias);
    unsigned symbol = 0;
    for (int b = 0; b < 8; ++b)
      symbol = (symbol << 1) | decoder.decode_direct();
    // An escaped byte the tree could have coded is not what an encoder writes.
    if (static_cast<std::uint8_t>(symbol + bias) < escape) canonical = false;
    return static_cast<std::uint8_t>(symbol);
  };
  for (std::size_t i = 0; i < n; ++i) {
    if (k != nullptr) {
      if (decoder.decode(models.multiple_repeats) != 0) {
        const auto multiple = static_cast<std::uint8_t>(
            decoder.decode_tree(models.multiple.data(), kMultipleTreeBits));
        // A repeated multiple coded on the tree is not what an encoder writes.
        if (multiple == previous_multiple) canonical = false;
        previous_multiple = multiple;
      }
      k[i] = previous_multiple;
    }
    d[i] = decode(models.exponent[e[i]].data(), kExponentTreeBits, kExponentBias);
    u[i] = decode(models.zero_run[zero_run_context(d[i])].data(), kZeroRunTreeBits, kZeroRunBias);
  }
  return canonical && decoder.consumed_exactly();
}

std::uint64_t values_digest(std::span<const float> values) noexcept {
  static_assert(std::endian::native == std::endian::little);
  return XXH3_64bits(values.data(), values.size_bytes());
}

std::uint64_t entries_digest(std::span<const std::uint32_t> offsets,
                             std::span<const float> values) noexcept {
  static_assert(std::endian::native == std::endian::little);
  return XXH3_64bits_withSeed(values.data(), values.size_bytes(),
                              XXH3_64bits(offsets.data(), offsets.size_bytes()));
}

ContextLayout parse_context_layout(std::span<const std::byte> payload, std::uint64_t payload_offset,
                                   const FrameInfo& info, std::uint8_t zstd_streams,
                                   std::size_t frame_index) {
  const std::string where = frame_text(frame_index);
  wire::Reader reader(payload, payload_offset);
  ContextLayout layout;
  const std::uint64_t raw_at = reader.offset();
  layout.index_raw_bytes = reader.varint(where + " index stream size");
  const SizeRange range = index_raw_size_range(info.index_coding, info.entries, info.length);
  if (layout.index_raw_bytes < range.min || layout.index_raw_bytes > range.max) {
    wire::fail(where + ": " + std::string(index_coding_name(info.index_coding)) +
                   " index stream of " + std::to_string(info.entries) + " entries cannot be " +
                   std::to_string(layout.index_raw_bytes) + " bytes (allowed " +
                   std::to_string(range.min) + ".." + std::to_string(range.max) + ")",
               raw_at);
  }
  layout.decoded = {layout.index_raw_bytes, 0, 0};
  std::array<std::uint64_t, kContextStreams> stored_size{};
  std::array<std::uint64_t, kContextStreams> size_at{};
  for (int s = 0; s < kContextStreams; ++s) {
    size_at[s] = reader.offset();
    stored_size[s] = reader.varint(where + " stream " + std::to_string(s) + " size");
  }
  layout.digest = reader.get<std::uint64_t>(where + " value digest");
  layout.directory_bytes = reader.offset() - payload_offset;
  // Every entry takes 1 to kContextMaxBitsPerEntry raw bits.
  const std::uint64_t bits_min = (info.entries + 7) / 8;
  const std::uint64_t bits_max = (info.entries * kContextMaxBitsPerEntry + 7) / 8;
  if (stored_size[kContextRawBitsStream] < bits_min ||
      stored_size[kContextRawBitsStream] > bits_max) {
    wire::fail(where + ": raw bit stream of " + std::to_string(info.entries) +
                   " entries cannot be " + std::to_string(stored_size[kContextRawBitsStream]) +
                   " bytes (allowed " + std::to_string(bits_min) + ".." + std::to_string(bits_max) +
                   ")",
               size_at[kContextRawBitsStream]);
  }
  layout.decoded[kContextRawBitsStream] = stored_size[kContextRawBitsStream];
  const std::uint64_t symbols_max = symbol_stream_capacity(info.entries, info.residue_multiples);
  if (stored_size[kContextSymbolStream] < kContextSymbolStreamOverhead ||
      stored_size[kContextSymbolStream] > symbols_max) {
    wire::fail(where + ": symbol stream of " + std::to_string(info.entries) +
                   " entries cannot be " + std::to_string(stored_size[kContextSymbolStream]) +
                   " bytes (allowed " + std::to_string(kContextSymbolStreamOverhead) + ".." +
                   std::to_string(symbols_max) + ")",
               size_at[kContextSymbolStream]);
  }
  layout.decoded[kContextSymbolStream] = stored_size[kContextSymbolStream];
  for (int s = 0; s < kContextStreams; ++s) {
    layout.compressed[s] = ((zstd_streams >> s) & 1u) != 0;
    if (!layout.compressed[s] && stored_size[s] != layout.decoded[s]) {
      wire::fail(where + ": uncompressed stream " + std::to_string(s) + " stores " +
                     std::to_string(stored_size[s]) + " bytes, it decodes to " +
                     std::to_string(layout.decoded[s]),
                 size_at[s]);
    }
    if (layout.compressed[s] && stored_size[s] == 0) {
      wire::fail(where + ": compressed stream " + std::to_string(s) + " is empty", size_at[s]);
    }
    layout.offset[s] = reader.offset();
    layout.stored[s] = reader.take(stored_size[s], where + " stream " + std::to_string(s));
  }
  if (reader.remaining() != 0) {
    wire::fail(
        where + ": " + std::to_string(reader.remaining()) + " payload bytes after the streams",
        reader.offset());
  }
  return layout;
}

}  // namespace pulseloco::codec::detail
