#include <pulseloco/codec/context_index.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>

#include <pulseloco/codec/wire.h>

namespace pulseloco::codec::detail {
namespace {

constexpr std::size_t kGroups = 256;

// The exponent field of every context value: one vectorisable pass, so that each group's
// membership is then found in a byte array a quarter of the context's size.
void exponents_of(std::span<const float> context, std::uint8_t* out) noexcept {
  const auto* bits = reinterpret_cast<const std::uint32_t*>(context.data());
  const std::size_t length = context.size();
  for (std::size_t i = 0; i < length; ++i)
    out[i] = static_cast<std::uint8_t>(bits[i] >> 23);
}

[[nodiscard]] std::size_t word_count(std::size_t length) noexcept {
  return (length + 63) / 64;
}

// Bit k of words[w] is set where element 64w+k belongs to `group`; prefix[w] counts the members
// before word w. Returns the group's size.
std::uint64_t membership_portable(const std::uint8_t* exponents, std::size_t length,
                                  std::uint8_t group, std::uint64_t* words,
                                  std::uint32_t* prefix) noexcept {
  std::uint32_t members = 0;
  for (std::size_t w = 0; w < word_count(length); ++w) {
    std::uint64_t word = 0;
    const std::size_t end = std::min<std::size_t>(64, length - 64 * w);
    for (std::size_t k = 0; k < end; ++k)
      word |= static_cast<std::uint64_t>(exponents[64 * w + k] == group) << k;
    words[w] = word;
    prefix[w] = members;
    members += static_cast<std::uint32_t>(std::popcount(word));
  }
  return members;
}

__attribute__((target("avx2,popcnt"))) std::uint64_t membership_avx2(
    const std::uint8_t* exponents, std::size_t length, std::uint8_t group, std::uint64_t* words,
    std::uint32_t* prefix) noexcept {
  const __m256i needle = _mm256_set1_epi8(static_cast<char>(group));
  const std::size_t full = length / 64;
  std::uint64_t members = 0;
  for (std::size_t w = 0; w < full; ++w) {
    const auto* p = reinterpret_cast<const __m256i*>(exponents + 64 * w);
    const auto lo = static_cast<std::uint32_t>(
        _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_loadu_si256(p), needle)));
    const auto hi = static_cast<std::uint32_t>(
        _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_loadu_si256(p + 1), needle)));
    const std::uint64_t word = (static_cast<std::uint64_t>(hi) << 32) | lo;
    words[w] = word;
    prefix[w] = static_cast<std::uint32_t>(members);
    members += static_cast<std::uint64_t>(_mm_popcnt_u64(word));
  }
  if (full * 64 < length) {
    std::uint64_t word = 0;
    for (std::size_t k = 0; full * 64 + k < length; ++k)
      word |= static_cast<std::uint64_t>(exponents[64 * full + k] == group) << k;
    words[full] = word;
    prefix[full] = static_cast<std::uint32_t>(members);
    members += static_cast<std::uint64_t>(_mm_popcnt_u64(word));
  }
  return members;
}

// AVX2 and POPCNT when the CPU has them, unless PULSELOCO_CPU_ISA=portable asks for the
// fallback as it does of the kernels (base/cpu_features.h). Read here rather than through
// active_cpu_isa() so that the codec's sanitized build needs no more of base than its errors.
bool use_avx2() noexcept {
  const char* isa = std::getenv("PULSELOCO_CPU_ISA");
  if (isa != nullptr && std::string_view(isa) == "portable") return false;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
}

std::uint64_t membership(const std::uint8_t* exponents, std::size_t length, std::uint8_t group,
                         std::uint64_t* words, std::uint32_t* prefix) noexcept {
  static const bool avx2 = use_avx2();
  return avx2 ? membership_avx2(exponents, length, group, words, prefix)
              : membership_portable(exponents, length, group, words, prefix);
}

// The position of the r-th set bit (r < popcount) of `word`.
[[nodiscard]] inline unsigned select_in_word(std::uint64_t word, std::uint64_t r) noexcept {
  for (; r > 0; --r)
    word &= word - 1;
  return static_cast<unsigned>(std::countr_zero(word));
}

// Ranks and selects in a membership bitmap through its per-word prefix counts.
class RankCursor {
 public:
  RankCursor(const std::uint64_t* words, const std::uint32_t* prefix,
             std::size_t word_count) noexcept
      : words_(words), prefix_(prefix), words_n_(word_count) {}
  // Rank of the member at `position`.
  [[nodiscard]] std::uint64_t rank_of(std::uint64_t position) const noexcept {
    const std::uint64_t w = position / 64;
    const std::uint64_t below = (std::uint64_t{1} << (position % 64)) - 1;
    return prefix_[w] + static_cast<std::uint64_t>(std::popcount(words_[w] & below));
  }
  // Position of the member of rank r (the ranks asked must ascend; r below the group's size).
  [[nodiscard]] std::uint64_t position_of(std::uint64_t r) noexcept {
    // The word holding it is the last whose prefix count is at most r: a binary search, so
    // that a group of few members costs no walk over the whole chunk.
    if (word_ + 1 < words_n_ && prefix_[word_ + 1] <= r) {
      word_ = static_cast<std::size_t>(
          std::upper_bound(prefix_ + word_ + 1, prefix_ + words_n_, r) - prefix_ - 1);
    }
    return 64 * word_ + select_in_word(words_[word_], r - prefix_[word_]);
  }

 private:
  const std::uint64_t* words_;
  const std::uint32_t* prefix_;
  std::size_t words_n_;
  std::size_t word_ = 0;
};

class BitWriter {
 public:
  explicit BitWriter(std::byte* out) noexcept : out_(out) {}
  void put(std::uint64_t value, unsigned width) noexcept {  // width <= 32
    acc_ |= value << filled_;
    filled_ += width;
    if (filled_ >= 32) {
      store_le<std::uint32_t>(out_, static_cast<std::uint32_t>(acc_));
      out_ += 4;
      acc_ >>= 32;
      filled_ -= 32;
    }
  }
  // q zero bits, then a one, then the k low bits of `low`.
  void rice(std::uint64_t gap, unsigned k) noexcept {
    std::uint64_t q = gap >> k;
    for (; q >= 32; q -= 32)
      put(0, 32);
    put(std::uint64_t{1} << q, static_cast<unsigned>(q) + 1);
    if (k > 0) put(gap & ((std::uint64_t{1} << k) - 1), k);
  }
  std::byte* flush() noexcept {
    for (; filled_ > 0; filled_ = filled_ > 8 ? filled_ - 8 : 0) {
      *out_++ = static_cast<std::byte>(acc_ & 0xFF);
      acc_ >>= 8;
    }
    return out_;
  }

 private:
  std::byte* out_;
  std::uint64_t acc_ = 0;
  unsigned filled_ = 0;
};

// The Rice parameter for c gaps summing to `total` when geometrically distributed.
[[nodiscard]] unsigned rice_parameter(std::uint64_t c, std::uint64_t total) noexcept {
  const double mean = static_cast<double>(total) / static_cast<double>(c);
  const double scaled = 0.4812 * (mean + 1.0);  // -ln(golden ratio - 1) * mean run
  if (scaled < 1.0) return 0;
  return std::min(31u, 1u + static_cast<unsigned>(std::floor(std::log2(scaled))));
}

using Group = ExponentGroup;

[[noreturn]] void group_error(const std::string& reason, std::uint64_t stream_offset,
                              bool compressed, std::uint64_t byte_in_stream) {
  wire::fail("exponent_groups index stream: " + reason,
             compressed ? stream_offset : stream_offset + byte_in_stream);
}

}  // namespace

std::uint64_t encode_grouped_indices(std::span<const std::uint32_t> offsets,
                                     std::span<const float> context, std::uint64_t max_bytes,
                                     GroupScratch& scratch, std::vector<std::byte>& out) {
  const std::size_t length = context.size();
  const std::size_t n = offsets.size();
  if (scratch.exponents.size() < length) scratch.exponents.resize(length);
  exponents_of(context, scratch.exponents.data());
  const std::uint8_t* exponents = scratch.exponents.data();
  // The fired entries by group (a counting sort: within a group, offsets stay ascending).
  std::array<std::uint32_t, kGroups + 1> start{};
  for (const std::uint32_t o : offsets)
    ++start[exponents[o] + 1];
  for (std::size_t e = 0; e < kGroups; ++e)
    start[e + 1] += start[e];
  if (scratch.ranks.size() < n) scratch.ranks.resize(n);
  if (scratch.sorted.size() < n) scratch.sorted.resize(n);
  {
    std::array<std::uint32_t, kGroups> next{};
    std::copy_n(start.begin(), kGroups, next.begin());
    for (const std::uint32_t o : offsets)
      scratch.ranks[next[exponents[o]]++] = o;  // offsets for now, ranks below
  }
  std::vector<Group>& groups = scratch.group_list;
  groups.clear();
  if (scratch.words.size() < word_count(length)) scratch.words.resize(word_count(length));
  std::uint64_t* words = scratch.words.data();
  if (scratch.prefix.size() < word_count(length)) scratch.prefix.resize(word_count(length));
  std::uint32_t* prefix = scratch.prefix.data();
  std::uint64_t bound_bits = 0;
  for (std::size_t e = 0; e < kGroups; ++e) {
    if (start[e + 1] == start[e]) continue;
    Group g{.exponent = static_cast<std::uint8_t>(e),
            .fired = start[e + 1] - start[e],
            .size = membership(exponents, length, static_cast<std::uint8_t>(e), words, prefix),
            .parameter = 0,
            .first = start[e]};
    const RankCursor cursor(words, prefix, word_count(length));
    for (std::size_t j = g.first; j < g.first + g.fired; ++j)
      scratch.sorted[j] = static_cast<std::uint32_t>(cursor.rank_of(scratch.ranks[j]));
    if (g.fired < g.size) {
      const bool complement = 2 * std::uint64_t{g.fired} > g.size;
      const std::uint64_t coded = complement ? g.size - g.fired : g.fired;
      // The gaps of the coded ranks sum to (last coded rank + 1) - coded.
      std::uint64_t last = g.size - 1;
      if (complement) {
        for (std::size_t j = g.first + g.fired; j > g.first && scratch.sorted[j - 1] == last; --j)
          --last;
      } else {
        last = scratch.sorted[g.first + g.fired - 1];
      }
      const unsigned k = rice_parameter(coded, last + 1 - coded);
      g.parameter = static_cast<std::uint8_t>(k | (complement ? kGroupComplement : 0));
      bound_bits += coded * (k + 1) + ((last + 1) >> k);
    }
    groups.push_back(g);
  }
  const std::uint64_t header_bound = wire::kMaxVarint64Bytes + groups.size() * 7;
  grow(out, header_bound + bound_bits / 8 + 16);
  std::byte* p = wire::put_varint(out.data(), groups.size());
  for (const Group& g : groups) {
    *p++ = static_cast<std::byte>(g.exponent);
    p = wire::put_varint(p, g.fired);
    *p++ = static_cast<std::byte>(g.parameter);
  }
  BitWriter writer(p);
  for (const Group& g : groups) {
    if (g.fired == g.size) continue;
    const unsigned k = g.parameter & kGroupRiceMask;
    const std::uint32_t* ranks = scratch.sorted.data() + g.first;
    if ((g.parameter & kGroupComplement) == 0) {
      std::uint64_t next = 0;
      for (std::size_t j = 0; j < g.fired; ++j) {
        writer.rice(ranks[j] - next, k);
        next = std::uint64_t{ranks[j]} + 1;
      }
    } else {
      // The members that did not fire, between and after the fired ranks.
      std::uint64_t next = 0;  // the smallest rank the next coded gap may reach
      std::uint64_t r = 0;
      for (std::size_t j = 0; j <= g.fired; ++j) {
        const std::uint64_t end = j < g.fired ? ranks[j] : g.size;
        for (; r < end; ++r) {
          writer.rice(r - next, k);
          next = r + 1;
        }
        r = end + 1;
      }
    }
  }
  const std::uint64_t bytes = static_cast<std::uint64_t>(writer.flush() - out.data());
  return bytes <= max_bytes ? bytes : 0;
}

void decode_grouped_indices(std::span<const std::byte> raw, std::uint64_t n,
                            std::span<const float> context, std::uint32_t* out,
                            GroupScratch& scratch, std::uint64_t stream_offset, bool compressed) {
  const auto fail = [&](const std::string& reason, std::uint64_t at) {
    group_error(reason, stream_offset, compressed, at);
  };
  const auto* p = reinterpret_cast<const std::uint8_t*>(raw.data());
  std::size_t pos = 0;
  const auto next_byte = [&](const std::string& field) -> std::uint8_t {
    if (pos >= raw.size()) fail("truncated at " + field, pos);
    return p[pos++];
  };
  // Canonical LEB128 of at most 32 bits.
  const auto varint = [&](const std::string& field) -> std::uint64_t {
    const std::size_t at = pos;
    std::uint64_t value = 0;
    for (unsigned k = 0; k < 5; ++k) {
      const std::uint8_t b = next_byte(field);
      if (k == 4 && b > 0x0F) fail(field + ": varint exceeds 32 bits", at);
      value |= static_cast<std::uint64_t>(b & 0x7F) << (7 * k);
      if ((b & 0x80) == 0) {
        if (b == 0 && k > 0) fail(field + ": non-canonical varint", at);
        return value;
      }
    }
    group_error(field + ": varint longer than 5 bytes", stream_offset, compressed, at);
  };
  const std::uint64_t group_count = varint("group count");
  if (group_count > kGroups || group_count > n) {
    fail(std::to_string(group_count) + " groups, more than " +
             std::to_string(std::min<std::uint64_t>(kGroups, n)),
         0);
  }
  std::vector<Group>& groups = scratch.group_list;
  groups.clear();
  std::uint64_t total = 0;
  for (std::uint64_t i = 0; i < group_count; ++i) {
    const std::string name = "group " + std::to_string(i);
    const std::size_t at = pos;
    Group g;
    g.exponent = next_byte(name + " exponent");
    if (i > 0 && g.exponent <= groups.back().exponent) {
      fail(name + ": exponent " + std::to_string(g.exponent) + " does not ascend", at);
    }
    const std::size_t fired_at = pos;
    const std::uint64_t fired = varint(name + " count");
    if (fired == 0 || fired > n - total) {
      fail(name + ": " + std::to_string(fired) + " fired (allowed 1.." + std::to_string(n - total) +
               ")",
           fired_at);
    }
    g.fired = static_cast<std::uint32_t>(fired);
    g.first = total;
    total += fired;
    g.parameter = next_byte(name + " parameter");
    if ((g.parameter & ~(kGroupComplement | kGroupRiceMask)) != 0) {
      fail(name + ": unknown parameter bits " + std::to_string(g.parameter), pos - 1);
    }
    groups.push_back(g);
  }
  if (total != n) {
    fail("the groups' counts sum to " + std::to_string(total) + ", the frame has " +
             std::to_string(n) + " entries",
         pos);
  }
  const std::uint64_t bits_at = pos;
  const std::uint8_t* bytes = p + bits_at;
  const std::uint64_t total_bits = 8 * (raw.size() - bits_at);
  std::uint64_t position = 0;
  const auto read = [&](unsigned width) -> std::uint64_t {  // width <= 32
    std::uint64_t word;
    std::memcpy(&word, bytes + position / 8, sizeof word);
    position += width;
    return (word >> (position - width) % 8) & ((std::uint64_t{1} << width) - 1);
  };
  // Reads one Rice code; the stream's end bounds the unary run.
  const auto rice = [&](unsigned k, std::uint64_t limit, std::size_t group) -> std::uint64_t {
    std::uint64_t q = 0;
    for (;;) {
      if (position >= total_bits)
        fail("group " + std::to_string(group) + ": truncated", bits_at + raw.size());
      std::uint64_t word;
      std::memcpy(&word, bytes + position / 8, sizeof word);
      word >>= position % 8;
      if (word != 0) {
        const auto zeros = static_cast<unsigned>(std::countr_zero(word));
        q += zeros;
        position += zeros + 1;
        break;
      }
      q += 64 - position % 8;
      position += 64 - position % 8;
      if (q > limit) break;
    }
    if (q > limit || position > total_bits) {
      fail(
          "group " + std::to_string(group) + ": a gap exceeds the group in this receiver's context",
          bits_at + position / 8);
    }
    const std::uint64_t low = k > 0 ? read(k) : 0;
    return (q << k) | low;
  };

  const std::size_t length = context.size();
  if (scratch.exponents.size() < length) scratch.exponents.resize(length);
  exponents_of(context, scratch.exponents.data());
  const std::size_t words_n = word_count(length);
  scratch.fired.assign(words_n, 0);
  if (scratch.words.size() < words_n) scratch.words.resize(words_n);
  std::uint64_t* fired = scratch.fired.data();
  std::uint64_t* words = scratch.words.data();
  if (scratch.prefix.size() < words_n) scratch.prefix.resize(words_n);
  std::uint32_t* prefix = scratch.prefix.data();
  for (std::size_t i = 0; i < groups.size(); ++i) {
    Group& g = groups[i];
    g.size = membership(scratch.exponents.data(), length, g.exponent, words, prefix);
    if (g.fired > g.size) {
      fail("group " + std::to_string(i) + " (exponent " + std::to_string(g.exponent) +
               "): " + std::to_string(g.fired) + " fired of its " + std::to_string(g.size) +
               " elements in this receiver's context",
           0);
    }
    if (g.fired == g.size) {
      if (g.parameter != 0)
        fail("group " + std::to_string(i) + ": parameter of a group that fired whole", 0);
      for (std::size_t w = 0; w < words_n; ++w)
        fired[w] |= words[w];
      continue;
    }
    const unsigned k = g.parameter & kGroupRiceMask;
    const bool complement = (g.parameter & kGroupComplement) != 0;
    const std::uint64_t coded = complement ? g.size - g.fired : g.fired;
    // The coded members' bits are toggled: set where they fired, or cleared from the whole
    // group where they are the members that did not fire.
    if (complement) {
      for (std::size_t w = 0; w < words_n; ++w)
        fired[w] |= words[w];
    }
    RankCursor cursor(words, prefix, words_n);
    std::uint64_t next = 0;  // the smallest rank the next code may give
    for (std::uint64_t j = 0; j < coded; ++j) {
      const std::uint64_t rank = next + rice(k, g.size, i);
      if (rank >= g.size) {
        fail("group " + std::to_string(i) + ": rank " + std::to_string(rank) + " beyond its " +
                 std::to_string(g.size) + " elements in this receiver's context",
             bits_at + position / 8);
      }
      const std::uint64_t at = cursor.position_of(rank);
      fired[at / 64] ^= std::uint64_t{1} << (at % 64);
      next = rank + 1;
    }
  }
  if ((position + 7) / 8 != raw.size() - bits_at) {
    fail(std::to_string(raw.size() - bits_at - (position + 7) / 8) +
             " bytes left after the groups' codes",
         bits_at + (position + 7) / 8);
  }
  if (position % 8 != 0 && (bytes[position / 8] >> (position % 8)) != 0) {
    fail("non-zero padding bits", bits_at + position / 8);
  }
  // Every group gave exactly its count of distinct members: the bitmap holds n elements.
  std::size_t written = 0;
  for (std::size_t w = 0; w < words_n; ++w) {
    for (std::uint64_t word = fired[w]; word != 0; word &= word - 1)
      out[written++] = static_cast<std::uint32_t>(64 * w + std::countr_zero(word));
  }
}

}  // namespace pulseloco::codec::detail
