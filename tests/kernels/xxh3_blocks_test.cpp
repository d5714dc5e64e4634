// The xxh3 decomposition the CUDA digest kernels run (kernels/xxh3_blocks.h), checked on the
// host against libxxhash's XXH3_64bits on every length class: 0-16, 17-128, 129-240, one
// stripe, one block, the edges of a block and a digest piece.
#include <pulseloco/kernels/xxh3_blocks.h>

#include <gtest/gtest.h>
#include <xxhash.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include <pulseloco/base/digest.h>

namespace pulseloco::kernels {
namespace {

std::vector<std::uint8_t> random_bytes(std::size_t count, std::uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<std::uint8_t> bytes(count);
  for (std::uint8_t& b : bytes)
    b = static_cast<std::uint8_t>(random());
  return bytes;
}

std::vector<std::size_t> tested_lengths() {
  std::vector<std::size_t> lengths = {
      0,   1,    2,    3,    4,    7,    8,    9,    15,   16,   17,   31,        32,  33,
      64,  65,   96,   97,   127,  128,  129,  143,  144,  239,  240,  241,       255, 256,
      257, 1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 2049, 3000, 65536 + 13};
  lengths.push_back(kBufferDigestPieceBytes - 1);
  lengths.push_back(kBufferDigestPieceBytes);
  lengths.push_back(kBufferDigestPieceBytes + 7);
  return lengths;
}

TEST(Xxh3Blocks, SequentialDecompositionMatchesLibxxhash) {
  const std::vector<std::uint8_t> bytes = random_bytes(kBufferDigestPieceBytes + 64, 11);
  for (const std::size_t len : tested_lengths()) {
    for (const std::size_t offset : {std::size_t{0}, std::size_t{3}}) {
      const std::uint8_t* input = bytes.data() + offset;
      EXPECT_EQ(xxh3::hash(input, len, xxh3::kDefaultSecret.bytes), XXH3_64bits(input, len))
          << "length " << len << ", offset " << offset;
    }
  }
}

// The order the GPU computes it in: every block's contribution first (a warp each: thread t
// holds words t, t + 32, t + 64, t + 96 of the block, all of lane t % 8), then the per-lane
// chains, then the tail.
TEST(Xxh3Blocks, ParallelOrderMatchesLibxxhash) {
  const std::uint8_t* secret = xxh3::kDefaultSecret.bytes;
  const std::vector<std::uint8_t> bytes = random_bytes(kBufferDigestPieceBytes + 7, 12);
  for (const std::size_t len : tested_lengths()) {
    if (len <= xxh3::kMidsizeMax) continue;
    const std::size_t blocks = xxh3::full_blocks(len);
    std::vector<std::array<std::uint64_t, xxh3::kLanes>> contributions(blocks);
    for (std::size_t b = 0; b < blocks; ++b) {
      const std::uint8_t* block = bytes.data() + b * xxh3::kBlockBytes;
      std::array<std::uint64_t, 32> data{};
      std::array<std::uint64_t, 32> product{};
      for (std::size_t t = 0; t < 32; ++t) {
        const std::size_t lane = t % xxh3::kLanes;
        for (std::size_t j = 0; j < 4; ++j) {
          const std::size_t word = t + 32 * j;
          const std::size_t stripe = word / xxh3::kLanes;
          const std::uint64_t value = xxh3::read_le64(block + 8 * word);
          data[t] += value;
          product[t] += xxh3::word_product(value, xxh3::read_le64(secret + 8 * (stripe + lane)));
        }
      }
      for (std::size_t lane = 0; lane < xxh3::kLanes; ++lane) {
        std::uint64_t sum = 0;
        for (std::size_t t = lane; t < 32; t += xxh3::kLanes)
          sum += product[t];
        for (std::size_t t = lane ^ 1; t < 32; t += xxh3::kLanes)
          sum += data[t];
        contributions[b][lane] = sum;
      }
      std::uint64_t reference[xxh3::kLanes];
      xxh3::block_contribution(block, xxh3::kStripesPerBlock, secret, reference);
      for (std::size_t lane = 0; lane < xxh3::kLanes; ++lane)
        ASSERT_EQ(contributions[b][lane], reference[lane]) << "block " << b << " lane " << lane;
    }
    std::uint64_t acc[xxh3::kLanes];
    xxh3::init_lanes(acc);
    for (std::size_t lane = 0; lane < xxh3::kLanes; ++lane) {
      for (std::size_t b = 0; b < blocks; ++b)
        acc[lane] =
            xxh3::chain_lane(acc[lane], contributions[b][lane], xxh3::scramble_key(secret, lane));
    }
    EXPECT_EQ(xxh3::finish_long(acc, bytes.data(), len, secret), XXH3_64bits(bytes.data(), len))
        << "length " << len;
  }
}

}  // namespace
}  // namespace pulseloco::kernels
