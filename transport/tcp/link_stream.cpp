#include <pulseloco/transport/tcp/link_stream.h>

#include <boost/asio/ssl/error.hpp>

namespace pulseloco::transport::tcp {

LinkStream::LinkStream(asio::io_context& io) : socket_(std::make_shared<Socket>(io)) {}

LinkStream::LinkStream(std::shared_ptr<Socket> socket, std::shared_ptr<TlsContext> tls)
    : socket_(std::move(socket)), tls_(std::move(tls)) {
  if (tls_) session_ = std::make_shared<TlsSession>(*tls_);
}

LinkStream::LinkStream(LinkStream&&) noexcept = default;
LinkStream& LinkStream::operator=(LinkStream&&) noexcept = default;
LinkStream::~LinkStream() = default;

asio::awaitable<void> LinkStream::secure(Role role) {
  if (!session_) co_return;
  const std::shared_ptr<TlsSession> session = session_;
  const std::shared_ptr<Socket> socket = socket_;
  session->start(role);
  for (;;) {
    boost::system::error_code failure;
    const bool done = session->handshake(failure);
    if (session->has_ciphertext()) {
      // Sent even when the handshake failed: it is then the alert that tells the peer why.
      const auto ciphertext = session->take_ciphertext();
      boost::system::error_code write_error;
      co_await asio::async_write(*socket, asio::buffer(ciphertext.data(), ciphertext.size()),
                                 asio::redirect_error(asio::use_awaitable, write_error));
      if (!failure) failure = write_error;
    }
    if (failure) throw boost::system::system_error(failure);
    if (done) co_return;
    const auto room = session->ciphertext_room();
    session->received(co_await socket->async_read_some(asio::buffer(room.data(), room.size()),
                                                       asio::use_awaitable));
  }
}

std::size_t LinkStream::read_some(const asio::mutable_buffer& buffer,
                                  boost::system::error_code& error) {
  if (!session_) return socket_->read_some(buffer, error);
  const std::span<std::byte> into(static_cast<std::byte*>(buffer.data()), buffer.size());
  std::size_t n = session_->decrypt(into, error);
  if (n > 0 || error || into.empty()) return n;
  const auto room = session_->ciphertext_room();
  const std::size_t arrived = socket_->read_some(asio::buffer(room.data(), room.size()), error);
  if (error) return 0;
  session_->received(arrived);
  n = session_->decrypt(into, error);
  if (n == 0 && !error) error = asio::error::would_block;  // part of a record
  return n;
}

std::size_t LinkStream::write_some(std::span<const asio::const_buffer> buffers,
                                   boost::system::error_code& error) {
  if (!session_) return socket_->send(buffers, 0, error);
  error.clear();
  const std::size_t taken = encrypt(buffers);
  if (session_->failure()) {
    error = session_->failure();
    return 0;
  }
  const auto ciphertext = session_->ciphertext();
  const std::size_t sent =
      socket_->send(asio::buffer(ciphertext.data(), ciphertext.size()), 0, error);
  const bool whole = !error && sent == ciphertext.size();
  session_->drop_ciphertext(error ? 0 : sent);
  return whole ? taken : 0;
}

void LinkStream::close() noexcept {
  if (session_) session_->close();
  boost::system::error_code ignored;
  socket_->close(ignored);
}

bool is_tls_refusal(const boost::system::error_code& error) noexcept {
  return error.category() == asio::error::get_ssl_category();
}

}  // namespace pulseloco::transport::tcp
