// The TCP frame checksum: CRC-64/XZ as specified (docs/wire-format.md), the same whether the
// bytes come at once or piece by piece, and sensitive to every kind of damage a CRC guarantees.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string_view>
#include <vector>

#include "transport/tcp/checksum.h"

namespace pulseloco::transport::tcp {
namespace {

std::span<const std::byte> bytes_of(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

std::vector<std::byte> random_bytes(std::size_t size, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(size);
  for (auto& b : out)
    b = static_cast<std::byte>(rng());
  return out;
}

TEST(FrameChecksum, IsCrc64XzByItsCatalogueCheckValues) {
  // The CRC catalogue's "check" (CRC of the ASCII digits 1-9) for CRC-64/XZ.
  EXPECT_EQ(frame_checksum(bytes_of("123456789")), 0x995dc9bbdf1939faULL);
  // Initial value and final XOR cancel on empty input.
  EXPECT_EQ(frame_checksum({}), 0U);
  // A second, independent value: CRC-64/XZ of a single zero byte.
  const std::byte zero{0};
  EXPECT_EQ(frame_checksum(std::span(&zero, 1)), 0x1fada17364673f59ULL);
}

// Bit by bit from the definition: reflected polynomial 0xc96c5795d7870f42, initial value and
// final XOR all ones.
std::uint64_t crc64_xz_reference(std::span<const std::byte> bytes) {
  std::uint64_t crc = ~std::uint64_t{0};
  for (const std::byte b : bytes) {
    crc ^= std::to_integer<std::uint64_t>(b);
    for (int i = 0; i < 8; ++i)
      crc = (crc & 1U) != 0 ? (crc >> 1) ^ 0xc96c5795d7870f42ULL : crc >> 1;
  }
  return ~crc;
}

TEST(FrameChecksum, AgreesWithTheDefinitionAtEverySizeAndAlignment) {
  const auto data = random_bytes(1200, 5);
  for (std::size_t size = 0; size <= 1100; size += (size < 300 ? 1 : 97)) {
    for (std::size_t offset : {0, 1, 7}) {
      const auto piece = std::span(data).subspan(offset, size);
      ASSERT_EQ(frame_checksum(piece), crc64_xz_reference(piece))
          << "size " << size << " offset " << offset;
    }
  }
}

TEST(FrameChecksum, StreamingEqualsOneShotForAnySplit) {
  const auto data = random_bytes(300'000, 1);
  const FrameChecksum whole = frame_checksum(data);
  std::mt19937 rng(2);
  for (int trial = 0; trial < 20; ++trial) {
    FrameChecksumStream stream;
    std::size_t at = 0;
    while (at < data.size()) {
      const std::size_t piece = std::min<std::size_t>(data.size() - at, rng() % 70'000);
      stream.update(std::span(data).subspan(at, piece));
      at += piece;
    }
    EXPECT_EQ(stream.finish(), whole) << "trial " << trial;
  }
  FrameChecksumStream stream;
  stream.update(std::span(data).first(100));
  stream.reset();
  stream.update(data);
  EXPECT_EQ(stream.finish(), whole) << "reset() forgets the earlier bytes";
}

TEST(FrameChecksum, CatchesEveryFlippedBitAndEveryBurstOfUpTo64Bits) {
  const auto data = random_bytes(4096, 3);
  const FrameChecksum good = frame_checksum(data);
  for (std::size_t bit = 0; bit < data.size() * 8; ++bit) {
    auto damaged = data;
    damaged[bit / 8] ^= static_cast<std::byte>(1U << (bit % 8));
    ASSERT_NE(frame_checksum(damaged), good) << "bit " << bit;
  }
  std::mt19937_64 rng(4);
  for (int trial = 0; trial < 2000; ++trial) {
    // A burst: first and last flipped bits at most 63 apart, anything in between.
    const std::size_t length = 1 + rng() % 64;
    const std::size_t start = rng() % (data.size() * 8 - length);
    std::uint64_t pattern = rng() | 1U | (std::uint64_t{1} << (length - 1));
    if (length < 64) pattern &= (std::uint64_t{1} << length) - 1;
    auto damaged = data;
    for (std::size_t i = 0; i < length; ++i) {
      if ((pattern >> i) & 1U) {
        const std::size_t bit = start + i;
        damaged[bit / 8] ^= static_cast<std::byte>(1U << (bit % 8));
      }
    }
    ASSERT_NE(frame_checksum(damaged), good) << "burst of " << length << " at bit " << start;
  }
}

}  // namespace
}  // namespace pulseloco::transport::tcp
