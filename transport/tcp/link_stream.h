// Internal: the byte stream of one TCP link (a data-plane lane, a rendezvous or membership
// connection): the plain socket, or TLS 1.3 over it (tls_context.h), behind one interface, so
// that the code above has one path. It is an Asio AsyncReadStream and AsyncWriteStream
// (asio::async_read and async_write work on it) with the few synchronous operations the data
// plane needs.
//
// With TLS (tls_session.h drives OpenSSL over memory; this class does the system calls):
//  - A write encrypts up to TlsSession::kMaxWriteBytes of the buffer sequence, in full records
//    (small buffers are gathered into one), and writes all of that ciphertext before it
//    completes, in one system call when the socket takes it: a batch of frames costs about as
//    many system calls as without TLS, not one per 16 KiB record. The caller's buffers are read
//    only while the write starts.
//  - A read takes up to TlsSession::kMaxReadBytes of ciphertext from the socket and decrypts
//    straight into the caller's buffer (its first non-empty one), as much as fits; what does
//    not fit stays for the next read, which then needs no system call. A read completing after
//    close() writes nothing into the caller's buffer (which may be gone then) and fails with
//    asio::error::operation_aborted.
//  - The end of the peer's stream reads as asio::error::eof whether or not the peer sent a TLS
//    close_notify: the links end with an application-level goodbye (or fail), and a transport
//    that was not told goodbye treats eof as a lost peer, so a forged FIN can make a link fail
//    but never end it cleanly.
//  - One read and one write may be in flight at once (from the same strand).
//
// Socket-level operations (options, close, shutdown of the sending side) go to socket(); a
// plain TCP shutdown ends the sending side under TLS too (no close_notify, see above).
// Threading: as the socket's.
#pragma once

#include <pulseloco/transport/tcp/asio_util.h>

#include <cstddef>
#include <memory>
#include <span>

#include <pulseloco/transport/tcp/tls_context.h>
#include <pulseloco/transport/tcp/tls_session.h>

namespace pulseloco::transport::tcp {

class LinkStream {
 public:
  using executor_type = Socket::executor_type;
  using Signature = void(boost::system::error_code, std::size_t);
  using Role = TlsSession::Role;

  // A plain stream over a new, unopened socket.
  explicit LinkStream(asio::io_context& io);
  // `socket` (connected), encrypted when `tls` is not null once secure() has run.
  LinkStream(std::shared_ptr<Socket> socket, std::shared_ptr<TlsContext> tls);
  LinkStream(LinkStream&&) noexcept;
  LinkStream& operator=(LinkStream&&) noexcept;
  ~LinkStream();

  [[nodiscard]] Socket& socket() noexcept { return *socket_; }
  [[nodiscard]] const std::shared_ptr<Socket>& shared_socket() const noexcept { return socket_; }
  [[nodiscard]] bool encrypted() const noexcept { return session_ != nullptr; }
  [[nodiscard]] bool uses_certificates() const noexcept {
    return tls_ && tls_->uses_certificates();
  }
  [[nodiscard]] executor_type get_executor() noexcept { return socket_->get_executor(); }

  // The TLS handshake as client or server (nothing for a plain stream). Throws
  // boost::system::system_error: an error of asio::error::get_ssl_category() when the peer's
  // key or certificate is wrong (is_tls_refusal()), another on I/O failure.
  [[nodiscard]] asio::awaitable<void> secure(Role role);

  template <typename MutableBuffers, typename Token>
  auto async_read_some(const MutableBuffers& buffers, Token&& token) {
    return asio::async_initiate<Token, Signature>(
        [this](auto handler, const MutableBuffers& into) {
          if (!session_) {
            socket_->async_read_some(into, std::move(handler));
            return;
          }
          TlsRead<decltype(handler)>(session_, socket_, first_buffer(into), std::move(handler))
              .start();
        },
        token, buffers);
  }

  template <typename ConstBuffers, typename Token>
  auto async_write_some(const ConstBuffers& buffers, Token&& token) {
    return asio::async_initiate<Token, Signature>(
        [this](auto handler, const ConstBuffers& from) {
          if (!session_) {
            socket_->async_write_some(from, std::move(handler));
            return;
          }
          const auto executor = asio::get_associated_executor(handler, socket_->get_executor());
          const std::size_t taken = encrypt(from);
          if (taken == 0 || session_->failure()) {
            asio::post(executor,
                       [handler = std::move(handler), error = session_->failure()]() mutable {
                         std::move(handler)(error, 0);
                       });
            return;
          }
          const auto ciphertext = session_->take_ciphertext();
          asio::async_write(
              *socket_, asio::buffer(ciphertext.data(), ciphertext.size()),
              asio::bind_executor(executor,
                                  [handler = std::move(handler), session = session_, taken](
                                      boost::system::error_code error, std::size_t) mutable {
                                    std::move(handler)(error, error ? 0 : taken);
                                  }));
        },
        token, buffers);
  }

  // Synchronous read of what has arrived; asio::error::would_block when nothing has (the socket
  // is non-blocking).
  std::size_t read_some(const asio::mutable_buffer& buffer, boost::system::error_code& error);
  // Best-effort synchronous write of a short message on a non-blocking socket: the bytes of it
  // that went out (under TLS: all of it, or none and the rest of its ciphertext goes out before
  // the next write's).
  std::size_t write_some(std::span<const asio::const_buffer> buffers,
                         boost::system::error_code& error);

  // Closes the socket (pending operations fail); never throws.
  void close() noexcept;

 private:
  // A read under TLS: decrypts what has arrived, else reads the socket until a record has.
  template <typename Handler>
  class TlsRead {
   public:
    TlsRead(std::shared_ptr<TlsSession> session, std::shared_ptr<Socket> socket,
            asio::mutable_buffer into, Handler handler)
        : session_(std::move(session)),
          socket_(std::move(socket)),
          into_(static_cast<std::byte*>(into.data()), into.size()),
          handler_(std::move(handler)) {}

    void start() {
      boost::system::error_code error;
      const std::size_t n = session_->decrypt(into_, error);
      if (n > 0 || error || into_.empty()) {
        const auto on = executor();
        asio::post(on, [handler = std::move(handler_), error, n]() mutable {
          std::move(handler)(error, n);
        });
        return;
      }
      read_socket();
    }

    void operator()(boost::system::error_code error, std::size_t n) {
      if (session_->closed()) {
        std::move(handler_)(asio::error::operation_aborted, 0);
        return;
      }
      if (error) {
        std::move(handler_)(error, 0);
        return;
      }
      session_->received(n);
      const std::size_t decrypted = session_->decrypt(into_, error);
      if (decrypted == 0 && !error) {
        read_socket();  // part of a record
        return;
      }
      std::move(handler_)(error, decrypted);
    }

   private:
    auto executor() const {
      return asio::get_associated_executor(handler_, socket_->get_executor());
    }

    void read_socket() {
      const auto room = session_->ciphertext_room();
      const auto on = executor();
      socket_->async_read_some(asio::buffer(room.data(), room.size()),
                               asio::bind_executor(on, std::move(*this)));
    }

    std::shared_ptr<TlsSession> session_;
    std::shared_ptr<Socket> socket_;
    std::span<std::byte> into_;
    Handler handler_;
  };

  template <typename MutableBuffers>
  static asio::mutable_buffer first_buffer(const MutableBuffers& buffers) {
    for (auto it = asio::buffer_sequence_begin(buffers); it != asio::buffer_sequence_end(buffers);
         ++it)
      if (asio::mutable_buffer(*it).size() > 0) return *it;
    return {};
  }

  // Encrypts the start of `buffers`, up to TlsSession::kMaxWriteBytes, into the session's
  // ciphertext: the plaintext bytes taken (0 when the session has failed).
  template <typename ConstBuffers>
  std::size_t encrypt(const ConstBuffers& buffers) {
    std::size_t taken = 0;
    for (auto it = asio::buffer_sequence_begin(buffers);
         it != asio::buffer_sequence_end(buffers) && taken < TlsSession::kMaxWriteBytes; ++it) {
      const asio::const_buffer buffer(*it);
      const std::size_t n = std::min(buffer.size(), TlsSession::kMaxWriteBytes - taken);
      if (!session_->add({static_cast<const std::byte*>(buffer.data()), n})) return 0;
      taken += n;
    }
    return session_->seal() ? taken : 0;
  }

  std::shared_ptr<Socket> socket_;
  std::shared_ptr<TlsContext> tls_;
  std::shared_ptr<TlsSession> session_;  // shared with the operations in flight
};

// Whether `error` (from secure() or a read or write after it) means TLS refused the peer (a
// wrong key or certificate, an alert from the peer) rather than an I/O failure.
[[nodiscard]] bool is_tls_refusal(const boost::system::error_code& error) noexcept;

}  // namespace pulseloco::transport::tcp
