// The messages of the patch push protocol (push_server.h, subscriber.h;
// docs/wire-format.md, "Patch push messages").
//
// One TCP connection per subscriber. It starts with the HMAC-SHA256 challenge-response of
// transport/tcp/handshake.h (purpose `patch_push`, the job id of the secret and run id; inside
// TLS when the links are encrypted). Then every message is a 40-byte header and a payload:
//
//   offset  size  field
//        0     4  magic "PLPU"
//        4     1  format version (1)
//        5     1  type: 1 subscribe, 2 anchor, 3 delta (TRL safetensors), 4 compact patch
//        6     1  flags: bit 0 = the subscriber holds a version (subscribe only); others 0
//        7     1  reserved, 0
//        8     8  version: the one the subscriber holds (subscribe) or the one the payload
//                 brings its receiver to
//       16     8  digest: of that version's bf16 state (bf16_state.h)
//       24     8  payload bytes (0 for subscribe)
//       32     8  xxh3-64 of the payload
//
// The subscriber sends one subscribe; the server then sends, in order, the steps from the held
// version (or an anchor) to the newest version, and every later version as it is published.
// A payload is a publishing directory's file, byte for byte (the manifest's checksum is the
// header's). All fields are little-endian.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include <pulseloco/base/digest.h>

namespace pulseloco::patch {

inline constexpr std::size_t kPushHeaderBytes = 40;
inline constexpr std::uint8_t kPushFormatVersion = 1;

enum class PushType : std::uint8_t { subscribe = 1, anchor = 2, delta = 3, compact = 4 };
[[nodiscard]] std::string_view push_type_name(PushType type) noexcept;

struct PushHeader {
  PushType type = PushType::subscribe;
  bool holds_version = false;  // subscribe: whether `version` and `digest` mean anything
  std::uint64_t version = 0;
  Digest digest = 0;
  std::uint64_t payload_bytes = 0;
  Digest payload_checksum = 0;
};

[[nodiscard]] std::array<std::byte, kPushHeaderBytes> encode_push_header(const PushHeader& header);
// ProtocolError naming the field for a wrong magic, format, type, flags or reserved byte, or a
// subscribe with a payload.
[[nodiscard]] PushHeader decode_push_header(std::span<const std::byte, kPushHeaderBytes> bytes);

}  // namespace pulseloco::patch
