#include <pulseloco/codec/index_coding.h>

#include <algorithm>
#include <bit>
#include <string>

#include <pulseloco/codec/wire.h>

namespace pulseloco::codec::detail {
namespace {

[[nodiscard]] std::uint64_t ceil_div8(std::uint64_t bits) noexcept {
  return (bits + 7) / 8;
}

[[nodiscard]] std::uint64_t load64(const std::uint8_t* p) noexcept {
  std::uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Appends values of up to 32 bits, least significant bit first.
class BitWriter {
 public:
  explicit BitWriter(std::byte* out) noexcept : out_(out) {}
  void put(std::uint64_t value, unsigned width) noexcept {
    acc_ |= value << filled_;
    filled_ += width;
    while (filled_ >= 8) {
      *out_++ = static_cast<std::byte>(acc_ & 0xFF);
      acc_ >>= 8;
      filled_ -= 8;
    }
  }
  // Pads to a byte boundary with zero bits; returns the next byte.
  std::byte* flush() noexcept {
    if (filled_ > 0) *out_++ = static_cast<std::byte>(acc_ & 0xFF);
    acc_ = 0;
    filled_ = 0;
    return out_;
  }

 private:
  std::byte* out_;
  std::uint64_t acc_ = 0;
  unsigned filled_ = 0;
};

[[noreturn]] void index_error(const std::string& reason, std::uint64_t stream_offset,
                              bool compressed, std::uint64_t byte_in_stream) {
  // For a raw stream the offset of the offending byte is exact; inside a compressed stream the
  // best we can name is where that stream starts.
  const std::uint64_t at = compressed ? stream_offset : stream_offset + byte_in_stream;
  wire::fail("index stream: " + reason, at);
}

[[nodiscard]] std::string entry_text(std::uint64_t i) {
  return "entry " + std::to_string(i);
}

// Decodes one canonical LEB128 value of at most 32 bits from p[0..avail). Returns the bytes
// consumed, or 0 with `error` set.
[[nodiscard]] inline std::size_t read_varint32(const std::uint8_t* p, std::size_t avail,
                                               std::uint32_t& value, const char*& error) noexcept {
  std::uint32_t v = 0;
  for (std::size_t k = 0; k < 5; ++k) {
    if (k == avail) {
      error = "truncated varint";
      return 0;
    }
    const std::uint8_t b = p[k];
    if (k == 4 && b > 0x0F) {
      error = "varint exceeds 32 bits";
      return 0;
    }
    v |= static_cast<std::uint32_t>(b & 0x7F) << (7 * k);
    if ((b & 0x80) == 0) {
      if (b == 0 && k > 0) {
        error = "non-canonical varint";
        return 0;
      }
      value = v;
      return k + 1;
    }
  }
  error = "varint longer than 5 bytes";
  return 0;
}

void decode_varint(std::span<const std::byte> raw, std::uint64_t n, std::uint64_t length,
                   std::uint32_t* out, std::uint64_t stream_offset, bool compressed) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(raw.data());
  const std::size_t size = raw.size();
  std::size_t pos = 0;
  std::uint64_t next = 0;  // the smallest value the next offset may take
  for (std::uint64_t i = 0; i < n; ++i) {
    std::uint32_t gap;
    if (pos < size && p[pos] < 0x80) {
      gap = p[pos++];
    } else {
      const char* error = nullptr;
      const std::size_t used = read_varint32(p + pos, size - pos, gap, error);
      if (used == 0)
        index_error(std::string(error) + " at " + entry_text(i), stream_offset, compressed, pos);
      pos += used;
    }
    const std::uint64_t offset = next + gap;
    if (offset >= length) {
      index_error(entry_text(i) + ": offset " + std::to_string(offset) + " is not below length " +
                      std::to_string(length),
                  stream_offset, compressed, pos);
    }
    out[i] = static_cast<std::uint32_t>(offset);
    next = offset + 1;
  }
  if (pos != size) {
    index_error(std::to_string(size - pos) + " bytes left after " + std::to_string(n) + " gaps",
                stream_offset, compressed, pos);
  }
}

void decode_bitpack(std::span<const std::byte> raw, std::uint64_t n, std::uint64_t length,
                    std::uint32_t* out, std::uint64_t stream_offset, bool compressed) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(raw.data());
  const std::size_t size = raw.size();
  std::size_t pos = 0;
  std::uint64_t next = 0;
  for (std::uint64_t i = 0; i < n; i += kBitpackBlock) {
    const std::uint64_t count = std::min<std::uint64_t>(kBitpackBlock, n - i);
    if (pos >= size)
      index_error("truncated before block " + std::to_string(i / kBitpackBlock), stream_offset,
                  compressed, pos);
    const unsigned width = p[pos++];
    if (width > 32)
      index_error("block width " + std::to_string(width) + " exceeds 32", stream_offset, compressed,
                  pos - 1);
    const std::uint64_t bits = count * width;
    const std::uint64_t bytes = ceil_div8(bits);
    if (bytes > size - pos)
      index_error("truncated block " + std::to_string(i / kBitpackBlock), stream_offset, compressed,
                  pos);
    if (bits % 8 != 0 && (p[pos + bytes - 1] >> (bits % 8)) != 0) {
      index_error("non-zero padding bits in block " + std::to_string(i / kBitpackBlock),
                  stream_offset, compressed, pos + bytes - 1);
    }
    const std::uint8_t* block = p + pos;
    const std::uint64_t mask = (std::uint64_t{1} << width) - 1;
    std::uint64_t all_gaps = 0;
    // The caller's zero padding lets every field be read as one unaligned 64-bit load.
    for (std::uint64_t j = 0; j < count; ++j) {
      const std::uint64_t bit = j * width;
      const std::uint64_t gap = (load64(block + bit / 8) >> (bit % 8)) & mask;
      all_gaps |= gap;
      const std::uint64_t offset = next + gap;
      if (offset >= length) {
        index_error(entry_text(i + j) + ": offset " + std::to_string(offset) +
                        " is not below length " + std::to_string(length),
                    stream_offset, compressed, pos + bit / 8);
      }
      out[i + j] = static_cast<std::uint32_t>(offset);
      next = offset + 1;
    }
    // One coding per block: its width is that of its widest gap.
    if (std::bit_width(all_gaps) != width) {
      index_error("block " + std::to_string(i / kBitpackBlock) + " has width " +
                      std::to_string(width) + ", its widest gap needs " +
                      std::to_string(std::bit_width(all_gaps)),
                  stream_offset, compressed, pos - 1);
    }
    pos += bytes;
  }
  if (pos != size) {
    index_error(std::to_string(size - pos) + " bytes left after " + std::to_string(n) + " gaps",
                stream_offset, compressed, pos);
  }
}

void decode_elias_fano(std::span<const std::byte> raw, std::uint64_t n, std::uint64_t length,
                       std::uint32_t* out, std::uint64_t stream_offset, bool compressed) {
  const auto* p = reinterpret_cast<const std::uint8_t*>(raw.data());
  if (raw.size() != elias_fano_bytes(n, length)) {
    index_error("Elias-Fano stream has " + std::to_string(raw.size()) + " bytes, expected " +
                    std::to_string(elias_fano_bytes(n, length)),
                stream_offset, compressed, 0);
  }
  const unsigned low_bits = elias_fano_low_bits(n, length);
  const std::uint64_t low_mask = (std::uint64_t{1} << low_bits) - 1;
  const std::uint64_t lower_bits_total = n * low_bits;
  const std::uint64_t lower_bytes = ceil_div8(lower_bits_total);
  const std::uint64_t upper_bits_total = n + ((length - 1) >> low_bits);
  const std::uint64_t upper_bytes = ceil_div8(upper_bits_total);
  if (lower_bits_total % 8 != 0 && (p[lower_bytes - 1] >> (lower_bits_total % 8)) != 0) {
    index_error("non-zero padding bits after the low parts", stream_offset, compressed,
                lower_bytes - 1);
  }
  const std::uint8_t* upper = p + lower_bytes;
  if (upper_bits_total % 8 != 0 && (upper[upper_bytes - 1] >> (upper_bits_total % 8)) != 0) {
    index_error("non-zero padding bits after the high parts", stream_offset, compressed,
                lower_bytes + upper_bytes - 1);
  }
  std::uint64_t i = 0;
  std::uint64_t previous = 0;
  const std::uint64_t words = (upper_bytes + 7) / 8;  // the last word reads into the padding
  for (std::uint64_t w = 0; w < words; ++w) {
    std::uint64_t word = load64(upper + 8 * w);
    while (word != 0) {
      const auto bit = static_cast<std::uint64_t>(std::countr_zero(word));
      word &= word - 1;
      if (i == n) {
        index_error("more than " + std::to_string(n) + " high parts", stream_offset, compressed,
                    lower_bytes + 8 * w + bit / 8);
      }
      const std::uint64_t high = 64 * w + bit - i;
      const std::uint64_t low_at = i * low_bits;
      const std::uint64_t low =
          low_bits == 0 ? 0 : (load64(p + low_at / 8) >> (low_at % 8)) & low_mask;
      const std::uint64_t offset = (high << low_bits) | low;
      if (offset >= length || (i > 0 && offset <= previous)) {
        index_error(entry_text(i) + ": offset " + std::to_string(offset) +
                        (offset >= length ? " is not below length " + std::to_string(length)
                                          : " does not ascend"),
                    stream_offset, compressed, lower_bytes + 8 * w + bit / 8);
      }
      out[i] = static_cast<std::uint32_t>(offset);
      previous = offset;
      ++i;
    }
  }
  if (i != n) {
    index_error("only " + std::to_string(i) + " of " + std::to_string(n) + " high parts",
                stream_offset, compressed, lower_bytes);
  }
}

}  // namespace

std::uint64_t IndexCodingSizes::of(IndexCoding coding) const noexcept {
  switch (coding) {
    case IndexCoding::varint:
      return varint;
    case IndexCoding::bitpack:
      return bitpack;
    case IndexCoding::elias_fano:
      return elias_fano;
    case IndexCoding::exponent_groups:
      break;
  }
  return 0;
}

unsigned elias_fano_low_bits(std::uint64_t n, std::uint64_t length) noexcept {
  if (n == 0 || length < n) return 0;
  return static_cast<unsigned>(std::bit_width(length / n) - 1);
}

std::uint64_t elias_fano_bytes(std::uint64_t n, std::uint64_t length) noexcept {
  if (n == 0 || length == 0) return 0;
  const unsigned low_bits = elias_fano_low_bits(n, length);
  return ceil_div8(n * low_bits) + ceil_div8(n + ((length - 1) >> low_bits));
}

void compute_gaps(std::span<const std::uint32_t> offsets, std::uint32_t* gaps) noexcept {
  const std::size_t n = offsets.size();
  if (n == 0) return;
  gaps[0] = offsets[0];
  for (std::size_t i = 1; i < n; ++i)
    gaps[i] = offsets[i] - offsets[i - 1] - 1;
}

IndexCodingSizes index_coding_sizes(std::span<const std::uint32_t> gaps,
                                    std::uint64_t length) noexcept {
  IndexCodingSizes sizes;
  const std::size_t n = gaps.size();
  // Varint bytes: one, plus one per 7-bit group beyond the first (vectorises).
  std::uint64_t extra = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t g = gaps[i];
    extra += static_cast<std::uint32_t>(g > 0x7F) + static_cast<std::uint32_t>(g > 0x3FFF) +
             static_cast<std::uint32_t>(g > 0x1FFFFF) + static_cast<std::uint32_t>(g > 0xFFFFFFF);
  }
  sizes.varint = n + extra;
  for (std::size_t i = 0; i < n; i += kBitpackBlock) {
    const std::size_t end = std::min(n, i + kBitpackBlock);
    std::uint32_t all_bits = 0;
    for (std::size_t j = i; j < end; ++j)
      all_bits |= gaps[j];
    // The widest gap of the block sets its width: the bit width of the OR of all gaps.
    const auto width = static_cast<std::uint64_t>(std::bit_width(all_bits));
    sizes.bitpack += 1 + ceil_div8((end - i) * width);
  }
  sizes.elias_fano = elias_fano_bytes(n, length);
  return sizes;
}

SizeRange index_raw_size_range(IndexCoding coding, std::uint64_t n, std::uint64_t length) noexcept {
  switch (coding) {
    case IndexCoding::varint:
      return {n, 5 * n};
    case IndexCoding::bitpack: {
      const std::uint64_t blocks = (n + kBitpackBlock - 1) / kBitpackBlock;
      return {blocks, blocks + 4 * n};
    }
    case IndexCoding::elias_fano: {
      const std::uint64_t bytes = elias_fano_bytes(n, length);
      return {bytes, bytes};
    }
    case IndexCoding::exponent_groups:
      // A group count, then per group its exponent, count and parameter; the encoder uses it
      // only when it takes at most 5 bytes per entry (varint's most).
      return {4, 5 * n};
  }
  return {1, 0};  // empty range: rejects everything
}

void encode_indices(IndexCoding coding, std::span<const std::uint32_t> offsets,
                    std::span<const std::uint32_t> gaps, std::uint64_t length,
                    std::byte* out) noexcept {
  const std::size_t n = offsets.size();
  switch (coding) {
    case IndexCoding::varint:
      for (const std::uint32_t gap : gaps)
        out = wire::put_varint(out, gap);
      return;
    case IndexCoding::bitpack:
      for (std::size_t i = 0; i < n; i += kBitpackBlock) {
        const std::size_t end = std::min(n, i + kBitpackBlock);
        std::uint32_t all_bits = 0;
        for (std::size_t j = i; j < end; ++j)
          all_bits |= gaps[j];
        const auto width = static_cast<unsigned>(std::bit_width(all_bits));
        *out++ = static_cast<std::byte>(width);
        BitWriter writer(out);
        for (std::size_t j = i; j < end; ++j)
          writer.put(gaps[j], width);
        out = writer.flush();
      }
      return;
    case IndexCoding::elias_fano: {
      if (n == 0) return;
      const unsigned low_bits = elias_fano_low_bits(n, length);
      const std::uint64_t low_mask = (std::uint64_t{1} << low_bits) - 1;
      BitWriter writer(out);
      for (const std::uint32_t offset : offsets)
        writer.put(offset & low_mask, low_bits);
      std::byte* upper = writer.flush();
      const std::uint64_t upper_bytes = ceil_div8(n + ((length - 1) >> low_bits));
      std::fill_n(upper, upper_bytes, std::byte{0});
      for (std::size_t i = 0; i < n; ++i) {
        const std::uint64_t position = (std::uint64_t{offsets[i]} >> low_bits) + i;
        upper[position / 8] |= static_cast<std::byte>(1u << (position % 8));
      }
      return;
    }
    case IndexCoding::exponent_groups:
      return;  // coded against the context: encode_grouped_indices
  }
}

void decode_indices(IndexCoding coding, std::span<const std::byte> raw, std::uint64_t n,
                    std::uint64_t length, std::uint32_t* out, std::uint64_t stream_offset,
                    bool stream_was_compressed) {
  switch (coding) {
    case IndexCoding::varint:
      decode_varint(raw, n, length, out, stream_offset, stream_was_compressed);
      return;
    case IndexCoding::bitpack:
      decode_bitpack(raw, n, length, out, stream_offset, stream_was_compressed);
      return;
    case IndexCoding::elias_fano:
      decode_elias_fano(raw, n, length, out, stream_offset, stream_was_compressed);
      return;
    case IndexCoding::exponent_groups:
      break;  // decoded against the context: decode_grouped_indices
  }
  wire::fail("unknown index coding", stream_offset);
}

}  // namespace pulseloco::codec::detail
