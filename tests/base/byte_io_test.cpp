#include <pulseloco/base/byte_io.h>

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <vector>

namespace pulseloco {
namespace {

enum class Colour : std::uint8_t { red = 1, blue = 2 };

TEST(ByteIo, FieldsRoundTripLittleEndianInOrder) {
  std::array<std::byte, 20> out{};
  ByteWriter writer(out);
  writer.put<std::uint32_t>(0x04030201).put(Colour::blue).zeros(3).put(-1.5f).put(
      std::uint64_t{0x1122334455667788});
  EXPECT_EQ(writer.position(), out.size());
  EXPECT_EQ(out[0], std::byte{0x01});  // least significant byte first
  EXPECT_EQ(out[3], std::byte{0x04});
  EXPECT_EQ(out[5], std::byte{0});

  ByteReader reader(std::span<const std::byte>(out), {.rank = 1});
  EXPECT_EQ(reader.get<std::uint32_t>("a"), 0x04030201u);
  EXPECT_EQ(reader.get<Colour>("colour"), Colour::blue);
  reader.skip(3, "padding");
  EXPECT_EQ(reader.get<float>("f"), -1.5f);
  EXPECT_EQ(reader.get<std::uint64_t>("b"), 0x1122334455667788u);
  EXPECT_EQ(reader.remaining(), 0u);
}

TEST(ByteIo, AppendGrowsAMessage) {
  std::vector<std::byte> out;
  append_le<std::uint16_t>(out, 0xBEEF);
  append_le<std::int8_t>(out, -2);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(load_le<std::uint16_t>(out.data()), 0xBEEF);
  EXPECT_EQ(load_le<std::int8_t>(out.data() + 2), -2);
}

TEST(ByteIo, ATruncatedMessageNamesTheFieldTheOffsetAndTheContext) {
  const std::array<std::byte, 6> bytes{};
  ByteReader reader(std::span<const std::byte>(bytes), {.rank = 2, .peer = 5}, 100);
  (void)reader.get<std::uint32_t>("magic");
  try {
    (void)reader.get<std::uint32_t>("world size");
    FAIL() << "read past the end";
  } catch (const ProtocolError& error) {
    EXPECT_EQ(error.message(), "truncated: world size needs 4 bytes, 2 left");
    EXPECT_EQ(error.context().byte_offset, 104u);
    EXPECT_EQ(error.context().rank, 2);
    EXPECT_EQ(error.context().peer, 5);
  }
}

TEST(ByteIo, TakeAndGetBytesCopyExactlyWhatIsAsked) {
  const std::array<std::uint8_t, 5> bytes{1, 2, 3, 4, 5};
  ByteReader reader{std::span<const std::uint8_t>(bytes)};
  std::array<std::uint8_t, 2> first{};
  reader.get_bytes(first, "first");
  EXPECT_EQ(first[1], 2);
  const auto rest = reader.take(3, "rest");
  EXPECT_EQ(rest.size(), 3u);
  EXPECT_EQ(rest[2], std::byte{5});
  EXPECT_THROW((void)reader.take(1, "more"), ProtocolError);
}

TEST(ByteIo, FailReportsTheCurrentOffset) {
  const std::array<std::byte, 4> bytes{};
  ByteReader reader(std::span<const std::byte>(bytes), {}, 10);
  (void)reader.get<std::uint16_t>("x");
  try {
    reader.fail("bad value");
  } catch (const ProtocolError& error) {
    EXPECT_EQ(error.context().byte_offset, 12u);
  }
}

}  // namespace
}  // namespace pulseloco
