#include <pulseloco/codec/context_index.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include <pulseloco/codec/wire.h>

namespace pulseloco::codec::detail {
namespace {

constexpr std::size_t kGroups = 256;

// The exponent field of every context value: one vectorisable pass, so that each group's
// membership is then found in a byte array a quarter of the context's size.
inline void exponents_of(std::span<const float> context, std::uint8_t* out) noexcept {
  const auto* bits = reinterpret_cast<const std::uint32_t*>(context.data());
  const std::size_t length = context.size();
  for (std::size_t i = 0; i < length; ++i)
    out[i] = static_cast<std::uint8_t>(bits[i] >> 23);
}

[[nodiscard]] std::size_t word_count(std::size_t length) noexcept {
  return (length + 63) / 64;
}

// The word-level primitives of the passes below, which are written once over them and
// instantiated for each instruction set: bit k of word(p, g) is set where p[k] == g (64 bytes);
// count() is a popcount; deposit(bits, mask) places the low bits of `bits`, in order, at the set
// bits of `mask` (pdep).
//
// Without pdep a deposit selects, for each set bit of `bits`, the mask's set bit of that rank:
// the coded ranks are the sparser side of every group, so that is a few selections per word.
// (AMD's Zen 1 and 2 have pdep, but in microcode that takes longer than these selections.)
// [byte][k]: the position of the byte's k-th set bit.
struct SelectInByte {
  std::array<std::array<std::uint8_t, 8>, 256> at{};
  constexpr SelectInByte() {
    for (unsigned b = 0; b < 256; ++b) {
      unsigned k = 0;
      for (unsigned bit = 0; bit < 8; ++bit) {
        if (((b >> bit) & 1u) != 0) at[b][k++] = static_cast<std::uint8_t>(bit);
      }
    }
  }
};
constexpr SelectInByte kSelectInByte{};

struct SelectDeposit {
  // The (j+1)-th set bit of x (j < popcount(x)), as a one-bit word: the byte holding it from
  // the bytes' prefix popcounts, then the bit within the byte from a table.
  static std::uint64_t select(std::uint64_t x, unsigned j) noexcept {
    constexpr std::uint64_t kOnes = 0x0101010101010101u;
    std::uint64_t s = x - ((x >> 1) & 0x5555555555555555u);
    s = (s & 0x3333333333333333u) + ((s >> 2) & 0x3333333333333333u);
    s = (s + (s >> 4)) & 0x0F0F0F0F0F0F0F0Fu;
    const std::uint64_t prefix = s * kOnes;  // byte b: the set bits of bytes 0..b
    // Bytes whose prefix is at most j (high bit of each byte), all before the one sought.
    const std::uint64_t below =
        (((j * kOnes) | 0x8080808080808080u) - prefix) & 0x8080808080808080u;
    const auto byte = static_cast<unsigned>(std::popcount(below));
    const unsigned before =
        byte == 0 ? 0u : static_cast<unsigned>(prefix >> (8 * byte - 8)) & 0xFFu;
    const auto bits = static_cast<unsigned>(x >> (8 * byte)) & 0xFFu;
    return std::uint64_t{1} << (8 * byte + kSelectInByte.at[bits][j - before]);
  }
  static std::uint64_t deposit(std::uint64_t bits, std::uint64_t mask) noexcept {
    const auto members = static_cast<unsigned>(std::popcount(mask));
    if (members < 64) bits &= (std::uint64_t{1} << members) - 1;
    std::uint64_t out = 0;
    for (; bits != 0; bits &= bits - 1)
      out |= select(mask, static_cast<unsigned>(std::countr_zero(bits)));
    return out;
  }
};

struct PortableWords {
  static std::uint64_t word(const std::uint8_t* p, std::uint8_t group) noexcept {
    std::uint64_t word = 0;
    for (unsigned k = 0; k < 64; ++k)
      word |= static_cast<std::uint64_t>(p[k] == group) << k;
    return word;
  }
  // Bit k set where (p[k] - lo) mod 256 > span: the byte lies outside [lo, lo + span].
  static std::uint64_t outside(const std::uint8_t* p, std::uint8_t lo, std::uint8_t span) noexcept {
    std::uint64_t word = 0;
    for (unsigned k = 0; k < 64; ++k)
      word |= static_cast<std::uint64_t>(static_cast<std::uint8_t>(p[k] - lo) > span) << k;
    return word;
  }
  static unsigned count(std::uint64_t word) noexcept {
    return static_cast<unsigned>(std::popcount(word));
  }
  static std::uint64_t deposit(std::uint64_t bits, std::uint64_t mask) noexcept {
    return SelectDeposit::deposit(bits, mask);
  }
};

#define PULSELOCO_GROUP_ISA __attribute__((target("avx2,bmi,bmi2,popcnt")))

// Inlined into the AVX2 passes, whose wrappers below are flattened.
struct Avx2Words {
  PULSELOCO_GROUP_ISA static std::uint64_t word(const std::uint8_t* p,
                                                std::uint8_t group) noexcept {
    const __m256i needle = _mm256_set1_epi8(static_cast<char>(group));
    const auto* v = reinterpret_cast<const __m256i*>(p);
    const auto lo = static_cast<std::uint32_t>(
        _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_loadu_si256(v), needle)));
    const auto hi = static_cast<std::uint32_t>(
        _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_loadu_si256(v + 1), needle)));
    return (static_cast<std::uint64_t>(hi) << 32) | lo;
  }
  PULSELOCO_GROUP_ISA static std::uint64_t outside(const std::uint8_t* p, std::uint8_t lo,
                                                   std::uint8_t span) noexcept {
    const __m256i low = _mm256_set1_epi8(static_cast<char>(lo));
    const __m256i top = _mm256_set1_epi8(static_cast<char>(span));
    const auto* v = reinterpret_cast<const __m256i*>(p);
    const auto inside = [&](const __m256i bytes) PULSELOCO_GROUP_ISA {
      const __m256i x = _mm256_sub_epi8(bytes, low);
      return static_cast<std::uint32_t>(
          _mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(x, top), top)));
    };
    const std::uint64_t in = (static_cast<std::uint64_t>(inside(_mm256_loadu_si256(v + 1))) << 32) |
                             inside(_mm256_loadu_si256(v));
    return ~in;
  }
  PULSELOCO_GROUP_ISA static unsigned count(std::uint64_t word) noexcept {
    return static_cast<unsigned>(_mm_popcnt_u64(word));
  }
  PULSELOCO_GROUP_ISA static std::uint64_t deposit(std::uint64_t bits,
                                                   std::uint64_t mask) noexcept {
    return _pdep_u64(bits, mask);
  }
};

// Avx2Words without pdep, for the CPUs whose pdep is microcoded.
struct Avx2SelectWords : Avx2Words {
  PULSELOCO_GROUP_ISA static std::uint64_t deposit(std::uint64_t bits,
                                                   std::uint64_t mask) noexcept {
    return SelectDeposit::deposit(bits, mask);
  }
};

// A group's membership bitmap over a chunk: bit k of words[w] is set where element 64w + k
// belongs to `group`, and prefix[w] counts the members before word w. Returns the group's size.
template <class Words>
std::uint64_t membership(const std::uint8_t* exponents, std::size_t length, std::uint8_t group,
                         std::uint64_t* words, std::uint32_t* prefix) noexcept {
  const std::size_t full = length / 64;
  std::uint64_t members = 0;
  for (std::size_t w = 0; w < full; ++w) {
    const std::uint64_t word = Words::word(exponents + 64 * w, group);
    words[w] = word;
    prefix[w] = static_cast<std::uint32_t>(members);
    members += Words::count(word);
  }
  if (full * 64 < length) {
    std::uint64_t word = 0;
    for (std::size_t k = 0; full * 64 + k < length; ++k)
      word |= static_cast<std::uint64_t>(exponents[64 * full + k] == group) << k;
    words[full] = word;
    prefix[full] = static_cast<std::uint32_t>(members);
    members += Words::count(word);
  }
  return members;
}

// Encoder: the group-local ranks of n members at `offsets`, from the group's membership.
template <class Words>
void rank_offsets(const std::uint64_t* words, const std::uint32_t* prefix,
                  const std::uint32_t* offsets, std::size_t n, std::uint32_t* ranks) noexcept {
  for (std::size_t j = 0; j < n; ++j) {
    const std::uint32_t o = offsets[j];
    const std::uint64_t below = (std::uint64_t{1} << (o % 64)) - 1;
    ranks[j] = prefix[o / 64] + Words::count(words[o / 64] & below);
  }
}

// Decoder: marks the members whose ranks are set in `coded` (a bitmap over the group's ranks,
// one word of padding past them) in `fired`, or with `complement` the members whose ranks are
// not set. Word by word: each chunk word takes the next count(word) bits of `coded` and
// deposits them at its members (the complement's are the members the deposit leaves clear).
template <class Words>
void mark_ranks(const std::uint64_t* words, const std::uint32_t* prefix, std::size_t words_n,
                const std::uint64_t* coded, bool complement, std::uint64_t* fired) noexcept {
  const std::uint64_t flip = complement ? ~std::uint64_t{0} : 0;
  for (std::size_t w = 0; w < words_n; ++w) {
    const std::uint64_t members = words[w];
    const std::uint32_t at = prefix[w];
    const unsigned shift = at % 64;
    // The bits from `at` on; the second word's part is shifted in two steps so that a shift of
    // 0 does not shift by 64.
    const std::uint64_t bits =
        (coded[at / 64] >> shift) | ((coded[at / 64 + 1] << 1) << (63 - shift));
    fired[w] |= Words::deposit(bits, members) ^ (members & flip);
  }
}

// The offsets of the elements outside [lo, lo + span] (exponents mod 256) into `out` (room for
// length + 4), ascending. Returns their count. Few words hold more than four such elements:
// four are written unconditionally, so that the loop's branches follow the words' counts only
// where those exceed four.
template <class Words>
std::size_t collect_outside(const std::uint8_t* exponents, std::size_t length, std::uint8_t lo,
                            std::uint8_t span, std::uint32_t* out) noexcept {
  std::size_t n = 0;
  const std::size_t full = length / 64;
  for (std::size_t w = 0; w < full; ++w) {
    std::uint64_t word = Words::outside(exponents + 64 * w, lo, span);
    const unsigned count = Words::count(word);
    const auto base = static_cast<std::uint32_t>(64 * w);
    for (unsigned k = 0; k < 4; ++k, word &= word - 1)
      out[n + k] = base + static_cast<std::uint32_t>(std::countr_zero(word));
    for (unsigned k = 4; k < count; ++k, word &= word - 1)
      out[n + k] = base + static_cast<std::uint32_t>(std::countr_zero(word));
    n += count;
  }
  for (std::size_t i = 64 * full; i < length; ++i) {
    if (static_cast<std::uint8_t>(exponents[i] - lo) > span)
      out[n++] = static_cast<std::uint32_t>(i);
  }
  return n;
}

// The AVX2 instances: flattened so that Avx2Words' primitives inline into code compiled for
// the same instruction set.
__attribute__((target("avx2,bmi,bmi2,popcnt"), flatten)) void exponents_avx2(
    std::span<const float> context, std::uint8_t* out) noexcept {
  exponents_of(context, out);
}
__attribute__((target("avx2,bmi,bmi2,popcnt"), flatten)) std::uint64_t membership_avx2(
    const std::uint8_t* exponents, std::size_t length, std::uint8_t group, std::uint64_t* words,
    std::uint32_t* prefix) noexcept {
  return membership<Avx2Words>(exponents, length, group, words, prefix);
}
__attribute__((target("avx2,bmi,bmi2,popcnt"), flatten)) void rank_offsets_avx2(
    const std::uint64_t* words, const std::uint32_t* prefix, const std::uint32_t* offsets,
    std::size_t n, std::uint32_t* ranks) noexcept {
  rank_offsets<Avx2Words>(words, prefix, offsets, n, ranks);
}
__attribute__((target("avx2,bmi,bmi2,popcnt"), flatten)) void mark_ranks_avx2(
    const std::uint64_t* words, const std::uint32_t* prefix, std::size_t words_n,
    const std::uint64_t* coded, bool complement, std::uint64_t* fired) noexcept {
  mark_ranks<Avx2Words>(words, prefix, words_n, coded, complement, fired);
}
__attribute__((target("avx2,bmi,bmi2,popcnt"), flatten)) void mark_ranks_avx2_select(
    const std::uint64_t* words, const std::uint32_t* prefix, std::size_t words_n,
    const std::uint64_t* coded, bool complement, std::uint64_t* fired) noexcept {
  mark_ranks<Avx2SelectWords>(words, prefix, words_n, coded, complement, fired);
}
__attribute__((target("avx2,bmi,bmi2,popcnt"), flatten)) std::size_t collect_outside_avx2(
    const std::uint8_t* exponents, std::size_t length, std::uint8_t lo, std::uint8_t span,
    std::uint32_t* out) noexcept {
  return collect_outside<Avx2Words>(exponents, length, lo, span, out);
}

#undef PULSELOCO_GROUP_ISA

// AVX2, BMI2 and POPCNT when the CPU has them, unless PULSELOCO_CPU_ISA=portable asks for the
// fallback as it does of the kernels (base/cpu_features.h). Read here rather than through
// active_cpu_isa() so that the codec's sanitized build needs no more of base than its errors.
struct GroupPasses {
  decltype(&exponents_of) exponents;
  decltype(&membership<PortableWords>) membership;
  decltype(&rank_offsets<PortableWords>) rank;
  decltype(&mark_ranks<PortableWords>) mark;
  decltype(&collect_outside<PortableWords>) collect;
};
const GroupPasses& group_passes() noexcept {
  static const GroupPasses passes = [] {
    const char* isa = std::getenv("PULSELOCO_CPU_ISA");
    const bool portable = isa != nullptr && std::string_view(isa) == "portable";
    if (!portable && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
        __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt")) {
      const bool microcoded_pdep = __builtin_cpu_is("znver1") || __builtin_cpu_is("znver2");
      return GroupPasses{exponents_avx2, membership_avx2, rank_offsets_avx2,
                         microcoded_pdep ? mark_ranks_avx2_select : mark_ranks_avx2,
                         collect_outside_avx2};
    }
    return GroupPasses{exponents_of, membership<PortableWords>, rank_offsets<PortableWords>,
                       mark_ranks<PortableWords>, collect_outside<PortableWords>};
  }();
  return passes;
}

// The members of the chunk's rare exponents, found in one pass. A pass per group costs the
// same whatever the group's size, and most groups of a chunk of weights are small (the tails of
// the magnitude's distribution): the exponents a sample of the chunk shows often form a range
// whose groups get a pass each; the elements outside it are collected and sorted by exponent.
// Which groups are rare changes only the work, never the result.
class RareGroups {
 public:
  void find(const GroupPasses& passes, const std::uint8_t* exponents, std::size_t length,
            GroupScratch& scratch) {
    constexpr std::size_t kStride = 127;
    constexpr std::size_t kCommonShare = 100;  // a group of at least 1/100 of the sample
    std::array<std::uint32_t, kGroups> sampled{};
    std::size_t samples = 0;
    for (std::size_t i = 0; i < length; i += kStride, ++samples)
      ++sampled[exponents[i]];
    int lo = -1;
    int hi = -1;
    for (int e = 0; e < static_cast<int>(kGroups); ++e) {
      if (kCommonShare * sampled[static_cast<std::size_t>(e)] >= samples &&
          samples >= kCommonShare) {
        if (lo < 0) lo = e;
        hi = e;
      }
    }
    if (scratch.rare_capacity < length + 4) {  // written only where a rare member is found
      scratch.rare = std::make_unique_for_overwrite<std::uint32_t[]>(length + 4);
      scratch.rare_capacity = length + 4;
    }
    std::size_t n = 0;
    if (lo < 0) {  // no common exponent: every group is rare
      for (std::size_t i = 0; i < length; ++i)
        scratch.rare[i] = static_cast<std::uint32_t>(i);
      n = length;
      lo_ = 1;
      span_ = 0;
      all_ = true;
    } else {
      lo_ = static_cast<std::uint8_t>(lo);
      span_ = static_cast<std::uint8_t>(hi - lo);
      all_ = false;
      n = passes.collect(exponents, length, lo_, span_, scratch.rare.get());
    }
    // Sorted by exponent, stably: each group's members stay ascending.
    start_.fill(0);
    for (std::size_t j = 0; j < n; ++j)
      ++start_[exponents[scratch.rare[j]] + 1];
    for (std::size_t e = 0; e < kGroups; ++e)
      start_[e + 1] += start_[e];
    if (scratch.rare_members.size() < n) scratch.rare_members.resize(n);
    std::array<std::uint32_t, kGroups> next{};
    std::copy_n(start_.begin(), kGroups, next.begin());
    for (std::size_t j = 0; j < n; ++j)
      scratch.rare_members[next[exponents[scratch.rare[j]]]++] = scratch.rare[j];
    members_ = scratch.rare_members.data();
  }
  [[nodiscard]] bool is_rare(std::uint8_t exponent) const noexcept {
    return all_ || static_cast<std::uint8_t>(exponent - lo_) > span_;
  }
  // The ascending offsets of a rare group's members.
  [[nodiscard]] std::span<const std::uint32_t> members(std::uint8_t exponent) const noexcept {
    return {members_ + start_[exponent], members_ + start_[exponent + 1u]};
  }

 private:
  std::uint8_t lo_ = 0;
  std::uint8_t span_ = 0;
  bool all_ = false;
  std::array<std::uint32_t, kGroups + 1> start_{};
  const std::uint32_t* members_ = nullptr;
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
  const GroupPasses& passes = group_passes();
  if (scratch.exponents.size() < length) scratch.exponents.resize(length);
  passes.exponents(context, scratch.exponents.data());
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
      scratch.ranks[next[exponents[o]]++] = o;  // the offsets by group; their ranks in `sorted`
  }
  RareGroups rare;
  rare.find(passes, exponents, length, scratch);
  if (scratch.words.size() < word_count(length)) scratch.words.resize(word_count(length));
  if (scratch.prefix.size() < word_count(length)) scratch.prefix.resize(word_count(length));
  std::uint64_t* words = scratch.words.data();
  std::uint32_t* prefix = scratch.prefix.data();
  std::vector<Group>& groups = scratch.group_list;
  groups.clear();
  std::uint64_t bound_bits = 0;
  for (std::size_t e = 0; e < kGroups; ++e) {
    if (start[e + 1] == start[e]) continue;
    Group g{.exponent = static_cast<std::uint8_t>(e),
            .fired = start[e + 1] - start[e],
            .size = 0,
            .parameter = 0,
            .first = start[e]};
    const std::uint32_t* fired_offsets = scratch.ranks.data() + g.first;
    std::uint32_t* ranks = scratch.sorted.data() + g.first;
    if (rare.is_rare(g.exponent)) {
      // Both ascending, and every fired offset is a member.
      const std::span<const std::uint32_t> members = rare.members(g.exponent);
      g.size = members.size();
      std::uint32_t r = 0;
      for (std::size_t j = 0; j < g.fired; ++j) {
        while (members[r] != fired_offsets[j])
          ++r;
        ranks[j] = r;
      }
    } else {
      g.size = passes.membership(exponents, length, g.exponent, words, prefix);
      passes.rank(words, prefix, fired_offsets, g.fired, ranks);
    }
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
    const std::uint64_t start = position;
    std::uint64_t q = 0;
    for (;;) {
      if (position >= total_bits)  // named at the byte where the cut code begins
        fail("group " + std::to_string(group) + ": truncated", bits_at + start / 8);
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
  const GroupPasses& passes = group_passes();
  if (scratch.exponents.size() < length) scratch.exponents.resize(length);
  passes.exponents(context, scratch.exponents.data());
  const std::uint8_t* exponents = scratch.exponents.data();
  const std::size_t words_n = word_count(length);
  scratch.fired.assign(words_n, 0);
  std::uint64_t* fired = scratch.fired.data();
  RareGroups rare;
  rare.find(passes, exponents, length, scratch);
  if (scratch.words.size() < words_n) scratch.words.resize(words_n);
  if (scratch.prefix.size() < words_n) scratch.prefix.resize(words_n);
  std::uint64_t* words = scratch.words.data();
  std::uint32_t* prefix = scratch.prefix.data();
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const Group& g = groups[i];
    const bool is_rare = rare.is_rare(g.exponent);
    const std::span<const std::uint32_t> members =
        is_rare ? rare.members(g.exponent) : std::span<const std::uint32_t>{};
    const std::uint64_t size =
        is_rare ? members.size() : passes.membership(exponents, length, g.exponent, words, prefix);
    if (g.fired > size) {
      fail("group " + std::to_string(i) + " (exponent " + std::to_string(g.exponent) +
               "): " + std::to_string(g.fired) + " fired of its " + std::to_string(size) +
               " elements in this receiver's context",
           0);
    }
    const bool whole = g.fired == size;
    if (whole && g.parameter != 0)
      fail("group " + std::to_string(i) + ": parameter of a group that fired whole", 0);
    const unsigned k = g.parameter & kGroupRiceMask;
    const bool complement = whole || (g.parameter & kGroupComplement) != 0;
    const std::uint64_t coded = complement ? size - g.fired : g.fired;
    // The coded ranks, as a bitmap over the group's ranks (one word of padding past them).
    const std::size_t coded_words = size / 64 + 2;
    scratch.coded.assign(coded_words, 0);
    std::uint64_t* coded_bits = scratch.coded.data();
    std::uint64_t next = 0;  // the smallest rank the next code may give
    for (std::uint64_t j = 0; j < coded; ++j) {
      const std::uint64_t rank = next + rice(k, size, i);
      if (rank >= size) {
        fail("group " + std::to_string(i) + ": rank " + std::to_string(rank) + " beyond its " +
                 std::to_string(size) + " elements in this receiver's context",
             bits_at + position / 8);
      }
      coded_bits[rank / 64] |= std::uint64_t{1} << (rank % 64);
      next = rank + 1;
    }
    if (!is_rare) {
      passes.mark(words, prefix, words_n, coded_bits, complement, fired);
      continue;
    }
    // A rare group's members are listed (and their bits still clear): set those of the coded
    // ranks, or with `complement` the others.
    const std::uint64_t invert = complement ? 1u : 0u;
    for (std::size_t r = 0; r < members.size(); ++r) {
      const std::uint32_t at = members[r];
      fired[at / 64] |= (((coded_bits[r / 64] >> (r % 64)) & 1u) ^ invert) << (at % 64);
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
  // Every group gave exactly its count of distinct members: the bitmap holds n elements. Four
  // offsets of a word are written whatever its count where `out` has the room (as in
  // collect_outside), so that the loop's branches follow the counts only above four.
  std::size_t written = 0;
  for (std::size_t w = 0; w < words_n; ++w) {
    std::uint64_t word = fired[w];
    const auto base = static_cast<std::uint32_t>(64 * w);
    if (written + 4 <= n) {
      const auto count = static_cast<std::size_t>(std::popcount(word));
      for (unsigned k = 0; k < 4; ++k, word &= word - 1)
        out[written + k] = base + static_cast<std::uint32_t>(std::countr_zero(word));
      written += std::min<std::size_t>(count, 4);
    }
    for (; word != 0; word &= word - 1)
      out[written++] = base + static_cast<std::uint32_t>(std::countr_zero(word));
  }
}

}  // namespace pulseloco::codec::detail
