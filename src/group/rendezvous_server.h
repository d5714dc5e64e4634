// The server of the environment rendezvous (rendezvous.h): hosted by rank 0, or run elsewhere
// (a launcher, a test) with TransportOptions::external_rendezvous_server.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include <pulseloco/transport/tcp/tcp_options.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::group {

// How long a failed rendezvous server keeps answering late ranks with its failure: longer than
// the pause between a client's connection attempts (at most 1 s), so that a rank already
// retrying is told, and short enough that rank 0, which hosts the server and stays for it,
// fails soon after.
inline constexpr std::chrono::milliseconds kFailedRendezvousLinger{5000};

// Serves one rendezvous of `world_size` ranks on a background thread: accepts connections,
// authenticates each (HMAC-SHA256 with link.secret, inside TLS as effective_link_security(link)
// says), records each rank's address, and once all ranks have registered sends them the table
// and finishes. A connection that fails authentication is refused and logged, and does not
// disturb the rendezvous (anyone who reaches the port could otherwise end it); the timeout error
// names it. An authenticated process whose world size or job differs, or that claims a rank
// already registered, is refused with the reason, and the rendezvous fails at once with it
// (ProtocolError to every registered rank and from wait()): two jobs sharing a port and secret
// never train together. `run_id` is the job's run id (PULSELOCO_RUN_ID; transport/tcp/job_id.h):
// a rank of another job is refused; empty: the server generates the job's id and carries it to
// the ranks in the table. Gives up at `deadline`, telling the registered ranks which ranks are
// missing. Refuses to listen beyond loopback without a secret or certificates unless
// link.allow_insecure (InvalidArgument).
//
// A rendezvous that failed keeps listening for `linger` (or until every rank of the job has been
// told, whichever comes first), so that a rank arriving after the failure is told its kind and
// reason at once, as the registered ranks were, instead of meeting a closed port until its own
// timeout; a process of another job is refused with its own mismatch then as before.
class RendezvousServer {
 public:
  RendezvousServer(const std::string& host, std::uint16_t port, int world_size,
                   const transport::TcpOptions& link, transport::Deadline deadline,
                   const std::string& run_id = {},
                   std::chrono::milliseconds linger = kFailedRendezvousLinger);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  // The port it listens on (useful when constructed with port 0).
  [[nodiscard]] std::uint16_t port() const noexcept;
  // Blocks until the rendezvous is complete (every rank received the table) or has failed;
  // throws the failure (TimeoutError naming the missing ranks, ProtocolError naming a refused
  // member).
  void wait();
  // Blocks until the server no longer listens: once the table is sent; after a failure, once
  // every rank has been told or the linger has passed. The destructor does not wait for it.
  void wait_closed();
  // The failure, once the rendezvous has failed; null while it runs or after it completed.
  [[nodiscard]] std::exception_ptr failure() const;
  // Connections refused so far (failed authentication, invalid or duplicate rank).
  [[nodiscard]] int refused_connections() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pulseloco::group
