#include <pulseloco/transport/tcp/tls_context.h>

#include <fmt/format.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>

#include <fstream>
#include <string_view>

#include <pulseloco/base/errors.h>

namespace pulseloco::transport::tcp {
namespace {

constexpr std::string_view kPskIdentity = "pulseloco-psk-v1";
constexpr std::string_view kPskLabel = "pulseloco tls13 external psk v1";
constexpr const char* kCipherSuite = "TLS_AES_128_GCM_SHA256";
constexpr std::array<unsigned char, 2> kCipherSuiteId = {0x13, 0x01};  // TLS_AES_128_GCM_SHA256

int context_index() {
  static const int index = SSL_CTX_get_ex_new_index(0, nullptr, nullptr, nullptr, nullptr);
  return index;
}

// The reason of the last OpenSSL error (and clears the queue).
std::string openssl_reason() {
  const unsigned long code = ERR_peek_last_error();
  ERR_clear_error();
  if (code == 0) return "unknown OpenSSL error";
  std::array<char, 256> text{};
  ERR_error_string_n(code, text.data(), text.size());
  return text.data();
}

[[noreturn]] void bad_file(const char* variable, const std::string& path, std::string_view what,
                           const std::string& reason) {
  throw InvalidArgument(fmt::format("{}='{}': {} ({})", variable, path, what, reason));
}

void require_readable(const char* variable, const std::string& path) {
  if (!std::ifstream(path)) bad_file(variable, path, "the file cannot be opened", "not readable");
}

std::array<std::uint8_t, 32> derive_psk(const std::string& secret) {
  std::array<std::uint8_t, 32> key{};
  std::size_t length = key.size();
  EVP_PKEY_CTX* kdf = EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr);
  const bool ok =
      kdf != nullptr && EVP_PKEY_derive_init(kdf) == 1 &&
      EVP_PKEY_CTX_set_hkdf_md(kdf, EVP_sha256()) == 1 &&
      EVP_PKEY_CTX_set1_hkdf_key(kdf, reinterpret_cast<const unsigned char*>(secret.data()),
                                 static_cast<int>(secret.size())) == 1 &&
      EVP_PKEY_CTX_add1_hkdf_info(kdf, reinterpret_cast<const unsigned char*>(kPskLabel.data()),
                                  static_cast<int>(kPskLabel.size())) == 1 &&
      EVP_PKEY_derive(kdf, key.data(), &length) == 1 && length == key.size();
  EVP_PKEY_CTX_free(kdf);
  if (!ok) throw IoError("TLS: OpenSSL HKDF-SHA256 failed to derive the pre-shared key");
  return key;
}

}  // namespace

// OpenSSL's callbacks for the external PSK (SSL_CTX_set_psk_use_session_callback and
// SSL_CTX_set_psk_find_session_callback): a session carrying the derived key.
struct TlsCallbacks {
  static const TlsContext& of(SSL* ssl) {
    return *static_cast<const TlsContext*>(
        SSL_CTX_get_ex_data(SSL_get_SSL_CTX(ssl), context_index()));
  }

  static SSL_SESSION* psk_session(SSL* ssl) {
    const SSL_CIPHER* cipher = SSL_CIPHER_find(ssl, kCipherSuiteId.data());
    SSL_SESSION* session = cipher != nullptr ? SSL_SESSION_new() : nullptr;
    if (session == nullptr) return nullptr;
    const auto& psk = of(ssl).psk_;
    if (SSL_SESSION_set1_master_key(session, psk.data(), psk.size()) != 1 ||
        SSL_SESSION_set_cipher(session, cipher) != 1 ||
        SSL_SESSION_set_protocol_version(session, TLS1_3_VERSION) != 1) {
      SSL_SESSION_free(session);
      return nullptr;
    }
    return session;
  }

  // Client: offer the PSK (again after a HelloRetryRequest, when `md` is the digest chosen).
  static int use_session(SSL* ssl, const EVP_MD* md, const unsigned char** identity,
                         std::size_t* identity_length, SSL_SESSION** session) {
    *session = nullptr;
    if (md != nullptr && EVP_MD_get_type(md) != NID_sha256) return 1;  // no PSK fits
    *session = psk_session(ssl);
    if (*session == nullptr) return 0;
    *identity = reinterpret_cast<const unsigned char*>(kPskIdentity.data());
    *identity_length = kPskIdentity.size();
    return 1;
  }

  // Server: the PSK for our identity; none for another (the handshake then fails: there is no
  // certificate to fall back on).
  static int find_session(SSL* ssl, const unsigned char* identity, std::size_t identity_length,
                          SSL_SESSION** session) {
    *session = nullptr;
    if (std::string_view(reinterpret_cast<const char*>(identity), identity_length) != kPskIdentity)
      return 1;
    *session = psk_session(ssl);
    return *session != nullptr ? 1 : 0;
  }
};

TlsContext::TlsContext() : context_(boost::asio::ssl::context::tls) {}

std::shared_ptr<TlsContext> TlsContext::make(LinkSecurity requested, const std::string& secret,
                                             const TlsFiles& tls_files) {
  validate_link_security(requested, secret, tls_files);
  if (effective_link_security(requested, secret, tls_files) != LinkSecurity::tls) return nullptr;
  std::shared_ptr<TlsContext> tls(new TlsContext());
  SSL_CTX* ctx = tls->context_.native_handle();
  const auto fail = [](std::string_view what) {
    throw IoError(fmt::format("TLS: OpenSSL could not {} ({})", what, openssl_reason()));
  };
  if (SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) != 1 ||
      SSL_CTX_set_max_proto_version(ctx, TLS1_3_VERSION) != 1)
    fail("restrict the context to TLS 1.3");
  if (SSL_CTX_set_ciphersuites(ctx, kCipherSuite) != 1) fail("select the cipher suite");
  SSL_CTX_set_options(ctx, SSL_OP_NO_TICKET | SSL_OP_NO_COMPRESSION | SSL_OP_NO_RENEGOTIATION);
  // No NewSessionTicket after the handshake: a ticket would be written by whichever side writes
  // first, from inside a read (docs: link_stream.h, why reads must never write).
  if (SSL_CTX_set_num_tickets(ctx, 0) != 1) fail("disable session tickets");
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
  // A passphrase-protected key fails to load instead of prompting on the terminal.
  SSL_CTX_set_default_passwd_cb(ctx, [](char*, int, int, void*) { return 0; });

  if (!tls_files.empty()) {
    tls->uses_certificates_ = true;
    require_readable("PULSELOCO_TLS_CERT", tls_files.cert);
    require_readable("PULSELOCO_TLS_KEY", tls_files.key);
    require_readable("PULSELOCO_TLS_CA", tls_files.ca);
    if (SSL_CTX_use_certificate_chain_file(ctx, tls_files.cert.c_str()) != 1)
      bad_file("PULSELOCO_TLS_CERT", tls_files.cert, "not a PEM certificate chain",
               openssl_reason());
    EVP_PKEY* key = nullptr;
    if (BIO* file = BIO_new_file(tls_files.key.c_str(), "r"); file != nullptr) {
      key = PEM_read_bio_PrivateKey(file, nullptr, nullptr, nullptr);
      BIO_free(file);
    }
    if (key == nullptr)
      bad_file("PULSELOCO_TLS_KEY", tls_files.key, "not an unencrypted PEM private key",
               openssl_reason());
    const bool matches =
        SSL_CTX_use_PrivateKey(ctx, key) == 1 && SSL_CTX_check_private_key(ctx) == 1;
    EVP_PKEY_free(key);
    if (!matches)
      bad_file("PULSELOCO_TLS_KEY", tls_files.key,
               fmt::format("not the key of the certificate in '{}'", tls_files.cert),
               openssl_reason());
    if (SSL_CTX_load_verify_locations(ctx, tls_files.ca.c_str(), nullptr) != 1)
      bad_file("PULSELOCO_TLS_CA", tls_files.ca, "not a PEM CA certificate", openssl_reason());
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
    return tls;
  }
  tls->psk_ = derive_psk(secret);
  if (SSL_CTX_set_ex_data(ctx, context_index(), tls.get()) != 1) fail("attach the key");
  SSL_CTX_set_psk_use_session_callback(ctx, &TlsCallbacks::use_session);
  SSL_CTX_set_psk_find_session_callback(ctx, &TlsCallbacks::find_session);
  return tls;
}

}  // namespace pulseloco::transport::tcp
