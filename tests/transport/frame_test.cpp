// The TCP transport's frame header and chunk plans, and peer addresses.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/tcp/frame.h>
#include <pulseloco/transport/tcp/group_table.h>

namespace pulseloco::transport {
namespace {

TEST(PeerAddress, ParsesHostsAndPorts) {
  EXPECT_EQ(parse_peer_address("node-7:29500", "x"), (PeerAddress{"node-7", 29500}));
  EXPECT_EQ(parse_peer_address("10.1.2.3:1", "x"), (PeerAddress{"10.1.2.3", 1}));
  EXPECT_EQ(parse_peer_address("[fe80::1]:443", "x"), (PeerAddress{"fe80::1", 443}));
  EXPECT_EQ(to_string(PeerAddress{"fe80::1", 443}), "[fe80::1]:443");
  for (const char* bad : {"nohost", ":80", "host:", "host:0", "host:65536", "host:8x", "[::1]80"})
    EXPECT_THROW((void)parse_peer_address(bad, "PULSELOCO_PEERS[0]"), InvalidArgument) << bad;
}

TEST(Frame, HeadersRoundTrip) {
  tcp::FrameHeader header;
  header.kind = tcp::FrameKind::data;
  header.has_payload_checksum = true;
  header.tag = 0x8000'0000'1234'5678ULL;
  header.sequence = 42;
  header.message_bytes = 10'000'000;
  header.chunk_offset = 4'194'304;
  header.chunk_bytes = 4'194'304;
  header.payload_checksum = 0xDEADBEEFCAFEF00DULL;
  const auto encoded = tcp::encode_header(header);
  std::string problem;
  const auto decoded = tcp::decode_header(encoded, problem);
  ASSERT_TRUE(decoded) << problem;
  EXPECT_EQ(decoded->tag, header.tag);
  EXPECT_EQ(decoded->sequence, header.sequence);
  EXPECT_EQ(decoded->message_bytes, header.message_bytes);
  EXPECT_EQ(decoded->chunk_offset, header.chunk_offset);
  EXPECT_EQ(decoded->chunk_bytes, header.chunk_bytes);
  EXPECT_EQ(decoded->payload_checksum, header.payload_checksum);
  EXPECT_TRUE(decoded->has_payload_checksum);
}

TEST(Frame, EveryFlippedHeaderBitIsDetected) {
  tcp::FrameHeader header;
  header.tag = 7;
  header.message_bytes = 100;
  header.chunk_bytes = 100;
  const auto encoded = tcp::encode_header(header);
  for (std::size_t bit = 0; bit < tcp::kFrameHeaderBytes * 8; ++bit) {
    auto damaged = encoded;
    damaged[bit / 8] ^= static_cast<std::byte>(1U << (bit % 8));
    std::string problem;
    EXPECT_FALSE(tcp::decode_header(damaged, problem)) << "bit " << bit;
    EXPECT_FALSE(problem.empty());
  }
}

TEST(Frame, ChunksOutsideTheirMessageAreRejected) {
  tcp::FrameHeader header;
  header.message_bytes = 100;
  header.chunk_offset = 90;
  header.chunk_bytes = 11;  // one byte past the end
  std::string problem;
  EXPECT_FALSE(tcp::decode_header(tcp::encode_header(header), problem));
  EXPECT_NE(problem.find("outside"), std::string::npos) << problem;
  header.kind = tcp::FrameKind::abort;
  header.message_bytes = header.chunk_bytes = tcp::kMaxAbortReasonBytes + 1;
  header.chunk_offset = 0;
  EXPECT_FALSE(tcp::decode_header(tcp::encode_header(header), problem));
}

TEST(Frame, ChunkPlansCoverTheMessageAndUseEveryConnection) {
  constexpr std::uint64_t kThreshold = 1 << 20;
  constexpr std::uint64_t kChunk = 4 << 20;
  EXPECT_EQ(tcp::plan_chunks(0, 4, kThreshold, kChunk).count, 1U);
  EXPECT_EQ(tcp::plan_chunks(kThreshold, 4, kThreshold, kChunk).count, 1U);
  for (const std::uint64_t bytes : {kThreshold + 1, std::uint64_t{3'000'017},
                                    std::uint64_t{64} << 20, (std::uint64_t{256} << 20) + 5}) {
    for (int connections : {1, 2, 4, 8}) {
      const auto plan = tcp::plan_chunks(bytes, connections, kThreshold, kChunk);
      EXPECT_GE(plan.chunk_bytes * plan.count, bytes);
      EXPECT_LT(plan.chunk_bytes * (plan.count - 1), bytes);
      EXPECT_GE(plan.count, static_cast<std::uint64_t>(connections));
      EXPECT_LE(plan.chunk_bytes, std::max<std::uint64_t>(kChunk, 4096));
    }
  }
}

}  // namespace
}  // namespace pulseloco::transport
