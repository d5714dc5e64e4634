// Internal: an adaptive binary range coder (docs/wire-format.md, "Symbol stream"; why it is our
// own: docs/design.md, "Codec"). Symbols are coded as binary decisions, each under its own
// adaptive probability; a caller picks the probability set (the context) per symbol, which the
// order-0/order-1 coders of the available libraries cannot take from outside the stream.
//
// The coder is the carry-propagating range coder of LZMA (32-bit range, 64-bit low, a byte
// cache), with 16-bit probabilities. The encoder emits exactly one byte per renormalisation plus
// five at the flush, and the decoder reads five at the start plus one per renormalisation, so
// a decoder that decoded every symbol has read exactly the stream: any other size is an error.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

namespace pulseloco::codec::detail {

// The adaptive probability of a zero decision, in units of 2^-16. Each update moves it by
// 1 / (decisions seen + 2) towards the outcome (the Krichevsky-Trofimov estimate of the decisions
// so far) until kBitModelWindow decisions, then by 1 / (kBitModelWindow + 2).
inline constexpr std::uint16_t kBitModelWindow = 1022;

struct BitModel {
  std::uint16_t zero = 1u << 15;
  std::uint16_t seen = 0;
};

namespace range_coding {
inline constexpr std::uint32_t kTop = 1u << 24;
inline constexpr std::uint32_t kProbabilityMin = 32;
inline constexpr std::uint32_t kProbabilityMax = 65536 - 32;

struct RateTable {
  std::array<std::uint32_t, kBitModelWindow + 1> rate{};  // 2^16 / (seen + 2)
  constexpr RateTable() {
    for (std::uint32_t s = 0; s <= kBitModelWindow; ++s)
      rate[s] = 65536u / (s + 2);
  }
};
inline constexpr RateTable kRates{};

inline void update(BitModel& model, unsigned bit) noexcept {
  const std::uint32_t rate = kRates.rate[model.seen];
  std::uint32_t zero = model.zero;
  if (bit == 0) {
    zero = std::min(zero + (((65536u - zero) * rate) >> 16), kProbabilityMax);
  } else {
    zero = std::max(zero - ((zero * rate) >> 16), kProbabilityMin);
  }
  model.zero = static_cast<std::uint16_t>(zero);
  model.seen = static_cast<std::uint16_t>(model.seen + (model.seen < kBitModelWindow ? 1 : 0));
}
}  // namespace range_coding

class RangeEncoder {
 public:
  // Writes from `out` on; the caller provides room for every byte the decisions can take
  // (11.01 bits per modelled decision, 1.01 per direct one, and 5 bytes).
  explicit RangeEncoder(std::byte* out) noexcept : out_(out) {}

  void encode(BitModel& model, unsigned bit) noexcept {
    code(model.zero, bit);
    range_coding::update(model, bit);
  }
  // A decision of probability 1/2 that no model learns (escaped symbols' bits).
  void encode_direct(unsigned bit) noexcept { code(1u << 15, bit); }

  // Codes the low `bits` bits of `symbol`, most significant first, on a binary tree of models:
  // `tree` has 2^bits entries (entry 0 unused).
  void encode_tree(BitModel* tree, unsigned bits, unsigned symbol) noexcept {
    unsigned node = 1;
    for (unsigned b = bits; b-- > 0;) {
      const unsigned bit = (symbol >> b) & 1u;
      encode(tree[node], bit);
      node = (node << 1) | bit;
    }
  }

  // Writes the coder's last bytes and returns the end of its output; the encoder must not be
  // used afterwards.
  std::byte* finish() noexcept {
    for (int i = 0; i < 5; ++i)
      shift_low();
    return out_;
  }

 private:
  void code(std::uint32_t zero, unsigned bit) noexcept {
    const std::uint32_t bound = (range_ >> 16) * zero;
    if (bit == 0) {
      range_ = bound;
    } else {
      low_ += bound;
      range_ -= bound;
    }
    while (range_ < range_coding::kTop) {
      range_ <<= 8;
      shift_low();
    }
  }
  void shift_low() noexcept {
    if (static_cast<std::uint32_t>(low_) < 0xFF000000u || (low_ >> 32) != 0) {
      const auto carry = static_cast<std::uint8_t>(low_ >> 32);
      std::uint8_t byte = cache_;
      do {
        *out_++ = static_cast<std::byte>(static_cast<std::uint8_t>(byte + carry));
        byte = 0xFF;
      } while (--pending_ != 0);
      cache_ = static_cast<std::uint8_t>(low_ >> 24);
    }
    ++pending_;
    low_ = (low_ & 0x00FFFFFFu) << 8;
  }

  std::byte* out_;
  std::uint64_t low_ = 0;
  std::uint32_t range_ = 0xFFFFFFFFu;
  std::uint8_t cache_ = 0;
  std::uint64_t pending_ = 1;
};

class RangeDecoder {
 public:
  // Reads `in`; past its end the decoder reads zero bytes and remembers the overrun.
  explicit RangeDecoder(std::span<const std::byte> in) noexcept : in_(in) {
    first_ = next();
    for (int i = 0; i < 4; ++i)
      code_ = (code_ << 8) | next();
  }

  [[nodiscard]] unsigned decode(BitModel& model) noexcept {
    const unsigned bit = code(model.zero);
    range_coding::update(model, bit);
    return bit;
  }
  [[nodiscard]] unsigned decode_direct() noexcept { return code(1u << 15); }
  [[nodiscard]] unsigned decode_tree(BitModel* tree, unsigned bits) noexcept {
    unsigned node = 1;
    for (unsigned b = 0; b < bits; ++b)
      node = (node << 1) | decode(tree[node]);
    return node - (1u << bits);
  }

  // After the last symbol: whether the stream was exactly what the decoder read, with the
  // encoder's leading zero byte.
  [[nodiscard]] bool consumed_exactly() const noexcept {
    return first_ == 0 && position_ == in_.size();
  }

 private:
  unsigned code(std::uint32_t zero) noexcept {
    const std::uint32_t bound = (range_ >> 16) * zero;
    unsigned bit;
    if (code_ < bound) {
      range_ = bound;
      bit = 0;
    } else {
      code_ -= bound;
      range_ -= bound;
      bit = 1;
    }
    while (range_ < range_coding::kTop) {
      range_ <<= 8;
      code_ = (code_ << 8) | next();
    }
    return bit;
  }
  std::uint32_t next() noexcept {
    const std::size_t at = position_++;
    return at < in_.size() ? std::to_integer<std::uint32_t>(in_[at]) : 0u;
  }

  std::span<const std::byte> in_;
  std::size_t position_ = 0;
  std::uint32_t first_ = 0;
  std::uint32_t code_ = 0;
  std::uint32_t range_ = 0xFFFFFFFFu;
};

}  // namespace pulseloco::codec::detail
