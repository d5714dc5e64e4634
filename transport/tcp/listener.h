// Internal: the one way pulseloco listens for TCP connections: the TCP transport's data listener,
// the rendezvous server (group/) and the elastic coordinator (elastic/) all accept through a
// Listener, under one policy:
//  - every accepted connection must finish its handshake (authentication, and whatever its
//    server reads before it trusts the peer) within kHandshakeTimeout, or its socket is closed;
//  - at most kMaxPendingConnections connections are in their handshake at once; beyond that
//    the listener accepts again only once one of them has finished, so that connections that
//    never authenticate cannot use up the process's file descriptors;
//  - a failed accept (out of file descriptors, say) is logged and accepting pauses for
//    kAcceptErrorPause before the next try, instead of spinning on the error.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <pulseloco/transport/tcp/asio_util.h>

namespace pulseloco::transport::tcp {

inline constexpr std::chrono::seconds kHandshakeTimeout{10};
inline constexpr std::size_t kMaxPendingConnections = 256;
inline constexpr std::chrono::milliseconds kAcceptErrorPause{100};

// A connection a Listener accepted, while its handshake runs: the handshake deadline closes its
// socket when it passes first, and it holds one of the listener's places for pending
// connections. handshake_done() (or destruction) ends both. Lives on the socket's executor.
class PendingConnection {
 public:
  struct Shared;
  PendingConnection(std::shared_ptr<Shared> listener, std::shared_ptr<Socket> socket);
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

 private:
  std::shared_ptr<Shared> listener_;
  std::shared_ptr<Socket> socket_;
  std::unique_ptr<Watchdog> deadline_;
  bool timed_out_ = false;  // what the deadline did, once handshake_done() removed it
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
  ~Listener();  // closes the socket (call close() first when the accept loop may be running)
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }

  // Starts accepting: every connection from now on is handed to `serve` as a PendingConnection.
  void start(Serve serve);
  // Stops accepting and closes the listening socket. Call on the executor given at construction
  // (or while nothing runs the io_context).
  void close() noexcept;

 private:
  static asio::awaitable<void> accept_loop(std::shared_ptr<PendingConnection::Shared> shared,
                                           Serve serve);
  static asio::awaitable<void> serve_one(std::shared_ptr<PendingConnection::Shared> shared,
                                         std::shared_ptr<Socket> socket, Serve serve);

  std::shared_ptr<PendingConnection::Shared> shared_;
  std::uint16_t port_ = 0;
};

}  // namespace pulseloco::transport::tcp
