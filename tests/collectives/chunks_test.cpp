// The pipeline's chunking, shared by the collectives (message bytes, segment elements):
// consecutive pieces that cover the range exactly, every one full but the last.
#include <pulseloco/collectives/detail/chunks.h>

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace pulseloco::collectives::detail {
namespace {

using Pieces = std::vector<std::pair<std::uint64_t, std::uint64_t>>;

Pieces chunks_of(std::uint64_t begin, std::uint64_t end, std::uint64_t chunk) {
  Pieces pieces;
  for_each_chunk(begin, end, chunk,
                 [&](std::uint64_t from, std::uint64_t to) { pieces.emplace_back(from, to); });
  return pieces;
}

TEST(Chunks, CoverTheRangeInOrderWithOnlyTheLastShort) {
  EXPECT_EQ(chunks_of(0, 10, 4), (Pieces{{0, 4}, {4, 8}, {8, 10}}));
  EXPECT_EQ(chunks_of(0, 8, 4), (Pieces{{0, 4}, {4, 8}}));
  EXPECT_EQ(chunks_of(5, 12, 3), (Pieces{{5, 8}, {8, 11}, {11, 12}}));
  EXPECT_EQ(chunks_of(7, 9, 100), (Pieces{{7, 9}}));
  EXPECT_EQ(chunks_of(3, 6, 1), (Pieces{{3, 4}, {4, 5}, {5, 6}}));
}

TEST(Chunks, AMessagesChunksKnowWhichIsLast) {
  const std::vector<MessageChunk> chunks = message_chunks(10, 4);
  ASSERT_EQ(chunks.size(), 3u);
  EXPECT_EQ((std::pair{chunks[0].offset, chunks[0].bytes}),
            (std::pair<std::size_t, std::size_t>{0, 4}));
  EXPECT_EQ((std::pair{chunks[2].offset, chunks[2].bytes}),
            (std::pair<std::size_t, std::size_t>{8, 2}));
  EXPECT_FALSE(chunks[1].last_of(10));
  EXPECT_TRUE(chunks[2].last_of(10));
  EXPECT_TRUE(message_chunks(0, 4).empty());
}

TEST(Chunks, AnEmptyRangeHasNone) {
  EXPECT_TRUE(chunks_of(0, 0, 4).empty());
  EXPECT_TRUE(chunks_of(9, 9, 1).empty());
}

}  // namespace
}  // namespace pulseloco::collectives::detail
