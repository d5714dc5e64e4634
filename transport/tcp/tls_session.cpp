#include <pulseloco/transport/tcp/tls_session.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <boost/asio/error.hpp>
#include <boost/asio/ssl/error.hpp>

#include <algorithm>
#include <cstring>

#include <pulseloco/base/errors.h>

namespace pulseloco::transport::tcp {

// The BIO between OpenSSL and the session's buffers: writes append to the ciphertext to send,
// reads take from the ciphertext received (and ask to be retried when there is none).
struct TlsSession::Bio {
  static TlsSession& session(BIO* bio) { return *static_cast<TlsSession*>(BIO_get_data(bio)); }

  static int write(BIO* bio, const char* data, std::size_t length, std::size_t* written) {
    auto& out = session(bio).outgoing_;
    const auto* bytes = reinterpret_cast<const std::byte*>(data);
    out.insert(out.end(), bytes, bytes + length);
    *written = length;
    return 1;
  }

  static int read(BIO* bio, char* data, std::size_t length, std::size_t* read) {
    TlsSession& self = session(bio);
    BIO_clear_retry_flags(bio);
    const std::size_t n = std::min(length, self.end_ - self.begin_);
    *read = n;
    if (n == 0) {
      BIO_set_retry_read(bio);
      return 0;
    }
    std::memcpy(data, self.incoming_.get() + self.begin_, n);
    self.begin_ += n;
    return 1;
  }

  static long control(BIO* bio, int command, long, void*) {
    switch (command) {
      case BIO_CTRL_FLUSH:
        return 1;  // what is written is in the buffer already
      case BIO_CTRL_PENDING: {
        const TlsSession& self = session(bio);
        return static_cast<long>(self.end_ - self.begin_);
      }
      default:
        return 0;
    }
  }

  static BIO_METHOD* method() {
    static BIO_METHOD* const method = [] {
      BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "pulseloco link");
      if (m == nullptr || BIO_meth_set_write_ex(m, &write) != 1 ||
          BIO_meth_set_read_ex(m, &read) != 1 || BIO_meth_set_ctrl(m, &control) != 1 ||
          BIO_meth_set_create(m, [](BIO* bio) {
            BIO_set_init(bio, 1);
            return 1;
          }) != 1)
        throw IoError("TLS: OpenSSL could not make the link's BIO method");
      return m;
    }();
    return method;
  }
};

TlsSession::TlsSession(TlsContext& context)
    // Not zeroed: a connection still in its handshake (perhaps a stranger's) holds only the pages
    // its bytes reached, not the whole buffers.
    : staging_(std::make_unique_for_overwrite<std::byte[]>(kRecordBytes)),
      incoming_(std::make_unique_for_overwrite<std::byte[]>(kMaxReadBytes)) {
  ssl_ = SSL_new(context.context().native_handle());
  BIO* bio = ssl_ != nullptr ? BIO_new(Bio::method()) : nullptr;
  if (bio == nullptr) {
    SSL_free(ssl_);
    ERR_clear_error();
    throw IoError("TLS: OpenSSL could not make a connection's state");
  }
  BIO_set_data(bio, this);
  SSL_set_bio(ssl_, bio, bio);  // one BIO both ways; the SSL owns it
  // A record's worth of header and tag per record, plus the records themselves.
  outgoing_.reserve(kMaxWriteBytes + kMaxWriteBytes / 64);
  in_flight_.reserve(outgoing_.capacity());
}

TlsSession::~TlsSession() {
  SSL_free(ssl_);
}

void TlsSession::start(Role role) {
  if (role == Role::client) {
    SSL_set_connect_state(ssl_);
  } else {
    SSL_set_accept_state(ssl_);
  }
}

bool TlsSession::handshake(boost::system::error_code& error) {
  error.clear();
  ERR_clear_error();
  const int result = SSL_do_handshake(ssl_);
  if (result == 1) return true;
  const int ssl_error = SSL_get_error(ssl_, result);
  if (ssl_error != SSL_ERROR_WANT_READ) error = failure_ = error_of(ssl_error);
  return false;
}

bool TlsSession::add(std::span<const std::byte> plaintext) {
  while (!plaintext.empty()) {
    if (staged_ > 0 || plaintext.size() < kRecordBytes) {
      const std::size_t n = std::min(kRecordBytes - staged_, plaintext.size());
      std::memcpy(staging_.get() + staged_, plaintext.data(), n);
      staged_ += n;
      plaintext = plaintext.subspan(n);
      if (staged_ == kRecordBytes && !seal()) return false;
      continue;
    }
    // Whole records straight from the caller's memory; the rest waits in staging.
    const std::size_t whole = plaintext.size() - plaintext.size() % kRecordBytes;
    if (!write_records(plaintext.first(whole))) return false;
    plaintext = plaintext.subspan(whole);
  }
  return true;
}

bool TlsSession::seal() {
  if (staged_ == 0) return !failure_;
  const bool ok = write_records({staging_.get(), staged_});
  staged_ = 0;
  return ok;
}

bool TlsSession::write_records(std::span<const std::byte> plaintext) {
  if (failure_) return false;
  ERR_clear_error();
  std::size_t written = 0;
  // The BIO takes everything: OpenSSL writes all of it or fails.
  const int result = SSL_write_ex(ssl_, plaintext.data(), plaintext.size(), &written);
  if (result == 1 && written == plaintext.size()) return true;
  failure_ = error_of(SSL_get_error(ssl_, result));
  return false;
}

std::span<const std::byte> TlsSession::take_ciphertext() {
  std::swap(outgoing_, in_flight_);
  outgoing_.clear();
  return in_flight_;
}

void TlsSession::drop_ciphertext(std::size_t n) {
  outgoing_.erase(outgoing_.begin(),
                  outgoing_.begin() + static_cast<std::ptrdiff_t>(std::min(n, outgoing_.size())));
}

std::span<std::byte> TlsSession::ciphertext_room() {
  // OpenSSL asks for more only once it has taken every byte received, so the buffer is usually
  // empty here; what is left is moved to the front.
  if (begin_ > 0) {
    std::memmove(incoming_.get(), incoming_.get() + begin_, end_ - begin_);
    end_ -= begin_;
    begin_ = 0;
  }
  return {incoming_.get() + end_, kMaxReadBytes - end_};
}

std::size_t TlsSession::decrypt(std::span<std::byte> into, boost::system::error_code& error) {
  error.clear();
  std::size_t total = 0;
  while (total < into.size() && !failure_) {
    ERR_clear_error();
    std::size_t n = 0;
    const int result = SSL_read_ex(ssl_, into.data() + total, into.size() - total, &n);
    if (result == 1) {
      total += n;
      continue;
    }
    const int ssl_error = SSL_get_error(ssl_, result);
    if (ssl_error == SSL_ERROR_WANT_READ) break;
    failure_ = ssl_error == SSL_ERROR_ZERO_RETURN
                   ? boost::system::error_code(boost::asio::error::eof)
                   : error_of(ssl_error);
  }
  if (total == 0) error = failure_;
  return total;
}

boost::system::error_code TlsSession::error_of(int ssl_error) const {
  // The first error of OpenSSL's queue, as Asio's SSL stream reports it.
  const unsigned long code = ERR_get_error();
  ERR_clear_error();
  if (code != 0) return {static_cast<int>(code), boost::asio::error::get_ssl_category()};
  if (ssl_error == SSL_ERROR_ZERO_RETURN) return boost::asio::error::eof;
  return boost::asio::error::connection_aborted;
}

}  // namespace pulseloco::transport::tcp
