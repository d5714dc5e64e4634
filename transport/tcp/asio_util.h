// Internal: small Boost.Asio helpers shared by the TCP transport, the rendezvous (group/) and the
// elastic coordinator and client (elastic/).
#pragma once

// Boost 1.74's awaitable.hpp uses std::exchange without including <utility>.
#include <utility>

#include <boost/asio.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include <pulseloco/transport/tcp/tcp_options.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport::tcp {

namespace asio = boost::asio;
using Socket = asio::ip::tcp::socket;
using Acceptor = asio::ip::tcp::acceptor;
using Endpoint = asio::ip::tcp::endpoint;

// Runs `on_expiry` on `executor` when `deadline` passes, unless the watchdog was destroyed
// first. The usual use: close a socket so that every pending operation on it fails. Must be
// created and destroyed on `executor` (the socket's strand).
class Watchdog {
 public:
  Watchdog(const asio::any_io_executor& executor, Deadline deadline,
           std::function<void()> on_expiry);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  [[nodiscard]] bool fired() const noexcept;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// Applies TCP_NODELAY, keepalive and (before connect/listen) the buffer sizes.
void apply_socket_options(Socket& socket, const TcpOptions& options);
void apply_buffer_sizes(Socket& socket, const TcpOptions& options);
void apply_buffer_sizes(Acceptor& acceptor, const TcpOptions& options);

// Whether a connection from `local` to `remote` stays inside this host's network stack (this
// network namespace): `remote` is a loopback address, or one of this host's own (the two ends'
// addresses are equal; Linux drops a packet arriving from outside with a source address that is
// local, unless net.ipv4.conf.*.accept_local is set).
[[nodiscard]] bool same_host_link(const asio::ip::address& local,
                                  const asio::ip::address& remote) noexcept;
// The same for a connected socket (false when its addresses cannot be read).
[[nodiscard]] bool same_host_link(const Socket& socket) noexcept;

// "1.2.3.4:5678" of the remote end, or "<unknown>".
[[nodiscard]] std::string remote_description(const Socket& socket);

// Resolves host:port (numeric or by name, IPv4 preferred); throws IoError naming the address.
[[nodiscard]] Endpoint resolve_endpoint(asio::io_context& io, const std::string& host,
                                        std::uint16_t port);

}  // namespace pulseloco::transport::tcp
