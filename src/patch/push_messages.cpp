#include <pulseloco/patch/push_messages.h>

#include <fmt/format.h>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::patch {
namespace {

constexpr std::uint32_t kMagic = 0x55504C50;  // "PLPU" little-endian
constexpr std::uint8_t kHoldsVersion = 1;

}  // namespace

std::string_view push_type_name(PushType type) noexcept {
  switch (type) {
    case PushType::subscribe:
      return "subscribe";
    case PushType::anchor:
      return "anchor";
    case PushType::delta:
      return "delta";
    case PushType::compact:
      return "compact";
  }
  return "unknown";
}

std::array<std::byte, kPushHeaderBytes> encode_push_header(const PushHeader& header) {
  std::array<std::byte, kPushHeaderBytes> bytes{};
  ByteWriter(bytes)
      .put(kMagic)
      .put(kPushFormatVersion)
      .put(static_cast<std::uint8_t>(header.type))
      .put(header.holds_version ? kHoldsVersion : std::uint8_t{0})
      .zeros(1)
      .put(header.version)
      .put(header.digest)
      .put(header.payload_bytes)
      .put(header.payload_checksum);
  return bytes;
}

PushHeader decode_push_header(std::span<const std::byte, kPushHeaderBytes> bytes) {
  ByteReader in{std::span<const std::byte>(bytes)};
  if (in.get<std::uint32_t>("magic") != kMagic) in.fail_at("not a patch push message (magic)", 0);
  if (const auto format = in.get<std::uint8_t>("format"); format != kPushFormatVersion)
    in.fail_at(fmt::format("format version {} (this build speaks {})", format, kPushFormatVersion),
               4);
  const auto type = in.get<std::uint8_t>("type");
  if (type < static_cast<std::uint8_t>(PushType::subscribe) ||
      type > static_cast<std::uint8_t>(PushType::compact))
    in.fail_at(fmt::format("unknown message type {}", type), 5);
  PushHeader header{.type = static_cast<PushType>(type)};
  const auto flags = in.get<std::uint8_t>("flags");
  if ((flags & ~kHoldsVersion) != 0 || (flags != 0 && header.type != PushType::subscribe))
    in.fail_at(fmt::format("flags {:#x}", flags), 6);
  if (in.get<std::uint8_t>("reserved") != 0) in.fail_at("a reserved byte is not 0", 7);
  header.holds_version = flags == kHoldsVersion;
  header.version = in.get<std::uint64_t>("version");
  header.digest = in.get<std::uint64_t>("digest");
  header.payload_bytes = in.get<std::uint64_t>("payload bytes");
  header.payload_checksum = in.get<std::uint64_t>("payload checksum");
  if (header.type == PushType::subscribe && header.payload_bytes != 0)
    in.fail_at("a subscribe message with a payload", 24);
  return header;
}

}  // namespace pulseloco::patch
