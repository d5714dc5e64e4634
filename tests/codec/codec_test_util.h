// Test-only helpers for the wire codec: an independent writer of raw headers and frames, built
// from docs/wire-format.md rather than from src/codec, so tests can produce any byte sequence
// (including invalid ones with valid checksums), and random message generators.
//
// Header-only and free of gtest: the libFuzzer targets include it too.
#pragma once

#include <xxhash.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <span>
#include <vector>

#include <pulseloco/codec/message.h>

namespace pulseloco::codec::testing {

using Bytes = std::vector<std::byte>;

template <typename T>
void put(Bytes& out, T value) {
  std::byte raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  out.insert(out.end(), raw, raw + sizeof(T));
}

template <typename T>
void poke(Bytes& bytes, std::size_t at, T value) {
  std::memcpy(bytes.data() + at, &value, sizeof(T));
}

template <typename T>
[[nodiscard]] T peek(std::span<const std::byte> bytes, std::size_t at) {
  T value;
  std::memcpy(&value, bytes.data() + at, sizeof(T));
  return value;
}

inline void put_leb128(Bytes& out, std::uint64_t value) {
  while (value >= 0x80) {
    out.push_back(static_cast<std::byte>((value & 0x7F) | 0x80));
    value >>= 7;
  }
  out.push_back(static_cast<std::byte>(value));
}

inline void append(Bytes& out, std::span<const std::byte> more) {
  out.insert(out.end(), more.begin(), more.end());
}

inline Bytes bytes_of(std::initializer_list<unsigned> values) {
  Bytes out;
  for (const unsigned value : values)
    out.push_back(static_cast<std::byte>(value));
  return out;
}

[[nodiscard]] inline std::uint64_t xxh3(std::span<const std::byte> bytes) {
  return XXH3_64bits(bytes.data(), bytes.size());
}

// Byte offsets of the format (docs/wire-format.md).
namespace layout {
inline constexpr std::size_t kMagic = 0;
inline constexpr std::size_t kVersion = 4;
inline constexpr std::size_t kEncoding = 6;
inline constexpr std::size_t kFlags = 7;
inline constexpr std::size_t kWindow = 8;
inline constexpr std::size_t kRank = 16;
inline constexpr std::size_t kTensorCount = 20;
inline constexpr std::size_t kFrameCount = 24;
inline constexpr std::size_t kReserved = 28;
inline constexpr std::size_t kHeaderPrefix = 32;

inline constexpr std::size_t kFrameTensor = 0;
inline constexpr std::size_t kFrameEncoding = 4;
inline constexpr std::size_t kFrameIndexCoding = 5;
inline constexpr std::size_t kFrameZstdStreams = 6;
inline constexpr std::size_t kFrameSparsePlanes = 7;
inline constexpr std::size_t kFrameBegin = 8;
inline constexpr std::size_t kFrameLength = 16;
inline constexpr std::size_t kFrameEntries = 20;
inline constexpr std::size_t kFramePayloadBytes = 24;
inline constexpr std::size_t kFramePrefix = 32;
inline constexpr std::size_t kChecksum = 8;
}  // namespace layout

struct RawHeader {
  std::uint8_t magic[4] = {'P', 'L', 'S', 'M'};
  std::uint16_t version = 1;
  std::uint8_t encoding = 0;
  std::uint8_t flags = 0;
  std::uint64_t window = 0;
  std::uint32_t sender_rank = 0;
  std::vector<std::uint64_t> numels;
  std::uint32_t tensor_count_override = 0;  // used when use_tensor_count_override
  bool use_tensor_count_override = false;
  std::uint32_t frame_count = 0;
  std::uint32_t reserved = 0;
};

[[nodiscard]] inline Bytes make_header(const RawHeader& h) {
  Bytes out;
  for (const std::uint8_t m : h.magic)
    out.push_back(static_cast<std::byte>(m));
  put<std::uint16_t>(out, h.version);
  put<std::uint8_t>(out, h.encoding);
  put<std::uint8_t>(out, h.flags);
  put<std::uint64_t>(out, h.window);
  put<std::uint32_t>(out, h.sender_rank);
  put<std::uint32_t>(out, h.use_tensor_count_override
                              ? h.tensor_count_override
                              : static_cast<std::uint32_t>(h.numels.size()));
  put<std::uint32_t>(out, h.frame_count);
  put<std::uint32_t>(out, h.reserved);
  for (const std::uint64_t numel : h.numels)
    put<std::uint64_t>(out, numel);
  put<std::uint64_t>(out, xxh3(out));
  return out;
}

struct RawFrame {
  std::uint32_t tensor = 0;
  std::uint8_t encoding = 0;
  std::uint8_t index_coding = 0;
  std::uint8_t zstd_streams = 0;
  std::uint8_t sparse_planes = 0;
  std::uint64_t begin = 0;
  std::uint32_t length = 0;
  std::uint32_t entries = 0;
  Bytes payload;
  bool override_payload_bytes = false;
  std::uint64_t payload_bytes = 0;
};

[[nodiscard]] inline Bytes make_frame(const RawFrame& f) {
  Bytes out;
  put<std::uint32_t>(out, f.tensor);
  put<std::uint8_t>(out, f.encoding);
  put<std::uint8_t>(out, f.index_coding);
  put<std::uint8_t>(out, f.zstd_streams);
  put<std::uint8_t>(out, f.sparse_planes);
  put<std::uint64_t>(out, f.begin);
  put<std::uint32_t>(out, f.length);
  put<std::uint32_t>(out, f.entries);
  put<std::uint64_t>(out, f.override_payload_bytes ? f.payload_bytes : f.payload.size());
  append(out, f.payload);
  put<std::uint64_t>(out, xxh3(out));
  return out;
}

// A pulse payload with every stream stored raw (no zstd): directory then streams.
// A zstd frame of RLE blocks (RFC 8878): `size` copies of `value` in blocks of 128 KiB, four
// bytes each (the most content a zstd frame holds per byte it stores), declaring `declared`.
[[nodiscard]] inline Bytes rle_zstd_frame(std::uint8_t value, std::uint64_t size,
                                          std::uint64_t declared) {
  Bytes out;
  put<std::uint32_t>(out, 0xFD2FB528u);  // magic
  put<std::uint8_t>(out, 0xC0);          // an 8-byte content size and a window descriptor
  put<std::uint8_t>(out, 7u << 3);       // a 128 KiB window
  put<std::uint64_t>(out, declared);
  for (std::uint64_t left = size; left > 0;) {
    const std::uint64_t block = std::min<std::uint64_t>(left, std::uint64_t{128} << 10);
    left -= block;
    const auto header =
        static_cast<std::uint32_t>((left == 0 ? 1u : 0u) | (1u << 1) | (block << 3));
    for (int b = 0; b < 3; ++b)
      out.push_back(static_cast<std::byte>((header >> (8 * b)) & 0xFFu));
    out.push_back(static_cast<std::byte>(value));
  }
  return out;
}

struct RawPulseStreams {
  Bytes index;                         // the index coding's bytes
  std::vector<Bytes> planes{4};        // each dense (n bytes) or sparse (bitmap + non-zero)
  std::vector<std::uint64_t> nonzero;  // one per sparse plane, in plane order
};

[[nodiscard]] inline Bytes make_pulse_payload(const RawPulseStreams& s) {
  Bytes out;
  put_leb128(out, s.index.size());
  for (const std::uint64_t count : s.nonzero)
    put_leb128(out, count);
  put_leb128(out, s.index.size());
  for (const Bytes& plane : s.planes)
    put_leb128(out, plane.size());
  append(out, s.index);
  for (const Bytes& plane : s.planes)
    append(out, plane);
  return out;
}

// Independent, bit-by-bit writers of the three index codings (docs/wire-format.md).
class BitSink {
 public:
  explicit BitSink(Bytes& out) : out_(out) {}
  void put(std::uint64_t value, unsigned width) {
    for (unsigned b = 0; b < width; ++b) {
      if (bit_ % 8 == 0) out_.push_back(std::byte{0});
      if ((value >> b) & 1u) out_.back() |= static_cast<std::byte>(1u << (bit_ % 8));
      ++bit_;
    }
  }
  void align() { bit_ = (bit_ + 7) / 8 * 8; }

 private:
  Bytes& out_;
  std::uint64_t bit_ = 0;
};

[[nodiscard]] inline std::vector<std::uint64_t> gaps_of(const std::vector<std::uint32_t>& offsets) {
  std::vector<std::uint64_t> gaps;
  std::uint64_t next = 0;
  for (const std::uint32_t o : offsets) {
    gaps.push_back(o - next);
    next = std::uint64_t{o} + 1;
  }
  return gaps;
}

[[nodiscard]] inline Bytes varint_index(const std::vector<std::uint32_t>& offsets) {
  Bytes out;
  for (const std::uint64_t gap : gaps_of(offsets))
    put_leb128(out, gap);
  return out;
}

[[nodiscard]] inline Bytes bitpack_index(const std::vector<std::uint32_t>& offsets) {
  Bytes out;
  const auto gaps = gaps_of(offsets);
  for (std::size_t i = 0; i < gaps.size(); i += 128) {
    const std::size_t end = std::min(gaps.size(), i + 128);
    unsigned width = 0;
    for (std::size_t j = i; j < end; ++j) {
      while (width < 64 && (gaps[j] >> width) != 0)
        ++width;
    }
    out.push_back(static_cast<std::byte>(width));
    BitSink sink(out);
    for (std::size_t j = i; j < end; ++j)
      sink.put(gaps[j], width);
  }
  return out;
}

[[nodiscard]] inline unsigned elias_fano_low_bits(std::uint64_t n, std::uint64_t length) {
  unsigned l = 0;
  while ((length / n) >> (l + 1) != 0)
    ++l;
  return l;
}

[[nodiscard]] inline Bytes elias_fano_index(const std::vector<std::uint32_t>& offsets,
                                            std::uint64_t length) {
  Bytes out;
  const std::uint64_t n = offsets.size();
  const unsigned l = elias_fano_low_bits(n, length);
  BitSink low(out);
  for (const std::uint32_t o : offsets)
    low.put(o & ((std::uint64_t{1} << l) - 1), l);
  const std::uint64_t upper_bits = n + ((length - 1) >> l);
  Bytes upper((upper_bits + 7) / 8, std::byte{0});
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::uint64_t position = (offsets[i] >> l) + i;
    upper[position / 8] |= static_cast<std::byte>(1u << (position % 8));
  }
  append(out, upper);
  return out;
}

// Byte plane k of the values, dense.
[[nodiscard]] inline Bytes plane_of(const std::vector<float>& values, int k) {
  Bytes out;
  for (const float v : values) {
    std::uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    out.push_back(static_cast<std::byte>((bits >> (8 * k)) & 0xFF));
  }
  return out;
}

// The sparse form of a plane: bitmap (bit i set when byte i is non-zero) then those bytes.
[[nodiscard]] inline Bytes sparse_of(const Bytes& plane, std::uint64_t* nonzero) {
  Bytes out((plane.size() + 7) / 8, std::byte{0});
  *nonzero = 0;
  for (std::size_t i = 0; i < plane.size(); ++i) {
    if (plane[i] != std::byte{0}) {
      out[i / 8] |= static_cast<std::byte>(1u << (i % 8));
      ++*nonzero;
    }
  }
  for (const std::byte b : plane) {
    if (b != std::byte{0}) out.push_back(b);
  }
  return out;
}

// Recomputes the header checksum and the checksum of every frame whose extent the bytes
// present and its payload_bytes field determine, so that corruptions reach the validation
// behind the checksums. Tolerates any input (it only reads inside `message`).
inline void refresh_checksums(std::span<std::byte> message) {
  if (message.size() < layout::kHeaderPrefix) return;
  const auto tensors = peek<std::uint32_t>(message, layout::kTensorCount);
  const auto frames = peek<std::uint32_t>(message, layout::kFrameCount);
  const std::uint64_t header = layout::kHeaderPrefix + 8ull * tensors + layout::kChecksum;
  if (header > message.size()) return;
  const std::uint64_t header_sum = XXH3_64bits(message.data(), header - layout::kChecksum);
  std::memcpy(message.data() + header - layout::kChecksum, &header_sum, sizeof header_sum);
  std::uint64_t at = header;
  for (std::uint32_t i = 0; i < frames; ++i) {
    if (message.size() - at < layout::kFramePrefix + layout::kChecksum) return;
    const auto payload = peek<std::uint64_t>(message, at + layout::kFramePayloadBytes);
    const std::uint64_t room = message.size() - at - layout::kFramePrefix - layout::kChecksum;
    if (payload > room) return;
    const std::uint64_t body = layout::kFramePrefix + payload;
    const std::uint64_t sum = XXH3_64bits(message.data() + at, body);
    std::memcpy(message.data() + at + body, &sum, sizeof sum);
    at += body + layout::kChecksum;
  }
}

// ---------------------------------------------------------------------------------------------
// Random entries

struct Chunk {
  std::uint32_t tensor = 0;
  std::uint64_t begin = 0;
  std::uint64_t length = 0;
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;

  [[nodiscard]] FrameEntries entries() const {
    return {
        .tensor = tensor, .begin = begin, .length = length, .offsets = offsets, .values = values};
  }
};

// A finite fp32 value of a random kind: grid-like (few significant bits, like pseudo-gradients),
// any finite bit pattern, or an extreme (denormals, the largest float, signed zeros, ...).
[[nodiscard]] inline float random_value(std::mt19937_64& rng) {
  std::uint32_t bits = 0;
  switch (rng() % 4) {
    case 0: {  // s on a fine power-of-two grid: 8..16 significant bits, exponent near 2^-17
      const int significant = 8 + static_cast<int>(rng() % 9);
      const std::uint32_t mantissa = static_cast<std::uint32_t>(rng() & ((1u << 23) - 1)) >>
                                     (23 - significant) << (23 - significant);
      const std::uint32_t exponent = 127 - 17 + static_cast<std::uint32_t>(rng() % 8) - 4;
      bits = (static_cast<std::uint32_t>(rng() & 1) << 31) | (exponent << 23) | mantissa;
      break;
    }
    case 1:
    case 2:  // any finite pattern
      do {
        bits = static_cast<std::uint32_t>(rng());
      } while ((bits & 0x7F800000u) == 0x7F800000u);
      break;
    default: {
      static constexpr std::uint32_t kExtremes[] = {
          0x00000000u,  // +0
          0x80000000u,  // -0
          0x00000001u,  // smallest denormal
          0x807FFFFFu,  // largest negative denormal
          0x00800000u,  // smallest normal
          0x7F7FFFFFu,  // largest float
          0xFF7FFFFFu,  // lowest float
          0x3F800000u,  // 1
          0x33800000u,  // 2^-24
      };
      bits = kExtremes[rng() % std::size(kExtremes)];
      break;
    }
  }
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Ascending offsets below `length`: each element independently with probability `density`
// (for dense chunks), or `count` distinct random positions (for huge sparse chunks).
[[nodiscard]] inline std::vector<std::uint32_t> random_offsets(std::mt19937_64& rng,
                                                               std::uint64_t length,
                                                               double density) {
  std::vector<std::uint32_t> offsets;
  std::bernoulli_distribution take(density);
  for (std::uint64_t i = 0; i < length; ++i) {
    if (take(rng)) offsets.push_back(static_cast<std::uint32_t>(i));
  }
  return offsets;
}

}  // namespace pulseloco::codec::testing
