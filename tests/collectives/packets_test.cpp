// The collectives' wire packets (packets.h): the exact bytes of a header and a notice, which
// ranks of different builds must agree on, and what a receiver rejects.
#include <pulseloco/collectives/detail/packets.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

namespace pulseloco::collectives::detail {
namespace {

template <std::size_t N>
std::vector<std::uint8_t> octets(const std::array<std::byte, N>& bytes) {
  std::vector<std::uint8_t> out;
  for (const std::byte b : bytes)
    out.push_back(static_cast<std::uint8_t>(b));
  return out;
}

template <std::size_t N>
std::array<std::byte, N> bytes_of(const std::vector<std::uint8_t>& octets) {
  std::array<std::byte, N> out{};
  for (std::size_t i = 0; i < N; ++i)
    out[i] = static_cast<std::byte>(octets[i]);
  return out;
}

const Header kHeader{.op = Op::allreduce_sum,
                     .algorithm = CollectiveAlgorithm::direct,
                     .root = 3,
                     .sequence = 0x0102030405060708,
                     .chunk_bytes = 0x100000,
                     .value = 1000};
const std::vector<std::uint8_t> kHeaderOctets = {
    0x50, 0x4C, 0x43, 0x48,                          // "PLCH"
    0x01, 0x02, 0x02, 0x00,                          // version, operation, algorithm, padding
    0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // root, padding
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // sequence
    0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00,  // chunk size
    0xE8, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // value
};

const Notice kNotice{.type = NoticeType::culprit,
                     .kind = ErrorKind::protocol,
                     .reporter = 2,
                     .subject = 1,
                     .sequence = 7};
const std::vector<std::uint8_t> kNoticeOctets = {
    0x50, 0x4C, 0x43, 0x4E,                          // "PLCN"
    0x01, 0x03, 0x04, 0x00,                          // version, type, error kind, padding
    0x02, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // reporter, subject
    0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // sequence
};

TEST(HeaderPacket, HasItsFixedLayout) {
  EXPECT_EQ(octets(kHeader.encode()), kHeaderOctets);
}

TEST(HeaderPacket, DecodesWhatWasEncoded) {
  const Header header = Header::decode(kHeader.encode(), 0, 1);
  EXPECT_EQ(header.op, kHeader.op);
  EXPECT_EQ(header.algorithm, kHeader.algorithm);
  EXPECT_EQ(header.root, kHeader.root);
  EXPECT_EQ(header.sequence, kHeader.sequence);
  EXPECT_EQ(header.chunk_bytes, kHeader.chunk_bytes);
  EXPECT_EQ(header.value, kHeader.value);
}

TEST(HeaderPacket, ARejectedHeaderIsAProtocolErrorNamingTheSender) {
  for (const std::size_t at : {std::size_t{0}, std::size_t{4}, std::size_t{5}, std::size_t{6}}) {
    auto octets = kHeaderOctets;
    octets[at] = 0x7F;  // bad magic, version, operation, algorithm
    try {
      (void)Header::decode(bytes_of<Header::kBytes>(octets), 0, 3);
      ADD_FAILURE() << "byte " << at << " accepted";
    } catch (const ProtocolError& error) {
      EXPECT_EQ(error.context().peer, 3);
      EXPECT_EQ(error.context().rank, 0);
    }
  }
}

TEST(NoticePacket, HasItsFixedLayout) {
  EXPECT_EQ(octets(kNotice.encode()), kNoticeOctets);
}

TEST(NoticePacket, DecodesWhatWasEncoded) {
  const Notice notice = Notice::decode(kNotice.encode(), 0, 2, 4, 7);
  EXPECT_EQ(notice.type, kNotice.type);
  EXPECT_EQ(notice.kind, kNotice.kind);
  EXPECT_EQ(notice.reporter, 2);
  EXPECT_EQ(notice.subject, 1);
  EXPECT_EQ(notice.sequence, 7U);
  EXPECT_TRUE(notice.terminal());
  EXPECT_FALSE(Notice{.type = NoticeType::suspect}.terminal());
  EXPECT_TRUE(Notice{.type = NoticeType::aborted}.terminal());
}

TEST(NoticePacket, OnlyAValidNoticeFromItsSenderForThisCallIsAccepted) {
  const auto bytes = kNotice.encode();
  // Another sender, another call, a subject outside the group.
  EXPECT_THROW((void)Notice::decode(bytes, 0, 3, 4, 7), ProtocolError);
  EXPECT_THROW((void)Notice::decode(bytes, 0, 2, 4, 8), ProtocolError);
  EXPECT_THROW((void)Notice::decode(bytes, 0, 2, 1, 7), ProtocolError);
  for (const std::size_t at : {std::size_t{0}, std::size_t{4}, std::size_t{5}, std::size_t{6}}) {
    auto octets = kNoticeOctets;
    octets[at] = 0x7F;  // bad magic, version, type, error kind
    EXPECT_THROW((void)Notice::decode(bytes_of<Notice::kBytes>(octets), 0, 2, 4, 7), ProtocolError)
        << "byte " << at;
  }
}

TEST(TagLayout, CarriesTheBaseTagTheCallNumberAndThePhase) {
  EXPECT_EQ(make_tag(5, 3, Phase::notice),
            (std::uint64_t{1} << 63) | (std::uint64_t{5} << 40) | (3U << 8) | 2U);
  // The call number wraps at 32 bits.
  EXPECT_EQ(make_tag(0, (std::uint64_t{1} << 32) + 1, Phase::header),
            make_tag(0, 1, Phase::header));
  EXPECT_EQ(make_tag(kTagLimit - 1, 0, Phase::diagnosis) >> 40,
            (std::uint64_t{1} << 23) | (kTagLimit - 1));
}

}  // namespace
}  // namespace pulseloco::collectives::detail
