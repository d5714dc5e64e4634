// Counter-based random numbers for the synthetic benchmarks (payload generator, sync bench):
// element i of a stream is a pure function of (stream keys, i), so any chunk of any tensor can be
// generated on its own, in any order, on any thread, with the same result.
#pragma once

#include <cstdint>

namespace pulseloco::bench {

[[nodiscard]] constexpr std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A 32-bit integer hash (Wellons' "lowbias32"): a bijection with full avalanche, cheap enough
// to vectorise (32-bit multiplies).
[[nodiscard]] inline std::uint32_t mix32(std::uint32_t x) noexcept {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// A standard normal variate from two 32-bit hashes: the Irwin-Hall sum of four 16-bit uniforms,
// centred and scaled to unit variance (support +-3.46).
[[nodiscard]] inline float normal_from(std::uint32_t a, std::uint32_t b) noexcept {
  const auto u0 = static_cast<float>(static_cast<std::int32_t>(a & 0xFFFFU));
  const auto u1 = static_cast<float>(static_cast<std::int32_t>(a >> 16));
  const auto u2 = static_cast<float>(static_cast<std::int32_t>(b & 0xFFFFU));
  const auto u3 = static_cast<float>(static_cast<std::int32_t>(b >> 16));
  constexpr float kScale = 1.7320508f / 65536.0f;  // sqrt(3) / 2^16
  return ((u0 + u1) + (u2 + u3) - 2.0f * 65535.0f) * kScale;
}

// Two 32-bit keys of one random stream, derived from up to five identifiers.
struct StreamKeys {
  std::uint32_t a = 0;
  std::uint32_t b = 0;
};

[[nodiscard]] constexpr StreamKeys stream_keys(std::uint64_t seed, std::uint64_t tensor,
                                               std::uint64_t purpose, std::uint64_t step = 0,
                                               std::uint64_t worker = 0) noexcept {
  std::uint64_t x = splitmix64(seed ^ 0x9A7E1);
  x = splitmix64(x ^ tensor);
  x = splitmix64(x ^ (purpose << 48));
  x = splitmix64(x ^ step);
  x = splitmix64(x ^ (worker << 32));
  return {static_cast<std::uint32_t>(x), static_cast<std::uint32_t>(x >> 32)};
}

// Element `index` of a stream as a standard normal, and as 32 uniform bits.
[[nodiscard]] inline float stream_normal(const StreamKeys& keys, std::uint32_t index) noexcept {
  return normal_from(mix32(index ^ keys.a), mix32(index ^ keys.b));
}
[[nodiscard]] inline std::uint32_t stream_bits(const StreamKeys& keys,
                                               std::uint32_t index) noexcept {
  return mix32(mix32(index ^ keys.a) ^ keys.b);
}

}  // namespace pulseloco::bench
