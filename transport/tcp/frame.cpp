#include <pulseloco/transport/tcp/frame.h>

#include <fmt/format.h>

#include <algorithm>

#include <pulseloco/base/digest.h>

namespace pulseloco::transport::tcp {
namespace {

constexpr std::size_t kChecksummedBytes = kFrameHeaderBytes - 8;
constexpr std::uint8_t kFlagPayloadChecksum = 0x01;

void store_u16(std::byte* out, std::uint16_t value) noexcept {
  for (int i = 0; i < 2; ++i)
    out[i] = static_cast<std::byte>(value >> (8 * i));
}
void store_u32(std::byte* out, std::uint32_t value) noexcept {
  for (int i = 0; i < 4; ++i)
    out[i] = static_cast<std::byte>(value >> (8 * i));
}
void store_u64(std::byte* out, std::uint64_t value) noexcept {
  for (int i = 0; i < 8; ++i)
    out[i] = static_cast<std::byte>(value >> (8 * i));
}
std::uint64_t load_u64(const std::byte* in) noexcept {
  std::uint64_t value = 0;
  for (int i = 7; i >= 0; --i)
    value = (value << 8) | std::to_integer<std::uint64_t>(in[i]);
  return value;
}
std::uint32_t load_u32(const std::byte* in) noexcept {
  std::uint32_t value = 0;
  for (int i = 3; i >= 0; --i)
    value = (value << 8) | std::to_integer<std::uint32_t>(in[i]);
  return value;
}
std::uint16_t load_u16(const std::byte* in) noexcept {
  return static_cast<std::uint16_t>(std::to_integer<std::uint16_t>(in[0]) |
                                    (std::to_integer<std::uint16_t>(in[1]) << 8));
}

}  // namespace

EncodedHeader encode_header(const FrameHeader& header) noexcept {
  EncodedHeader out{};
  store_u32(out.data(), kFrameMagic);
  out[4] = static_cast<std::byte>(header.kind);
  out[5] = static_cast<std::byte>(header.has_payload_checksum ? kFlagPayloadChecksum : 0);
  store_u16(out.data() + 6, 0);
  store_u64(out.data() + 8, header.tag);
  store_u64(out.data() + 16, header.sequence);
  store_u64(out.data() + 24, header.message_bytes);
  store_u64(out.data() + 32, header.chunk_offset);
  store_u64(out.data() + 40, header.chunk_bytes);
  store_u64(out.data() + 48, header.has_payload_checksum ? header.payload_checksum : 0);
  store_u64(out.data() + 56, digest_bytes(std::span(out).first(kChecksummedBytes)));
  return out;
}

std::optional<FrameHeader> decode_header(std::span<const std::byte, kFrameHeaderBytes> bytes,
                                         std::string& problem) {
  if (const auto magic = load_u32(bytes.data()); magic != kFrameMagic) {
    problem = fmt::format("bad frame magic 0x{:08x} (expected 0x{:08x})", magic, kFrameMagic);
    return std::nullopt;
  }
  const auto stored = load_u64(bytes.data() + 56);
  if (const auto computed = digest_bytes(bytes.first(kChecksummedBytes)); stored != computed) {
    problem = fmt::format("frame header checksum mismatch (stored {:016x}, computed {:016x})",
                          stored, computed);
    return std::nullopt;
  }
  FrameHeader header;
  const auto kind = std::to_integer<std::uint8_t>(bytes[4]);
  if (kind < 1 || kind > 3) {
    problem = fmt::format("unknown frame kind {}", kind);
    return std::nullopt;
  }
  header.kind = static_cast<FrameKind>(kind);
  const auto flags = std::to_integer<std::uint8_t>(bytes[5]);
  if ((flags & ~kFlagPayloadChecksum) != 0 || load_u16(bytes.data() + 6) != 0) {
    problem = fmt::format("unknown frame flags 0x{:02x} or reserved bits set", flags);
    return std::nullopt;
  }
  header.has_payload_checksum = (flags & kFlagPayloadChecksum) != 0;
  header.tag = load_u64(bytes.data() + 8);
  header.sequence = load_u64(bytes.data() + 16);
  header.message_bytes = load_u64(bytes.data() + 24);
  header.chunk_offset = load_u64(bytes.data() + 32);
  header.chunk_bytes = load_u64(bytes.data() + 40);
  header.payload_checksum = load_u64(bytes.data() + 48);
  if (header.message_bytes > kMaxMessageBytes || header.chunk_offset > header.message_bytes ||
      header.chunk_bytes > header.message_bytes - header.chunk_offset) {
    problem = fmt::format("frame chunk [{}, +{}) lies outside its {}-byte message",
                          header.chunk_offset, header.chunk_bytes, header.message_bytes);
    return std::nullopt;
  }
  if (header.kind == FrameKind::goodbye &&
      (header.message_bytes != 0 || header.tag != 0 || header.sequence != 0)) {
    problem = "goodbye frame with a payload";
    return std::nullopt;
  }
  if (header.kind == FrameKind::abort &&
      (header.message_bytes > kMaxAbortReasonBytes || header.chunk_offset != 0 ||
       header.chunk_bytes != header.message_bytes)) {
    problem = fmt::format("abort frame with a {}-byte reason", header.message_bytes);
    return std::nullopt;
  }
  return header;
}

ChunkPlan plan_chunks(std::uint64_t message_bytes, int connections, std::uint64_t stripe_threshold,
                      std::uint64_t stripe_chunk) noexcept {
  if (message_bytes <= stripe_threshold || message_bytes == 0) return {message_bytes, 1};
  constexpr std::uint64_t kAlign = 4096;
  const auto lanes = static_cast<std::uint64_t>(std::max(connections, 1));
  std::uint64_t chunk = std::min(stripe_chunk, (message_bytes + lanes - 1) / lanes);
  chunk = std::max<std::uint64_t>(kAlign, (chunk + kAlign - 1) / kAlign * kAlign);
  return {chunk, (message_bytes + chunk - 1) / chunk};
}

}  // namespace pulseloco::transport::tcp
