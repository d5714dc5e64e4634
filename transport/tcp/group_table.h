// What a TCP transport needs to know of its group before it connects: this rank, every rank's
// data listener and the group id that every connection of the group presents (so that a process
// of another group, an earlier run say, cannot join by mistake). The group layer finds the
// table (a rendezvous, a peer list, the elastic coordinator); the transport only uses it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pulseloco::transport {

// The longest host name or address a peer address may carry.
inline constexpr std::size_t kMaxHostBytes = 255;

struct PeerAddress {
  std::string host;
  std::uint16_t port = 0;

  friend bool operator==(const PeerAddress&, const PeerAddress&) = default;
};

// "host:port" or "[v6]:port"; throws InvalidArgument naming `what` (e.g. "PULSELOCO_PEERS[2]").
[[nodiscard]] PeerAddress parse_peer_address(std::string_view text, std::string_view what);
[[nodiscard]] std::string to_string(const PeerAddress& address);

using GroupId = std::array<std::uint8_t, 16>;

struct GroupTable {
  int rank = 0;
  GroupId group_id{};
  std::vector<PeerAddress> peers;  // every rank's data listener, in rank order

  [[nodiscard]] int size() const noexcept { return static_cast<int>(peers.size()); }
};

}  // namespace pulseloco::transport
