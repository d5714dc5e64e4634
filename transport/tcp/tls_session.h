// Internal: the OpenSSL state of one TLS 1.3 link, driven over memory of its own instead of a
// socket, so that its user (link_stream.h) chooses the system calls: many records are encrypted
// into one buffer and written with one call, and one read takes many records at once. OpenSSL
// reads and writes the session's buffers through a BIO of the session's own; it never touches
// the socket.
//
// Not thread-safe: one caller at a time (the link's strand). Reads never write ciphertext that
// the peer expects: TLS 1.3 writes during a read only for post-handshake messages, and there are
// none (no session tickets, no key updates from pulseloco); an alert OpenSSL writes on a failed
// read waits in the buffer of the next write.
#pragma once

#include <boost/system/error_code.hpp>

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include <pulseloco/transport/tcp/tls_context.h>

struct ssl_st;

namespace pulseloco::transport::tcp {

class TlsSession {
 public:
  enum class Role { client, server };

  // Largest plaintext of one TLS record.
  static constexpr std::size_t kRecordBytes = 16 * 1024;
  // Most plaintext one write encrypts (a sender's batch: 256 KiB of payloads and their headers),
  // and most ciphertext one read of the socket takes.
  static constexpr std::size_t kMaxWriteBytes = 256 * 1024 + 4096;
  static constexpr std::size_t kMaxReadBytes = 256 * 1024;

  explicit TlsSession(TlsContext& context);
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // --- Handshake ---------------------------------------------------------------------------
  void start(Role role);
  // One step of the handshake: true when it is done; false with `error` clear when it needs
  // more of the peer's bytes (received()); false with `error` set when it failed (an error of
  // asio::error::get_ssl_category(), carrying OpenSSL's error code). Either way, the
  // ciphertext to send (has_ciphertext()) goes out first: it may be the alert that tells the
  // peer why.
  [[nodiscard]] bool handshake(boost::system::error_code& error);

  // --- Writing -------------------------------------------------------------------------------
  // Encrypts `plaintext` into the ciphertext buffer, in records of kRecordBytes; a short piece
  // waits for the next piece or seal() to fill its record. Returns false when the session has
  // failed (failure()).
  [[nodiscard]] bool add(std::span<const std::byte> plaintext);
  // Ends the records of the pieces added so far.
  [[nodiscard]] bool seal();
  [[nodiscard]] bool has_ciphertext() const noexcept { return !outgoing_.empty(); }
  // All ciphertext encrypted so far, in memory that stays valid until the next call of
  // take_ciphertext() (for an asynchronous write); later ciphertext goes to another buffer.
  [[nodiscard]] std::span<const std::byte> take_ciphertext();
  // The ciphertext encrypted so far without taking it; drop_ciphertext(n) removes its first n
  // bytes (a synchronous write that sent them).
  [[nodiscard]] std::span<const std::byte> ciphertext() const noexcept { return outgoing_; }
  void drop_ciphertext(std::size_t n);

  // --- Reading -------------------------------------------------------------------------------
  // Memory for the next read of the socket; received(n) after n bytes arrived into it.
  [[nodiscard]] std::span<std::byte> ciphertext_room();
  void received(std::size_t n) noexcept { end_ += n; }
  // Decrypts what has arrived into `into`, as much as fits. 0 with `error` clear: a whole record
  // has yet to arrive. 0 with `error` set: the peer ended the stream with a TLS close_notify
  // (asio::error::eof) or the session failed (a record that does not authenticate, an alert;
  // an error of asio::error::get_ssl_category()). A failure after some bytes were decrypted is
  // reported by the next call.
  [[nodiscard]] std::size_t decrypt(std::span<std::byte> into, boost::system::error_code& error);

  // The link was closed: a read that completes later must not write into its caller's memory.
  void close() noexcept { closed_ = true; }
  [[nodiscard]] bool closed() const noexcept { return closed_; }

  // Why the session cannot go on (clear while it can).
  [[nodiscard]] const boost::system::error_code& failure() const noexcept { return failure_; }

 private:
  struct Bio;

  bool write_records(std::span<const std::byte> plaintext);
  [[nodiscard]] boost::system::error_code error_of(int ssl_error) const;

  ssl_st* ssl_ = nullptr;
  bool closed_ = false;
  boost::system::error_code failure_;
  // Writing: plaintext waiting to fill a record; ciphertext not yet taken; ciphertext taken by
  // the write in flight.
  std::unique_ptr<std::byte[]> staging_;
  std::size_t staged_ = 0;
  std::vector<std::byte> outgoing_;
  std::vector<std::byte> in_flight_;
  // Reading: ciphertext received, [begin_, end_) not yet given to OpenSSL.
  std::unique_ptr<std::byte[]> incoming_;
  std::size_t begin_ = 0;
  std::size_t end_ = 0;
};

}  // namespace pulseloco::transport::tcp
