#include <pulseloco/transport/tcp/asio_util.h>

#include <fmt/format.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <pulseloco/base/errors.h>

namespace pulseloco::transport::tcp {

struct Watchdog::State {
  explicit State(const asio::any_io_executor& executor) : timer(executor) {}
  asio::steady_timer timer;
  std::function<void()> on_expiry;
  bool disarmed = false;
  bool fired = false;
};

Watchdog::Watchdog(const asio::any_io_executor& executor, Deadline deadline,
                   std::function<void()> on_expiry)
    : state_(std::make_shared<State>(executor)) {
  state_->on_expiry = std::move(on_expiry);
  state_->timer.expires_at(deadline);
  state_->timer.async_wait([state = state_](const boost::system::error_code& error) {
    // A completion queued just before the watchdog was destroyed must not touch the socket.
    if (error || state->disarmed) return;
    state->fired = true;
    state->on_expiry();
  });
}

Watchdog::~Watchdog() {
  state_->disarmed = true;
  state_->timer.cancel();
}

bool Watchdog::fired() const noexcept {
  return state_->fired;
}

void apply_buffer_sizes(Socket& socket, const TcpOptions& options) {
  boost::system::error_code ignored;
  if (options.socket_send_buffer_bytes > 0)
    socket.set_option(asio::socket_base::send_buffer_size(options.socket_send_buffer_bytes),
                      ignored);
  if (options.socket_receive_buffer_bytes > 0)
    socket.set_option(asio::socket_base::receive_buffer_size(options.socket_receive_buffer_bytes),
                      ignored);
}

void apply_buffer_sizes(Acceptor& acceptor, const TcpOptions& options) {
  boost::system::error_code ignored;
  // Accepted sockets inherit these; the receive size must be set before the handshake so that
  // TCP negotiates a matching window scale.
  if (options.socket_send_buffer_bytes > 0)
    acceptor.set_option(asio::socket_base::send_buffer_size(options.socket_send_buffer_bytes),
                        ignored);
  if (options.socket_receive_buffer_bytes > 0)
    acceptor.set_option(asio::socket_base::receive_buffer_size(options.socket_receive_buffer_bytes),
                        ignored);
}

void apply_socket_options(Socket& socket, const TcpOptions& options) {
  boost::system::error_code ignored;
  socket.set_option(asio::ip::tcp::no_delay(options.tcp_nodelay), ignored);
  socket.set_option(asio::socket_base::keep_alive(options.keepalive), ignored);
  if (options.keepalive) {
    const int fd = socket.native_handle();
    const int idle = options.keepalive_idle_s;
    const int interval = options.keepalive_interval_s;
    const int count = options.keepalive_count;
    // Best effort: these are Linux options; failure leaves the kernel defaults.
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
    (void)::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  }
}

namespace {

asio::ip::address unmapped(const asio::ip::address& address) {
  if (address.is_v6() && address.to_v6().is_v4_mapped())
    return asio::ip::make_address_v4(asio::ip::v4_mapped, address.to_v6());
  return address;
}

}  // namespace

bool same_host_link(const asio::ip::address& local, const asio::ip::address& remote) noexcept {
  const asio::ip::address a = unmapped(local);
  const asio::ip::address b = unmapped(remote);
  if (b.is_unspecified()) return false;
  return b.is_loopback() || a == b;
}

bool same_host_link(const Socket& socket) noexcept {
  boost::system::error_code error;
  const auto local = socket.local_endpoint(error);
  if (error) return false;
  const auto remote = socket.remote_endpoint(error);
  if (error) return false;
  return same_host_link(local.address(), remote.address());
}

std::string remote_description(const Socket& socket) {
  boost::system::error_code error;
  const auto endpoint = socket.remote_endpoint(error);
  if (error) return "<unknown>";
  return fmt::format("{}:{}", endpoint.address().to_string(), endpoint.port());
}

Endpoint resolve_endpoint(asio::io_context& io, const std::string& host, std::uint16_t port) {
  boost::system::error_code error;
  const auto address = asio::ip::make_address(host, error);
  if (!error) return {address, port};
  asio::ip::tcp::resolver resolver(io);
  const auto results = resolver.resolve(host, std::to_string(port), error);
  if (error || results.empty())
    throw IoError(fmt::format("cannot resolve host '{}': {}", host,
                              error ? error.message() : std::string("no address")));
  for (const auto& entry : results)
    if (entry.endpoint().address().is_v4()) return entry.endpoint();
  return results.begin()->endpoint();
}

}  // namespace pulseloco::transport::tcp
