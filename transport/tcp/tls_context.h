// Internal: the TLS 1.3 configuration shared by every link of one transport, rendezvous server,
// coordinator or membership client (docs/operations.md, "Encrypted links").
//
// Keyed from the shared secret: an external pre-shared key (RFC 8446 section 2.2), derived as
// HKDF-SHA256(secret, info = "pulseloco tls13 external psk v1"), offered by the client under a
// fixed identity and looked up by the server; the handshake still runs an (EC)DHE exchange
// (psk_dhe_ke), so a recorded session stays secret even if the secret leaks later. Keyed from
// certificates: both ends present a certificate chaining to the configured CA and verify the
// other's (no host name check: every holder of a certificate from that CA is a member).
// Either way: TLS 1.3 only, the one cipher suite TLS_AES_128_GCM_SHA256, no session
// tickets, no renegotiation, no compression.
#pragma once

// Boost 1.74's awaitable.hpp uses std::exchange without including <utility>.
#include <utility>

#include <boost/asio/ssl/context.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include <pulseloco/transport/tcp/tcp_options.h>

namespace pulseloco::transport::tcp {

class TlsContext {
 public:
  // The context for this security, or null when links are not encrypted (effective security
  // none or hmac). Throws InvalidArgument naming the variable and the file when a certificate,
  // key or CA file cannot be read or parsed, or the key does not match the certificate.
  [[nodiscard]] static std::shared_ptr<TlsContext> make(LinkSecurity requested,
                                                        const std::string& secret,
                                                        const TlsFiles& tls_files);
  [[nodiscard]] static std::shared_ptr<TlsContext> make(const TcpOptions& options) {
    return make(options.link_security, options.secret, options.tls_files);
  }

  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  [[nodiscard]] boost::asio::ssl::context& context() noexcept { return context_; }
  [[nodiscard]] bool uses_certificates() const noexcept { return uses_certificates_; }

 private:
  TlsContext();

  boost::asio::ssl::context context_;
  bool uses_certificates_ = false;
  std::array<std::uint8_t, 32> psk_{};  // from the secret (PSK mode)

  friend struct TlsCallbacks;
};

}  // namespace pulseloco::transport::tcp
