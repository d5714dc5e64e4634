// Internal: the one way pulseloco listens for TCP connections: the TCP transport's data listener,
// the rendezvous server (group/) and the elastic coordinator (elastic/) all accept through a
// Listener, under one policy (docs/operations.md, "Connections that have not authenticated"):
//  - every accepted connection must finish its handshake (TLS where it is on, authentication, and
//    whatever its server reads before it trusts the peer) within kHandshakeTimeout, or its
//    socket is closed;
//  - the connections in their handshake, in the whole process and over all listeners, hold at
//    most a quarter of the descriptor limit (RLIMIT_NOFILE), and never more than
//    kMaxPendingConnections; when every place is taken, the oldest of them is dropped to make
//    room, so that a flood of idle connections cannot lock a real peer out;
//  - an accepted connection whose descriptor leaves fewer than an eighth of the limit free is
//    closed at once: descriptors stay in reserve for files (a checkpoint) and real peers;
//  - a failed accept (EMFILE, ENFILE, ...) pauses accepting, the pause doubling from
//    kFirstAcceptPause up to kMaxAcceptPause while accepts keep failing;
//  - warnings about accepts and about connections refused or dropped go through a LogThrottle.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>

#include <pulseloco/transport/tcp/asio_util.h>

namespace pulseloco::transport::tcp {

inline constexpr std::chrono::seconds kHandshakeTimeout{5};
inline constexpr std::size_t kMaxPendingConnections = 1024;
inline constexpr std::chrono::milliseconds kFirstAcceptPause{10};
inline constexpr std::chrono::milliseconds kMaxAcceptPause{1000};

// What the descriptor limit allows strangers, computed from RLIMIT_NOFILE's soft limit.
struct DescriptorBudget {
  std::size_t limit = 0;        // the soft limit
  std::size_t max_pending = 0;  // limit / 4, at least 1, at most kMaxPendingConnections
  std::size_t reserve = 0;      // limit / 8: descriptors a listener leaves free
};
[[nodiscard]] DescriptorBudget descriptor_budget();

// Connections in their handshake (and accepts under way) in this process, over all listeners.
[[nodiscard]] std::size_t pending_connections();

// A connection a Listener accepted, while its handshake runs: the handshake deadline closes its
// socket when it passes first, and it holds one of the process's places for pending
// connections (the oldest is dropped when a new connection needs one). handshake_done() (or
// destruction) ends both. Lives on the socket's executor.
class PendingConnection {
 public:
  struct Shared;
  struct Place;
  PendingConnection(std::shared_ptr<Shared> listener, std::shared_ptr<Socket> socket,
                    std::shared_ptr<Place> place);
  ~PendingConnection();
  PendingConnection(PendingConnection&&) noexcept;
  PendingConnection& operator=(PendingConnection&&) = delete;
  PendingConnection(const PendingConnection&) = delete;
  PendingConnection& operator=(const PendingConnection&) = delete;

  [[nodiscard]] const std::shared_ptr<Socket>& socket() const noexcept { return socket_; }
  // The peer passed its handshake in time: the deadline no longer applies.
  void handshake_done() noexcept;
  // Whether the handshake deadline closed the socket.
  [[nodiscard]] bool timed_out() const noexcept;
  // Whether the listener closed the socket to make room for a newer connection.
  [[nodiscard]] bool dropped_for_room() const noexcept;
  // Why the handshake of this connection failed with `error`: the deadline, the listener
  // dropping it for room, or else the error itself.
  [[nodiscard]] std::string failure(const std::exception& error) const;
  // Logs a warning about this connection (a refusal, a failed handshake) through the
  // listener's LogThrottle.
  void warn(const std::string& line) const;

 private:
  std::shared_ptr<Shared> listener_;
  std::shared_ptr<Socket> socket_;
  std::shared_ptr<Place> place_;  // null once the handshake is done
  std::unique_ptr<Watchdog> deadline_;
  bool timed_out_ = false;  // what the deadline did, once handshake_done() removed it
  bool dropped_ = false;    // whether it was dropped for room, once handshake_done() ran
};

class Listener {
 public:
  // Serves one accepted connection (runs on the connection's own strand).
  using Serve = std::function<asio::awaitable<void>(PendingConnection)>;

  // Binds host:port ("" = all interfaces, port 0 = any free port) with the socket buffer sizes
  // of `buffers` (accepted sockets inherit them), and listens. The accept loop will run on
  // `executor`; each accepted socket gets a strand of its own on `io`. `owner` names the server
  // in log lines and errors ("tcp transport"). Throws IoError when the address cannot be bound.
  Listener(asio::io_context& io, asio::any_io_executor executor, std::string owner,
           const std::string& host, std::uint16_t port, const TcpOptions& buffers = {});
  // Accepts on `listening_socket` instead (bound and listening; the caller keeps it open):
  // the listener works on a duplicate and, when it closes, gives the socket up without closing
  // it, so the port stays bound for the caller's next listener.
  Listener(asio::io_context& io, asio::any_io_executor executor, std::string owner,
           int listening_socket, const TcpOptions& buffers = {});
  ~Listener();  // closes the socket (call close() first when the accept loop may be running)
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  // The address it listens on ("" = all interfaces).
  [[nodiscard]] const std::string& host() const noexcept { return host_; }
  // Accepts that failed, and accepted connections closed at once for want of descriptors.
  [[nodiscard]] std::size_t accept_failures() const noexcept;

  // Starts accepting: every connection from now on is handed to `serve` as a PendingConnection.
  void start(Serve serve);
  // Stops accepting and closes the listening socket. Call on the executor given at construction
  // (or while nothing runs the io_context).
  void close() noexcept;

 private:
  static asio::awaitable<void> accept_loop(std::shared_ptr<PendingConnection::Shared> shared,
                                           Serve serve);
  static asio::awaitable<void> serve_one(std::shared_ptr<PendingConnection::Shared> shared,
                                         std::shared_ptr<Socket> socket,
                                         std::shared_ptr<PendingConnection::Place> place,
                                         Serve serve);

  std::shared_ptr<PendingConnection::Shared> shared_;
  std::uint16_t port_ = 0;
  std::string host_;
};

}  // namespace pulseloco::transport::tcp
