// The adaptive binary range coder and the symbol stream of context frames built on it
// (src/codec/range_coder.h, context_coding.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <pulseloco/codec/context_coding.h>
#include <pulseloco/codec/range_coder.h>

namespace pulseloco::codec::detail {
namespace {

struct Decision {
  unsigned model;
  unsigned bit;
};

// Decisions drawn from `models` sources with P(1) = probabilities[model].
std::vector<Decision> draw(const std::vector<double>& probabilities, std::size_t count,
                           std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::vector<Decision> decisions(count);
  for (auto& d : decisions) {
    d.model = static_cast<unsigned>(rng() % probabilities.size());
    d.bit = uniform(rng) < probabilities[d.model] ? 1u : 0u;
  }
  return decisions;
}

std::vector<std::byte> encode(const std::vector<Decision>& decisions, std::size_t models) {
  std::vector<std::byte> out(2 * decisions.size() + 5);
  std::vector<BitModel> state(models);
  RangeEncoder encoder(out.data());
  for (const Decision& d : decisions)
    encoder.encode(state[d.model], d.bit);
  out.resize(static_cast<std::size_t>(encoder.finish() - out.data()));
  return out;
}

// Decodes `count` decisions; false when the stream is not exactly what they need.
bool decode(std::span<const std::byte> in, const std::vector<Decision>& expected,
            std::size_t models, std::vector<unsigned>& bits) {
  std::vector<BitModel> state(models);
  RangeDecoder decoder(in);
  bits.clear();
  for (const Decision& d : expected)
    bits.push_back(decoder.decode(state[d.model]));
  return decoder.consumed_exactly();
}

TEST(RangeCoder, DecisionsRoundTripAndTheStreamIsReadExactly) {
  const std::vector<double> probabilities = {0.5, 0.02, 0.98, 0.3, 0.0, 1.0};
  for (const std::size_t count : {0u, 1u, 7u, 1000u, 100000u}) {
    const auto decisions = draw(probabilities, count, static_cast<std::uint32_t>(count));
    const auto stream = encode(decisions, probabilities.size());
    std::vector<unsigned> bits;
    ASSERT_TRUE(decode(stream, decisions, probabilities.size(), bits)) << count;
    for (std::size_t i = 0; i < count; ++i)
      ASSERT_EQ(bits[i], decisions[i].bit) << count << " " << i;
  }
}

TEST(RangeCoder, AShortenedOrLengthenedStreamIsNotReadExactly) {
  const auto decisions = draw({0.1, 0.6}, 5000, 3);
  const auto stream = encode(decisions, 2);
  std::vector<unsigned> bits;
  auto shorter = stream;
  shorter.pop_back();
  EXPECT_FALSE(decode(shorter, decisions, 2, bits));
  auto longer = stream;
  longer.push_back(std::byte{0});
  EXPECT_FALSE(decode(longer, decisions, 2, bits));
  auto first = stream;
  first[0] = std::byte{1};
  EXPECT_FALSE(decode(first, decisions, 2, bits));
}

TEST(RangeCoder, AStationarySourceCodesWithinOnePercentOfItsEntropy) {
  // The adaptive estimate converges on the source: 10^5 decisions of P(1) = 0.05 take at most
  // 1% more than their entropy (the cost of learning the probability is ~ log2(n) / 2 bits).
  const double p = 0.05;
  const auto decisions = draw({p}, 100000, 11);
  std::size_t ones = 0;
  for (const Decision& d : decisions)
    ones += d.bit;
  const double n = static_cast<double>(decisions.size());
  const double q = static_cast<double>(ones) / n;
  const double entropy_bits = -n * (q * std::log2(q) + (1 - q) * std::log2(1 - q));
  const auto stream = encode(decisions, 1);
  EXPECT_LE(static_cast<double>(stream.size()) * 8, entropy_bits * 1.01);
  EXPECT_GE(static_cast<double>(stream.size()) * 8, entropy_bits * 0.99);
}

TEST(RangeCoder, TreeSymbolsAndDirectBitsRoundTrip) {
  std::mt19937 rng(5);
  std::vector<unsigned> symbols(20000);
  for (auto& s : symbols)
    s = (rng() % 4 == 0) ? rng() % 64 : 20 + rng() % 3;  // a peaked alphabet of 64
  std::vector<std::byte> out(symbols.size() * 10 + 5);
  std::vector<BitModel> tree(64);
  RangeEncoder encoder(out.data());
  for (const unsigned s : symbols) {
    encoder.encode_tree(tree.data(), 6, s);
    encoder.encode_direct(s & 1u);
  }
  out.resize(static_cast<std::size_t>(encoder.finish() - out.data()));
  std::vector<BitModel> decoding_tree(64);
  RangeDecoder decoder(out);
  for (const unsigned s : symbols) {
    ASSERT_EQ(decoder.decode_tree(decoding_tree.data(), 6), s);
    ASSERT_EQ(decoder.decode_direct(), s & 1u);
  }
  EXPECT_TRUE(decoder.consumed_exactly());
}

TEST(SymbolStream, EveryByteOfEverySymbolRoundTripsWithinTheSizeBound) {
  // Every D and U byte under every context exponent (escapes included), every residue multiple,
  // and bytes drawn so as to make the models wrong as often as possible: the stream stays within
  // the bound that the decoder's directory check allows, with multiples and without.
  const std::size_t n = 256 * 256;
  std::vector<std::uint8_t> e(n), d(n), u(n), k(n);
  for (std::size_t i = 0; i < n; ++i) {
    e[i] = static_cast<std::uint8_t>(i * 7);
    d[i] = static_cast<std::uint8_t>(i);
    u[i] = static_cast<std::uint8_t>(i >> 8);
    k[i] = static_cast<std::uint8_t>(i * 13 + (i >> 9));  // never the previous entry's
  }
  SymbolModels models;
  for (int adversarial = 0; adversarial < 2; ++adversarial) {
    if (adversarial == 1) {
      // Long runs of one symbol, then a different one: every model is confident and wrong.
      for (std::size_t i = 0; i < n; ++i) {
        e[i] = 5;
        const bool surprise = i % 97 == 96;
        d[i] = surprise ? static_cast<std::uint8_t>(i / 97) : 0xE8;  // D = -24: tree symbol 0
        u[i] = surprise ? static_cast<std::uint8_t>(0x80 | (i / 97)) : 0xF8;
        k[i] = surprise ? static_cast<std::uint8_t>(0x55 ^ (i / 97)) : 4;
      }
    }
    for (const bool multiples : {false, true}) {
      std::vector<std::byte> stream(symbol_stream_capacity(n, multiples));
      stream.resize(encode_symbols(e.data(), d.data(), u.data(), multiples ? k.data() : nullptr, n,
                                   models, stream.data()));
      EXPECT_LE(stream.size(), n * (kContextMaxSymbolBytesPerEntry +
                                    (multiples ? kContextMaxMultipleBytesPerEntry : 0)) +
                                   kContextSymbolStreamOverhead);
      std::vector<std::uint8_t> d2(n), u2(n), k2(n);
      ASSERT_TRUE(decode_symbols(stream, e.data(), n, models, d2.data(), u2.data(),
                                 multiples ? k2.data() : nullptr));
      EXPECT_EQ(d2, d);
      EXPECT_EQ(u2, u);
      if (multiples) {
        EXPECT_EQ(k2, k);
      }
    }
  }
}

TEST(SymbolStream, AMultipleTheRepeatDecisionCodesIsRefusedOnTheTree) {
  // The first entry's multiple 1 repeats the initial one; coded on the tree instead, it decodes
  // to the same byte but is not what an encoder writes.
  std::vector<std::byte> stream(64);
  SymbolModels models;
  models.reset();
  RangeEncoder encoder(stream.data());
  encoder.encode(models.multiple_repeats, 1);
  encoder.encode_tree(models.multiple.data(), kMultipleTreeBits, 1);
  encoder.encode_tree(models.exponent[100].data(), kExponentTreeBits, 24);  // D = 0
  encoder.encode_tree(models.zero_run[12].data(), kZeroRunTreeBits, 8);     // U = 0
  stream.resize(static_cast<std::size_t>(encoder.finish() - stream.data()));
  const std::uint8_t e = 100;
  std::uint8_t d = 1, u = 1, k = 0;
  EXPECT_FALSE(decode_symbols(stream, &e, 1, models, &d, &u, &k));
  // The same entry with the repeat decision decodes.
  std::vector<std::byte> canonical(64);
  models.reset();
  RangeEncoder again(canonical.data());
  again.encode(models.multiple_repeats, 0);
  again.encode_tree(models.exponent[100].data(), kExponentTreeBits, 24);
  again.encode_tree(models.zero_run[12].data(), kZeroRunTreeBits, 8);
  canonical.resize(static_cast<std::size_t>(again.finish() - canonical.data()));
  ASSERT_TRUE(decode_symbols(canonical, &e, 1, models, &d, &u, &k));
  EXPECT_EQ(k, 1);
  EXPECT_EQ(d, 0);
  EXPECT_EQ(u, 0);
}

TEST(SymbolStream, AnEscapeOfASymbolTheTreeCodesIsRefused) {
  // D = 0 is tree symbol 24; written as an escape (tree symbol 63, then its 8 bits) it decodes
  // to the same byte but is not what an encoder writes.
  std::vector<std::byte> stream(64);
  SymbolModels models;
  models.reset();
  RangeEncoder encoder(stream.data());
  encoder.encode_tree(models.exponent[100].data(), kExponentTreeBits, 63);
  for (int b = 0; b < 8; ++b)
    encoder.encode_direct(0);
  encoder.encode_tree(models.zero_run[12].data(), kZeroRunTreeBits, 8);  // U = 0
  stream.resize(static_cast<std::size_t>(encoder.finish() - stream.data()));
  const std::uint8_t e = 100;
  std::uint8_t d = 1;
  std::uint8_t u = 1;
  EXPECT_FALSE(decode_symbols(stream, &e, 1, models, &d, &u, nullptr));
}

}  // namespace
}  // namespace pulseloco::codec::detail
