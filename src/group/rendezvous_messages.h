// Internal: the messages of the environment rendezvous (rendezvous.h), after the connection's
// handshake (transport/tcp/handshake.h, purpose `rendezvous`). All integers little-endian.
//
//   rank -> server   registration: where the rank's data listener is
//                    u16 port, u8 host length, host
//   server -> rank   the table, once every rank has registered; then the server closes its side
//                    u8 0, 16-byte group id, u32 ranks, then per rank: u16 port, u8 host length,
//                    host
//                    or, when the rendezvous failed:
//                    u8 1 (it timed out) or 2 (it refused a member), u16 length, message
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/tcp/group_table.h>

namespace pulseloco::group {

inline constexpr std::size_t kRegistrationHeadBytes = 3;

[[nodiscard]] std::vector<std::byte> encode_registration(const transport::PeerAddress& address);

// The fixed part of a registration; the host (host_bytes long) follows it.
struct RegistrationHead {
  std::uint16_t port = 0;
  std::uint8_t host_bytes = 0;
};
[[nodiscard]] RegistrationHead decode_registration_head(
    std::span<const std::byte, kRegistrationHeadBytes> bytes);

[[nodiscard]] std::vector<std::byte> encode_table(const transport::GroupId& group_id,
                                                  const std::vector<transport::PeerAddress>& peers);
// Why a rendezvous failed.
enum class RendezvousFailure : std::uint8_t {
  timed_out = 1,       // not every rank registered in time (TimeoutError)
  refused_member = 2,  // a process of another job or world size, or a second claim of a rank
};
// The failure reply; the message is cut to what a u16 length can carry.
[[nodiscard]] std::vector<std::byte> encode_failure(RendezvousFailure why,
                                                    std::string_view message);

// A reply as the rank reads it: the table, or the server's failure message.
struct TableReply {
  bool ok = false;
  transport::GroupId group_id{};
  std::vector<transport::PeerAddress> peers;
  RendezvousFailure why = RendezvousFailure::timed_out;
  std::string failure;
};
// Throws ProtocolError (with `context`) when the reply is truncated.
[[nodiscard]] TableReply decode_table_reply(std::span<const std::byte> bytes, ErrorContext context);

}  // namespace pulseloco::group
