// Rendezvous: how the ranks of a TCP group learn each other's listening addresses.
//
//  - environment (torchrun style): a RendezvousServer at master_addr:master_port (hosted by
//    rank 0, or run elsewhere with external_rendezvous_server) collects every rank's address
//    and sends the full table to all of them. Every connection to it is authenticated with the
//    shared secret, so a stranger cannot register or read the table.
//  - peer_list: the table is given ("host:port" per rank).
//  - mpi: MPI_Allgather over MPI_COMM_WORLD.
// Each method also yields a 16-byte group id that every data connection presents, so that a
// process of another group (an earlier run, say) cannot join by mistake.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <pulseloco/transport/factory.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

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

// Serves one rendezvous of `world_size` ranks on a background thread: accepts connections,
// authenticates each (HMAC-SHA256 with `secret`), records each rank's address, and once all
// ranks have registered sends them the table and finishes. Connections that fail
// authentication or claim an invalid or taken rank are refused and logged; they do not disturb
// the rendezvous. Gives up at `deadline`, telling the registered ranks which ranks are missing.
class RendezvousServer {
 public:
  RendezvousServer(const std::string& host, std::uint16_t port, int world_size, std::string secret,
                   Deadline deadline);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  // The port it listens on (useful when constructed with port 0).
  [[nodiscard]] std::uint16_t port() const noexcept;
  // Blocks until the rendezvous is complete (every rank received the table) or has failed;
  // throws the failure (TimeoutError naming the missing ranks).
  void wait();
  // Connections refused so far (failed authentication, invalid or duplicate rank).
  [[nodiscard]] int refused_connections() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Environment rendezvous client: registers (rank, advertised address) with the server at
// master_addr:master_port (retrying until the connect deadline) and returns the group table.
// `listen_port` is the port of this rank's data listener; the advertised host is
// options.advertise_addr, else options.socket_ifname's address, else the local address of the
// connection to the server. Hosts the server itself on rank 0 unless
// options.external_rendezvous_server.
[[nodiscard]] GroupTable environment_rendezvous(const TransportOptions& options,
                                                std::uint16_t listen_port);

// peer_list rendezvous: the table is options.peers; the group id is derived from it.
[[nodiscard]] GroupTable peer_list_rendezvous(const TransportOptions& options);

// MPI rendezvous (MPI_COMM_WORLD); initialises MPI when needed. Throws InvalidArgument when MPI
// is not built in.
[[nodiscard]] GroupTable mpi_rendezvous(const TransportOptions& options, std::uint16_t listen_port);

// The method `automatic` resolves to for these options in this process.
[[nodiscard]] RendezvousMethod resolve_rendezvous(const TransportOptions& options);

// IPv4 address of a network interface ("eth0"); throws InvalidArgument when it has none.
[[nodiscard]] std::string interface_address(const std::string& ifname);

}  // namespace pulseloco::transport
