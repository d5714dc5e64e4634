// The server of the environment rendezvous (rendezvous.h): hosted by rank 0, or run elsewhere
// (a launcher, a test) with TransportOptions::external_rendezvous_server.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <pulseloco/transport/tcp/tcp_options.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::group {

// Serves one rendezvous of `world_size` ranks on a background thread: accepts connections,
// authenticates each (HMAC-SHA256 with link.secret, inside TLS as effective_link_security(link)
// says; the other fields of `link` are unused), records each rank's address, and once all
// ranks have registered sends them the table and finishes. Connections that fail
// authentication or claim an invalid or taken rank are refused and logged; they do not disturb
// the rendezvous. Gives up at `deadline`, telling the registered ranks which ranks are missing.
class RendezvousServer {
 public:
  RendezvousServer(const std::string& host, std::uint16_t port, int world_size,
                   const transport::TcpOptions& link, transport::Deadline deadline);
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

}  // namespace pulseloco::group
