#include <pulseloco/base/digest.h>

#include <gtest/gtest.h>
#include <xxhash.h>

#include <random>

#include <pulseloco/base/cpu_features.h>
#include <pulseloco/base/digest_dispatch.h>
#include <pulseloco/base/thread_pool.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <vector>

namespace pulseloco {
namespace {

TEST(Digest, MatchesTheXxh3ReferenceValue) {
  // XXH3_64bits of the empty input (seed 0), from the xxHash specification's test vectors.
  EXPECT_EQ(digest_bytes({}), 0x2D06800538D394C2ull);
  EXPECT_EQ(digest_hex(0x2D06800538D394C2ull), "2d06800538d394c2");
}

// The AVX2 build of xxh3 (used when the CPU has AVX2) must agree with libxxhash's baseline build
// on every length class of the algorithm (0-16, 17-128, 129-240, stripes, blocks, long inputs)
// and every alignment, one-shot and streamed in random pieces.
TEST(Digest, Avx2BuildAgreesWithLibxxhash) {
#if PULSELOCO_DIGEST_HAS_AVX2
  if (!cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2";
  std::mt19937_64 random(7);
  std::vector<std::uint8_t> data((1u << 20) + 4096);
  for (auto& b : data)
    b = static_cast<std::uint8_t>(random());
  std::vector<std::size_t> sizes;
  for (std::size_t n = 0; n <= 2048; ++n)
    sizes.push_back(n);
  for (std::size_t n : {4095u, 4096u, 65535u, 65536u, 1u << 20, (1u << 20) + 13})
    sizes.push_back(n);
  for (const std::size_t n : sizes) {
    const std::size_t offset = n % 61;  // unaligned starts too
    const std::uint8_t* p = data.data() + offset;
    ASSERT_EQ(detail::xxh3_avx2(p, n), detail::xxh3_baseline(p, n)) << "size " << n;
  }
  for (int trial = 0; trial < 50; ++trial) {
    const std::size_t n = random() % data.size();
    void* state = detail::xxh3_avx2_stream_create();
    ASSERT_NE(state, nullptr);
    for (std::size_t at = 0; at < n;) {
      const std::size_t piece = std::min<std::size_t>(n - at, random() % 70000);
      detail::xxh3_avx2_stream_update(state, data.data() + at, piece);
      at += piece;
    }
    EXPECT_EQ(detail::xxh3_avx2_stream_digest(state), detail::xxh3_baseline(data.data(), n))
        << "streamed size " << n;
    detail::xxh3_avx2_stream_free(state);
  }
#else
  GTEST_SKIP() << "built without the AVX2 xxh3 (not x86-64 GCC/Clang)";
#endif
}

TEST(Digest, StreamingEqualsOneShot) {
  std::vector<std::uint8_t> data(10007);
  std::iota(data.begin(), data.end(), 0);
  const auto bytes = std::as_bytes(std::span(data));
  DigestStream stream;
  stream.update(bytes.subspan(0, 1));
  stream.update(bytes.subspan(1, 4095));
  stream.update(bytes.subspan(4096));
  EXPECT_EQ(stream.finish(), digest_bytes(bytes));
  stream.reset();
  EXPECT_EQ(stream.finish(), digest_bytes({}));
}

TEST(Digest, OneBitChangesTheDigest) {
  std::vector<float> values(1000, 1.0f);
  const Digest before = digest_of<float>(values);
  values[999] = std::nextafter(1.0f, 2.0f);
  EXPECT_NE(digest_of<float>(values), before);
}

TEST(Digest, CombinationDependsOnOrder) {
  const std::array<Digest, 2> ab{1, 2};
  const std::array<Digest, 2> ba{2, 1};
  EXPECT_NE(combine_digests(ab), combine_digests(ba));
  EXPECT_EQ(combine_digests(ab), digest_bytes(std::as_bytes(std::span(ab))));
}

// The buffer digest's definition computed directly with libxxhash: xxh3-64 of the
// little-endian piece digests of every 4 MiB piece.
Digest direct_buffer_digest(std::span<const std::byte> bytes) {
  std::vector<std::uint64_t> pieces;
  for (std::size_t at = 0; at < bytes.size(); at += kBufferDigestPieceBytes) {
    const std::size_t n = std::min(kBufferDigestPieceBytes, bytes.size() - at);
    pieces.push_back(XXH3_64bits(bytes.data() + at, n));
  }
  return XXH3_64bits(pieces.data(), pieces.size() * sizeof(std::uint64_t));
}

std::vector<std::byte> random_bytes(std::size_t count) {
  std::mt19937_64 random(count);
  std::vector<std::byte> bytes(count);
  for (std::byte& b : bytes)
    b = static_cast<std::byte>(random());
  return bytes;
}

const std::size_t kBufferSizes[] = {0,
                                    1,
                                    1000,
                                    kBufferDigestPieceBytes - 1,
                                    kBufferDigestPieceBytes,
                                    kBufferDigestPieceBytes + 1,
                                    3 * kBufferDigestPieceBytes + 1031};

TEST(BufferDigest, MatchesItsDefinition) {
  EXPECT_EQ(kBufferDigestName, "xxh3-64-pieces-4MiB");
  EXPECT_EQ(kBufferDigestPieceBytes, std::size_t{4} << 20);
  ThreadPool pool(3);
  for (const std::size_t size : kBufferSizes) {
    const std::vector<std::byte> bytes = random_bytes(size);
    const Digest expected = direct_buffer_digest(bytes);
    EXPECT_EQ(buffer_digest(bytes), expected) << size;
    EXPECT_EQ(buffer_digest(bytes, pool), expected) << size;
  }
  // No pieces: the digest of no bytes.
  EXPECT_EQ(buffer_digest({}), digest_bytes({}));
}

TEST(BufferDigest, StreamingEqualsOneShotWhateverTheParts) {
  ThreadPool pool(2);
  for (const std::size_t size : kBufferSizes) {
    const std::vector<std::byte> bytes = random_bytes(size);
    const std::span<const std::byte> all(bytes);
    for (const std::size_t part : {std::size_t{1} << 20, kBufferDigestPieceBytes,
                                   std::size_t{16} << 20, kBufferDigestPieceBytes + 3}) {
      for (ThreadPool* used : {static_cast<ThreadPool*>(nullptr), &pool}) {
        BufferDigestStream stream(used);
        for (std::size_t at = 0; at < size; at += part)
          stream.update(all.subspan(at, std::min(part, size - at)));
        EXPECT_EQ(stream.finish(), buffer_digest(bytes)) << size << " in parts of " << part;
      }
    }
  }
}

}  // namespace
}  // namespace pulseloco
