#include "base/digest.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace pulseloco
