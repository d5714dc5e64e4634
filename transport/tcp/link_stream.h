// Internal: the byte stream of one TCP link (a data-plane lane, a rendezvous or membership
// connection): the plain socket, or TLS 1.3 over it (tls_context.h), behind one interface, so
// that the code above has one path. It is an Asio AsyncReadStream and AsyncWriteStream
// (asio::async_read and async_write work on it) with the few synchronous operations the data
// plane needs.
//
// With TLS:
//  - A write sends one TLS record (at most 16 KiB of plaintext) per call. Asio's SSL stream
//    encrypts only the first buffer of a sequence, so a sequence whose first buffer is small
//    (a frame header, a small frame) is first gathered into a record-sized buffer: a batch of
//    small frames becomes full records instead of one record and one system call per buffer.
//  - The end of the peer's stream reads as asio::error::eof whether or not the peer sent a TLS
//    close_notify: the links end with an application-level goodbye (or fail), and a transport
//    that was not told goodbye treats eof as a lost peer, so a forged FIN can make a link fail
//    but never end it cleanly.
//  - A read decrypts into memory of the stream's own and copies into the caller's buffer only
//    if the stream has not been closed meanwhile: Asio may decrypt a record that arrived before
//    close() after it, when the caller's buffer may already be gone (a plain socket's read
//    never writes after close()).
//  - One read and one write may be in flight at once (from the same strand). A read never
//    writes: TLS 1.3 writes during a read only for post-handshake messages, and there are none
//    (no session tickets, no key update requests from pulseloco).
//
// Socket-level operations (options, close, shutdown of the sending side) go to socket(); a
// plain TCP shutdown ends the sending side under TLS too (no close_notify, see above).
// Threading: as the socket's.
#pragma once

#include <pulseloco/transport/tcp/asio_util.h>

#include <boost/asio/ssl/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>

#include <pulseloco/transport/tcp/tls_context.h>

namespace pulseloco::transport::tcp {

class LinkStream {
 public:
  using executor_type = Socket::executor_type;
  using Signature = void(boost::system::error_code, std::size_t);
  // Largest plaintext of one TLS record.
  static constexpr std::size_t kRecordBytes = 16 * 1024;

  // A plain stream over a new, unopened socket.
  explicit LinkStream(asio::io_context& io);
  // `socket` (connected), encrypted when `tls` is not null once secure() has run.
  LinkStream(std::shared_ptr<Socket> socket, std::shared_ptr<TlsContext> tls);
  LinkStream(LinkStream&&) noexcept;
  LinkStream& operator=(LinkStream&&) noexcept;
  ~LinkStream();

  [[nodiscard]] Socket& socket() noexcept { return *socket_; }
  [[nodiscard]] const std::shared_ptr<Socket>& shared_socket() const noexcept { return socket_; }
  [[nodiscard]] bool encrypted() const noexcept { return tls_stream_ != nullptr; }
  [[nodiscard]] bool uses_certificates() const noexcept {
    return tls_ && tls_->uses_certificates();
  }
  [[nodiscard]] executor_type get_executor() noexcept { return socket_->get_executor(); }

  // The TLS handshake as client or server (nothing for a plain stream). Throws
  // boost::system::system_error: an error of asio::error::get_ssl_category() when the peer's
  // key or certificate is wrong (is_tls_refusal()), another on I/O failure.
  [[nodiscard]] asio::awaitable<void> secure(asio::ssl::stream_base::handshake_type role);

  template <typename MutableBuffers, typename Token>
  auto async_read_some(const MutableBuffers& buffers, Token&& token) {
    return asio::async_initiate<Token, Signature>(
        [this](auto handler, const MutableBuffers& into) {
          if (!tls_stream_) {
            socket_->async_read_some(into, std::move(handler));
            return;
          }
          const auto executor = asio::get_associated_executor(handler, socket_->get_executor());
          const asio::mutable_buffer destination = first_buffer(into);
          const std::shared_ptr<Plaintext> plaintext = plaintext_;
          tls_stream_->async_read_some(
              asio::buffer(plaintext->bytes.get(), std::min(destination.size(), kRecordBytes)),
              asio::bind_executor(executor,
                                  [handler = std::move(handler), plaintext, destination](
                                      boost::system::error_code error, std::size_t n) mutable {
                                    if (plaintext->closed) {
                                      error = asio::error::operation_aborted;
                                      n = 0;
                                    }
                                    if (n > 0)
                                      std::memcpy(destination.data(), plaintext->bytes.get(), n);
                                    std::move(handler)(end_of_stream_as_eof(error), n);
                                  }));
        },
        token, buffers);
  }

  template <typename ConstBuffers, typename Token>
  auto async_write_some(const ConstBuffers& buffers, Token&& token) {
    return asio::async_initiate<Token, Signature>(
        [this](auto handler, const ConstBuffers& from) {
          if (tls_stream_) {
            tls_stream_->async_write_some(gather(from), std::move(handler));
          } else {
            socket_->async_write_some(from, std::move(handler));
          }
        },
        token, buffers);
  }

  // Synchronous read of what has arrived; asio::error::would_block when nothing has (the socket
  // is non-blocking).
  std::size_t read_some(const asio::mutable_buffer& buffer, boost::system::error_code& error);
  // Best-effort synchronous write of a short message (at most kRecordBytes) on a non-blocking
  // socket: the bytes of it that went out.
  std::size_t write_some(std::span<const asio::const_buffer> buffers,
                         boost::system::error_code& error);

  // Closes the socket (pending operations fail); never throws.
  void close() noexcept;

 private:
  using TlsStream = asio::ssl::stream<Socket&>;

  // What a TLS read decrypts into, and whether close() has run (on the socket's strand).
  struct Plaintext {
    std::unique_ptr<std::byte[]> bytes = std::make_unique<std::byte[]>(kRecordBytes);
    bool closed = false;
  };

  template <typename MutableBuffers>
  static asio::mutable_buffer first_buffer(const MutableBuffers& buffers) {
    for (auto it = asio::buffer_sequence_begin(buffers); it != asio::buffer_sequence_end(buffers);
         ++it)
      if (asio::mutable_buffer(*it).size() > 0) return *it;
    return {};
  }

  [[nodiscard]] static boost::system::error_code end_of_stream_as_eof(
      const boost::system::error_code& error) noexcept;

  // The first buffer of `buffers` when it fills a record, else as much of the sequence as fits
  // in one record, copied into record_.
  template <typename ConstBuffers>
  asio::const_buffer gather(const ConstBuffers& buffers) {
    auto it = asio::buffer_sequence_begin(buffers);
    const auto end = asio::buffer_sequence_end(buffers);
    while (it != end && asio::const_buffer(*it).size() == 0)
      ++it;
    if (it == end) return {};
    if (asio::const_buffer(*it).size() >= kRecordBytes) return *it;
    std::size_t used = 0;
    for (; it != end && used < kRecordBytes; ++it)
      used += asio::buffer_copy(asio::buffer(record_.get() + used, kRecordBytes - used),
                                asio::const_buffer(*it));
    return {record_.get(), used};
  }

  std::shared_ptr<Socket> socket_;
  std::shared_ptr<TlsContext> tls_;
  std::unique_ptr<TlsStream> tls_stream_;
  std::unique_ptr<std::byte[]> record_;   // gathered plaintext of the record being written
  std::shared_ptr<Plaintext> plaintext_;  // of the record being read
};

// Whether `error` (from secure() or a read or write after it) means TLS refused the peer (a
// wrong key or certificate, an alert from the peer) rather than an I/O failure.
[[nodiscard]] bool is_tls_refusal(const boost::system::error_code& error) noexcept;

}  // namespace pulseloco::transport::tcp
