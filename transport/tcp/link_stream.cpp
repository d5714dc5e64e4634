#include <pulseloco/transport/tcp/link_stream.h>

#include <boost/asio/ssl/error.hpp>

namespace pulseloco::transport::tcp {

LinkStream::LinkStream(asio::io_context& io) : socket_(std::make_shared<Socket>(io)) {}

LinkStream::LinkStream(std::shared_ptr<Socket> socket, std::shared_ptr<TlsContext> tls)
    : socket_(std::move(socket)), tls_(std::move(tls)) {
  if (!tls_) return;
  tls_stream_ = std::make_unique<TlsStream>(*socket_, tls_->context());
  record_ = std::make_unique<std::byte[]>(kRecordBytes);
  plaintext_ = std::make_shared<Plaintext>();
}

LinkStream::LinkStream(LinkStream&&) noexcept = default;
LinkStream& LinkStream::operator=(LinkStream&&) noexcept = default;
LinkStream::~LinkStream() = default;

asio::awaitable<void> LinkStream::secure(asio::ssl::stream_base::handshake_type role) {
  if (tls_stream_) co_await tls_stream_->async_handshake(role, asio::use_awaitable);
}

std::size_t LinkStream::read_some(const asio::mutable_buffer& buffer,
                                  boost::system::error_code& error) {
  if (!tls_stream_) return socket_->read_some(buffer, error);
  const std::size_t n = tls_stream_->read_some(buffer, error);
  error = end_of_stream_as_eof(error);
  return n;
}

std::size_t LinkStream::write_some(std::span<const asio::const_buffer> buffers,
                                   boost::system::error_code& error) {
  if (!tls_stream_) return socket_->send(buffers, 0, error);
  return tls_stream_->write_some(gather(buffers), error);
}

void LinkStream::close() noexcept {
  if (plaintext_) plaintext_->closed = true;
  boost::system::error_code ignored;
  socket_->close(ignored);
}

boost::system::error_code LinkStream::end_of_stream_as_eof(
    const boost::system::error_code& error) noexcept {
  if (error == asio::ssl::error::stream_truncated) return asio::error::eof;
  return error;
}

bool is_tls_refusal(const boost::system::error_code& error) noexcept {
  return error.category() == asio::error::get_ssl_category();
}

}  // namespace pulseloco::transport::tcp
