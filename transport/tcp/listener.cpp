#include <pulseloco/transport/tcp/listener.h>

#include <fmt/format.h>

#include <atomic>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>

namespace pulseloco::transport::tcp {

// What the accept loop and the pending connections share (they may outlive the Listener).
struct PendingConnection::Shared {
  Shared(asio::io_context& context, const asio::any_io_executor& executor, std::string name)
      : io(context), acceptor(executor), room(executor), pause(executor), owner(std::move(name)) {}

  asio::io_context& io;
  Acceptor acceptor;
  asio::steady_timer room;   // the accept loop waits on it while every place is taken
  asio::steady_timer pause;  // the pause after a failed accept
  const std::string owner;
  std::atomic<std::size_t> pending{0};  // connections in their handshake
  bool closed = false;                  // on the accept loop's executor
};

PendingConnection::PendingConnection(std::shared_ptr<Shared> listener,
                                     std::shared_ptr<Socket> socket)
    : listener_(std::move(listener)),
      socket_(std::move(socket)),
      deadline_(std::make_unique<Watchdog>(socket_->get_executor(),
                                           Clock::now() + kHandshakeTimeout, [socket = socket_] {
                                             boost::system::error_code ignored;
                                             socket->close(ignored);
                                           })) {}

PendingConnection::PendingConnection(PendingConnection&& other) noexcept = default;

PendingConnection::~PendingConnection() {
  handshake_done();
}

void PendingConnection::handshake_done() noexcept {
  if (deadline_) {
    timed_out_ = deadline_->fired();
    deadline_.reset();
  }
  if (!listener_) return;
  const std::shared_ptr<Shared> listener = std::move(listener_);
  // The accept loop waits for a place only when every place was taken.
  if (listener->pending.fetch_sub(1) == kMaxPendingConnections) {
    try {
      asio::post(listener->room.get_executor(), [listener] { listener->room.cancel(); });
    } catch (...) {
      // The io_context is gone: nobody accepts any more.
    }
  }
}

bool PendingConnection::timed_out() const noexcept {
  return deadline_ ? deadline_->fired() : timed_out_;
}

Listener::Listener(asio::io_context& io, asio::any_io_executor executor, std::string owner,
                   const std::string& host, std::uint16_t port, const TcpOptions& buffers)
    : shared_(std::make_shared<PendingConnection::Shared>(io, executor, std::move(owner))) {
  Acceptor& acceptor = shared_->acceptor;
  try {
    const Endpoint endpoint(asio::ip::make_address(host.empty() ? "0.0.0.0" : host), port);
    acceptor.open(endpoint.protocol());
    acceptor.set_option(asio::socket_base::reuse_address(true));
    apply_buffer_sizes(acceptor, buffers);
    acceptor.bind(endpoint);
    acceptor.listen(asio::socket_base::max_listen_connections);
    port_ = acceptor.local_endpoint().port();
  } catch (const boost::system::system_error& error) {
    throw IoError(fmt::format("{}: cannot listen on {}:{}: {}", shared_->owner,
                              host.empty() ? "*" : host, port, error.code().message()));
  }
}

Listener::~Listener() {
  boost::system::error_code ignored;
  shared_->acceptor.close(ignored);
}

void Listener::start(Serve serve) {
  asio::co_spawn(shared_->acceptor.get_executor(), accept_loop(shared_, std::move(serve)),
                 asio::detached);
}

void Listener::close() noexcept {
  auto& shared = *shared_;
  shared.closed = true;
  boost::system::error_code ignored;
  shared.acceptor.close(ignored);
  shared.room.cancel();
  shared.pause.cancel();
}

asio::awaitable<void> Listener::accept_loop(std::shared_ptr<PendingConnection::Shared> shared,
                                            Serve serve) {
  auto& s = *shared;
  for (;;) {
    while (s.pending.load() >= kMaxPendingConnections && !s.closed) {
      s.room.expires_at(asio::steady_timer::time_point::max());
      boost::system::error_code ignored;
      co_await s.room.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
    }
    if (s.closed) co_return;
    auto socket = std::make_shared<Socket>(asio::make_strand(s.io));
    boost::system::error_code error;
    co_await s.acceptor.async_accept(*socket, asio::redirect_error(asio::use_awaitable, error));
    if (s.closed || error == asio::error::operation_aborted || !s.acceptor.is_open()) co_return;
    if (error) {
      logger().warn("{}: accept failed: {}; accepting again in {} ms", s.owner, error.message(),
                    kAcceptErrorPause.count());
      s.pause.expires_after(kAcceptErrorPause);
      co_await s.pause.async_wait(asio::redirect_error(asio::use_awaitable, error));
      continue;
    }
    s.pending.fetch_add(1);
    const auto executor = socket->get_executor();
    asio::co_spawn(executor, serve_one(shared, std::move(socket), serve), asio::detached);
  }
}

asio::awaitable<void> Listener::serve_one(std::shared_ptr<PendingConnection::Shared> shared,
                                          std::shared_ptr<Socket> socket, Serve serve) {
  co_await serve(PendingConnection(std::move(shared), std::move(socket)));
}

}  // namespace pulseloco::transport::tcp
