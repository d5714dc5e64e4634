// Internal: libxxhash's XXH3_64bits (default secret, seed 0) taken apart into pieces that can run
// in parallel, as host and device functions. The CUDA digest kernels only orchestrate these;
// tests/kernels/xxh3_blocks_test.cpp checks the decomposition against libxxhash on the host.
//
// The long-input path (more than 240 bytes) accumulates 64-byte stripes into 8 lanes and, after
// every 1 KiB block, scrambles each lane. Within a block the accumulation is a sum
// (acc[i ^ 1] += data; acc[i] += lo32(key) * hi32(key)), so each block's contribution to the
// lanes is computed independently (block_contribution); the scramble of lane i depends only on
// lane i, so the chain over blocks runs per lane afterwards (chain_lane). The tail (the last
// partial block, the last stripe, the merge and the avalanche) follows xxhash.h line for line.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define PULSELOCO_XXH3_FUNCTION __host__ __device__ __forceinline__
#else
#define PULSELOCO_XXH3_FUNCTION inline
#endif

namespace pulseloco::kernels::xxh3 {

inline constexpr std::size_t kStripeBytes = 64;
inline constexpr std::size_t kLanes = 8;
inline constexpr std::size_t kSecretBytes = 192;
inline constexpr std::size_t kSecretConsumeRate = 8;
inline constexpr std::size_t kStripesPerBlock = (kSecretBytes - kStripeBytes) / kSecretConsumeRate;
inline constexpr std::size_t kBlockBytes = kStripeBytes * kStripesPerBlock;  // 1 KiB
inline constexpr std::size_t kMidsizeMax = 240;  // longer inputs take the long path
inline constexpr std::size_t kSecretSizeMin = 136;
inline constexpr std::size_t kLastStripeSecretStart = 7;
inline constexpr std::size_t kMergeSecretStart = 11;
static_assert(kStripesPerBlock == 16 && kBlockBytes == 1024);

inline constexpr std::uint64_t kPrime32_1 = 0x9E3779B1u;
inline constexpr std::uint64_t kPrime32_2 = 0x85EBCA77u;
inline constexpr std::uint64_t kPrime32_3 = 0xC2B2AE3Du;
inline constexpr std::uint64_t kPrime64_1 = 0x9E3779B185EBCA87ull;
inline constexpr std::uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4Full;
inline constexpr std::uint64_t kPrime64_3 = 0x165667B19E3779F9ull;
inline constexpr std::uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ull;
inline constexpr std::uint64_t kPrime64_5 = 0x27D4EB2F165667C5ull;

// libxxhash's default secret (XXH3_kSecret). A struct, so a kernel can take it by value.
struct Secret {
  std::uint8_t bytes[kSecretBytes];
};
inline constexpr Secret kDefaultSecret = {{
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
}};

// Byte-wise little-endian reads: no alignment needed, the same on every host and device.
PULSELOCO_XXH3_FUNCTION std::uint32_t read_le32(const std::uint8_t* p) {
  return std::uint32_t{p[0]} | std::uint32_t{p[1]} << 8 | std::uint32_t{p[2]} << 16 |
         std::uint32_t{p[3]} << 24;
}
PULSELOCO_XXH3_FUNCTION std::uint64_t read_le64(const std::uint8_t* p) {
  return std::uint64_t{read_le32(p)} | std::uint64_t{read_le32(p + 4)} << 32;
}

PULSELOCO_XXH3_FUNCTION std::uint64_t xorshift64(std::uint64_t v, int shift) {
  return v ^ (v >> shift);
}
PULSELOCO_XXH3_FUNCTION std::uint64_t rotl64(std::uint64_t v, int r) {
  return (v << r) | (v >> (64 - r));
}
PULSELOCO_XXH3_FUNCTION std::uint64_t swap32(std::uint32_t v) {
  return ((v << 24) & 0xff000000u) | ((v << 8) & 0x00ff0000u) | ((v >> 8) & 0x0000ff00u) |
         ((v >> 24) & 0x000000ffu);
}
PULSELOCO_XXH3_FUNCTION std::uint64_t swap64(std::uint64_t v) {
  return swap32(static_cast<std::uint32_t>(v)) << 32 | swap32(static_cast<std::uint32_t>(v >> 32));
}
PULSELOCO_XXH3_FUNCTION std::uint64_t mult32to64(std::uint64_t x, std::uint64_t y) {
  return (x & 0xFFFFFFFFu) * (y & 0xFFFFFFFFu);
}

// The low 64 bits of the 128-bit product XOR its high 64 bits (XXH3_mul128_fold64), from
// 32-bit cross products as xxhash.h's portable path computes them.
PULSELOCO_XXH3_FUNCTION std::uint64_t mul128_fold64(std::uint64_t lhs, std::uint64_t rhs) {
  const std::uint64_t lo_lo = mult32to64(lhs & 0xFFFFFFFFu, rhs & 0xFFFFFFFFu);
  const std::uint64_t hi_lo = mult32to64(lhs >> 32, rhs & 0xFFFFFFFFu);
  const std::uint64_t lo_hi = mult32to64(lhs & 0xFFFFFFFFu, rhs >> 32);
  const std::uint64_t hi_hi = mult32to64(lhs >> 32, rhs >> 32);
  const std::uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFu) + lo_hi;
  const std::uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
  const std::uint64_t lower = (cross << 32) | (lo_lo & 0xFFFFFFFFu);
  return lower ^ upper;
}

PULSELOCO_XXH3_FUNCTION std::uint64_t xxh64_avalanche(std::uint64_t h) {
  h ^= h >> 33;
  h *= kPrime64_2;
  h ^= h >> 29;
  h *= kPrime64_3;
  h ^= h >> 32;
  return h;
}
PULSELOCO_XXH3_FUNCTION std::uint64_t avalanche(std::uint64_t h) {
  h = xorshift64(h, 37);
  h *= 0x165667919E3779F9ull;
  return xorshift64(h, 32);
}
PULSELOCO_XXH3_FUNCTION std::uint64_t rrmxmx(std::uint64_t h, std::uint64_t len) {
  h ^= rotl64(h, 49) ^ rotl64(h, 24);
  h *= 0x9FB21C651E98DF25ull;
  h ^= (h >> 35) + len;
  h *= 0x9FB21C651E98DF25ull;
  return xorshift64(h, 28);
}
PULSELOCO_XXH3_FUNCTION std::uint64_t mix16(const std::uint8_t* input, const std::uint8_t* secret) {
  return mul128_fold64(read_le64(input) ^ read_le64(secret),
                       read_le64(input + 8) ^ read_le64(secret + 8));
}

// XXH3_64bits for len <= 240 (seed 0).
PULSELOCO_XXH3_FUNCTION std::uint64_t hash_short(const std::uint8_t* input, std::size_t len,
                                                 const std::uint8_t* secret) {
  if (len == 0) return xxh64_avalanche(read_le64(secret + 56) ^ read_le64(secret + 64));
  if (len <= 3) {
    const std::uint32_t combined =
        std::uint32_t{input[0]} << 16 | std::uint32_t{input[len >> 1]} << 24 |
        std::uint32_t{input[len - 1]} | static_cast<std::uint32_t>(len) << 8;
    const std::uint64_t bitflip = read_le32(secret) ^ read_le32(secret + 4);
    return xxh64_avalanche(std::uint64_t{combined} ^ bitflip);
  }
  if (len <= 8) {
    const std::uint32_t input1 = read_le32(input);
    const std::uint32_t input2 = read_le32(input + len - 4);
    const std::uint64_t bitflip = read_le64(secret + 8) ^ read_le64(secret + 16);
    const std::uint64_t input64 = input2 + (std::uint64_t{input1} << 32);
    return rrmxmx(input64 ^ bitflip, len);
  }
  if (len <= 16) {
    const std::uint64_t bitflip1 = read_le64(secret + 24) ^ read_le64(secret + 32);
    const std::uint64_t bitflip2 = read_le64(secret + 40) ^ read_le64(secret + 48);
    const std::uint64_t input_lo = read_le64(input) ^ bitflip1;
    const std::uint64_t input_hi = read_le64(input + len - 8) ^ bitflip2;
    return avalanche(len + swap64(input_lo) + input_hi + mul128_fold64(input_lo, input_hi));
  }
  std::uint64_t acc = len * kPrime64_1;
  if (len <= 128) {
    if (len > 32) {
      if (len > 64) {
        if (len > 96) {
          acc += mix16(input + 48, secret + 96);
          acc += mix16(input + len - 64, secret + 112);
        }
        acc += mix16(input + 32, secret + 64);
        acc += mix16(input + len - 48, secret + 80);
      }
      acc += mix16(input + 16, secret + 32);
      acc += mix16(input + len - 32, secret + 48);
    }
    acc += mix16(input, secret);
    acc += mix16(input + len - 16, secret + 16);
    return avalanche(acc);
  }
  constexpr std::size_t kMidsizeStartOffset = 3;
  constexpr std::size_t kMidsizeLastOffset = 17;
  const std::size_t rounds = len / 16;
  for (std::size_t i = 0; i < 8; ++i)
    acc += mix16(input + 16 * i, secret + 16 * i);
  acc = avalanche(acc);
  for (std::size_t i = 8; i < rounds; ++i)
    acc += mix16(input + 16 * i, secret + 16 * (i - 8) + kMidsizeStartOffset);
  acc += mix16(input + len - 16, secret + kSecretSizeMin - kMidsizeLastOffset);
  return avalanche(acc);
}

PULSELOCO_XXH3_FUNCTION void init_lanes(std::uint64_t acc[kLanes]) {
  const std::uint64_t init[kLanes] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                                      kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
  for (std::size_t i = 0; i < kLanes; ++i)
    acc[i] = init[i];
}

// What stripe word `data` of lane `lane` adds (key: the secret word it meets): `data` goes to
// lane ^ 1 (accumulate_512's lane swap), the product to `lane`.
PULSELOCO_XXH3_FUNCTION std::uint64_t word_product(std::uint64_t data, std::uint64_t key) {
  const std::uint64_t keyed = data ^ key;
  return mult32to64(keyed & 0xFFFFFFFFu, keyed >> 32);
}

// XXH3_accumulate_512: adds one 64-byte stripe to the lanes.
PULSELOCO_XXH3_FUNCTION void accumulate_stripe(std::uint64_t acc[kLanes],
                                               const std::uint8_t* stripe,
                                               const std::uint8_t* secret) {
  for (std::size_t i = 0; i < kLanes; ++i) {
    const std::uint64_t data = read_le64(stripe + 8 * i);
    acc[i ^ 1] += data;
    acc[i] += word_product(data, read_le64(secret + 8 * i));
  }
}

// The sum `stripes` stripes from `input` add to the lanes (XXH3_accumulate from zero lanes).
PULSELOCO_XXH3_FUNCTION void block_contribution(const std::uint8_t* input, std::size_t stripes,
                                                const std::uint8_t* secret,
                                                std::uint64_t out[kLanes]) {
  for (std::size_t i = 0; i < kLanes; ++i)
    out[i] = 0;
  for (std::size_t s = 0; s < stripes; ++s)
    accumulate_stripe(out, input + s * kStripeBytes, secret + s * kSecretConsumeRate);
}

// The secret word that scrambles lane `lane` after each full block.
PULSELOCO_XXH3_FUNCTION std::uint64_t scramble_key(const std::uint8_t* secret, std::size_t lane) {
  return read_le64(secret + kSecretBytes - kStripeBytes + 8 * lane);
}

// One lane through one full block: add the block's contribution, then XXH3_scrambleAcc.
PULSELOCO_XXH3_FUNCTION std::uint64_t chain_lane(std::uint64_t lane_acc, std::uint64_t contribution,
                                                 std::uint64_t key) {
  lane_acc += contribution;
  lane_acc = xorshift64(lane_acc, 47);
  lane_acc ^= key;
  return lane_acc * kPrime32_1;
}

// The full blocks the long path scrambles after (XXH3_hashLong_internal_loop's nb_blocks).
PULSELOCO_XXH3_FUNCTION std::size_t full_blocks(std::size_t len) {
  return (len - 1) / kBlockBytes;
}

// After the lanes went through full_blocks(len) blocks: the last partial block, the last
// stripe, XXH3_mergeAccs and the avalanche. `input` is the whole input (len > 240).
PULSELOCO_XXH3_FUNCTION std::uint64_t finish_long(std::uint64_t acc[kLanes],
                                                  const std::uint8_t* input, std::size_t len,
                                                  const std::uint8_t* secret) {
  const std::size_t blocks = full_blocks(len);
  const std::size_t stripes = ((len - 1) - kBlockBytes * blocks) / kStripeBytes;
  const std::uint8_t* partial = input + blocks * kBlockBytes;
  for (std::size_t s = 0; s < stripes; ++s)
    accumulate_stripe(acc, partial + s * kStripeBytes, secret + s * kSecretConsumeRate);
  accumulate_stripe(acc, input + len - kStripeBytes,
                    secret + kSecretBytes - kStripeBytes - kLastStripeSecretStart);
  std::uint64_t result = len * kPrime64_1;
  const std::uint8_t* merge = secret + kMergeSecretStart;
  for (std::size_t i = 0; i < 4; ++i) {
    result += mul128_fold64(acc[2 * i] ^ read_le64(merge + 16 * i),
                            acc[2 * i + 1] ^ read_le64(merge + 16 * i + 8));
  }
  return avalanche(result);
}

// XXH3_64bits(input, len) through the decomposition above, sequentially: the reference the
// parallel forms are tested against.
PULSELOCO_XXH3_FUNCTION std::uint64_t hash(const std::uint8_t* input, std::size_t len,
                                           const std::uint8_t* secret) {
  if (len <= kMidsizeMax) return hash_short(input, len, secret);
  std::uint64_t acc[kLanes];
  init_lanes(acc);
  const std::size_t blocks = full_blocks(len);
  for (std::size_t b = 0; b < blocks; ++b) {
    std::uint64_t contribution[kLanes];
    block_contribution(input + b * kBlockBytes, kStripesPerBlock, secret, contribution);
    for (std::size_t i = 0; i < kLanes; ++i)
      acc[i] = chain_lane(acc[i], contribution[i], scramble_key(secret, i));
  }
  return finish_long(acc, input, len, secret);
}

}  // namespace pulseloco::kernels::xxh3
