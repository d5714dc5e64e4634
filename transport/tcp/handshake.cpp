#include <pulseloco/transport/tcp/handshake.h>

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>
#include <vector>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::transport::tcp {
namespace {

constexpr std::array<std::uint8_t, 8> kHelloMagic = {'P', 'L', 'O', 'C', 'O', 'H', 'S', '1'};
constexpr std::uint8_t kHandshakeVersion = 1;
constexpr std::string_view kServerLabel = "pulseloco-server-v1";
constexpr std::string_view kClientLabel = "pulseloco-client-v1";

enum class VerdictStatus : std::uint8_t { accepted = 0, authentication_failed = 1, refused = 2 };

using HelloBytes = std::array<std::uint8_t, kHelloBytes>;

HelloBytes encode_hello(const Hello& hello) {
  HelloBytes out{};
  ByteWriter(std::as_writable_bytes(std::span(out)))
      .put_bytes(kHelloMagic)
      .put(kHandshakeVersion)
      .put(hello.purpose)
      .zeros(2)
      .put(hello.src_rank)
      .put(hello.dst_rank)
      .put(hello.world_size)
      .put(hello.lane)
      .put(hello.lanes)
      .put_bytes(hello.group_id)
      .put_bytes(hello.nonce)
      .zeros(4);
  return out;
}

Hello decode_hello(const HelloBytes& bytes) {
  ByteReader in(bytes);
  std::array<std::uint8_t, kHelloMagic.size()> magic{};
  in.get_bytes(magic, "magic");
  if (magic != kHelloMagic) throw ProtocolError("not a pulseloco connection (bad handshake magic)");
  const auto version = in.get<std::uint8_t>("version");
  if (version != kHandshakeVersion)
    throw ProtocolError(fmt::format("unsupported handshake version {} (this build speaks {})",
                                    version, kHandshakeVersion));
  const auto purpose = in.get<std::uint8_t>("purpose");
  if (purpose != static_cast<std::uint8_t>(Purpose::rendezvous) &&
      purpose != static_cast<std::uint8_t>(Purpose::data) &&
      purpose != static_cast<std::uint8_t>(Purpose::membership) &&
      purpose != static_cast<std::uint8_t>(Purpose::patch_push))
    throw ProtocolError(fmt::format("unknown connection purpose {}", purpose));
  Hello hello;
  hello.purpose = static_cast<Purpose>(purpose);
  in.skip(2, "reserved");
  hello.src_rank = in.get<std::uint32_t>("source rank");
  hello.dst_rank = in.get<std::uint32_t>("destination rank");
  hello.world_size = in.get<std::uint32_t>("world size");
  hello.lane = in.get<std::uint16_t>("connection");
  hello.lanes = in.get<std::uint16_t>("connections");
  in.get_bytes(hello.group_id, "group id");
  in.get_bytes(hello.nonce, "nonce");
  return hello;
}

Nonce random_nonce() {
  Nonce nonce{};
  if (RAND_bytes(nonce.data(), static_cast<int>(nonce.size())) != 1)
    throw IoError("OpenSSL RAND_bytes failed to produce a handshake nonce");
  return nonce;
}

Mac proof(std::string_view secret, std::string_view label, const HelloBytes& hello,
          const Nonce& server_nonce) {
  std::vector<std::uint8_t> message;
  message.reserve(label.size() + hello.size() + server_nonce.size());
  message.insert(message.end(), label.begin(), label.end());
  message.insert(message.end(), hello.begin(), hello.end());
  message.insert(message.end(), server_nonce.begin(), server_nonce.end());
  return hmac_sha256(secret, message);
}

bool equal_macs(const Mac& a, const Mac& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

asio::awaitable<HandshakeTraffic> client_exchange(LinkStream& socket, Hello hello,
                                                  std::string_view secret);

// TLS refused the peer, or the peer refused us: what that means for this link's keying. A
// server cannot tell a peer with another key or CA from one that does not speak TLS at all.
[[noreturn]] void tls_refused(const LinkStream& link, const boost::system::system_error& error,
                              bool server) {
  std::string_view meaning;
  if (server) {
    meaning = link.uses_certificates()
                  ? "the client has no certificate signed by our CA, or does not speak TLS"
                  : "the client does not hold our shared secret, or does not speak TLS";
  } else {
    meaning = link.uses_certificates()
                  ? "the peer's certificate is not signed by our CA, or ours is not by its"
                  : "the shared secrets differ";
  }
  throw HandshakeRefused(fmt::format("authentication failed: TLS refused the connection ({}): {}",
                                     error.code().message(), meaning));
}

}  // namespace

Mac hmac_sha256(std::string_view key, std::span<const std::uint8_t> message) {
  Mac out{};
  unsigned int length = 0;
  // A non-null key pointer even for the empty key: OpenSSL treats a null key as "reuse".
  static constexpr std::uint8_t kEmpty = 0;
  const void* key_data = key.empty() ? static_cast<const void*>(&kEmpty) : key.data();
  if (HMAC(EVP_sha256(), key_data, static_cast<int>(key.size()), message.data(), message.size(),
           out.data(), &length) == nullptr ||
      length != out.size())
    throw IoError("OpenSSL HMAC-SHA256 failed");
  return out;
}

asio::awaitable<HandshakeTraffic> client_handshake(LinkStream& stream, Hello hello,
                                                   std::string_view secret) {
  try {
    co_await stream.secure(asio::ssl::stream_base::client);
    co_return co_await client_exchange(stream, hello, secret);
  } catch (const boost::system::system_error& error) {
    // Under TLS 1.3 the server checks our certificate after our side of the handshake is
    // done: its refusal arrives as an alert on the first read of the exchange.
    if (!is_tls_refusal(error.code())) throw;
    tls_refused(stream, error, false);
  }
}

namespace {

asio::awaitable<HandshakeTraffic> client_exchange(LinkStream& socket, Hello hello,
                                                  std::string_view secret) {
  HandshakeTraffic traffic;
  hello.nonce = random_nonce();
  const HelloBytes hello_bytes = encode_hello(hello);
  traffic.bytes_sent +=
      co_await asio::async_write(socket, asio::buffer(hello_bytes), asio::use_awaitable);

  std::array<std::uint8_t, kChallengeBytes> challenge{};
  traffic.bytes_received +=
      co_await asio::async_read(socket, asio::buffer(challenge), asio::use_awaitable);
  Nonce server_nonce{};
  Mac server_mac{};
  std::memcpy(server_nonce.data(), challenge.data(), server_nonce.size());
  std::memcpy(server_mac.data(), challenge.data() + server_nonce.size(), server_mac.size());
  const bool server_proved =
      equal_macs(server_mac, proof(secret, kServerLabel, hello_bytes, server_nonce));

  // Answer even when the server's proof was wrong, so that the server can log precisely why it
  // drops us; our proof is bound to its nonce and useless elsewhere.
  const Mac response = proof(secret, kClientLabel, hello_bytes, server_nonce);
  traffic.bytes_sent +=
      co_await asio::async_write(socket, asio::buffer(response), asio::use_awaitable);
  if (!server_proved)
    throw HandshakeRefused(
        "authentication failed: the peer's proof does not match our secret (the shared secrets "
        "differ)");

  std::array<std::byte, kVerdictHeaderBytes> verdict{};
  traffic.bytes_received +=
      co_await asio::async_read(socket, asio::buffer(verdict), asio::use_awaitable);
  ByteReader in(verdict);
  const auto status = in.get<std::uint8_t>("verdict");
  in.skip(1, "reserved");
  const std::size_t reason_bytes =
      std::min<std::size_t>(in.get<std::uint16_t>("reason length"), kMaxVerdictReasonBytes);
  std::string reason(reason_bytes, '\0');
  if (reason_bytes > 0)
    traffic.bytes_received +=
        co_await asio::async_read(socket, asio::buffer(reason), asio::use_awaitable);
  switch (static_cast<VerdictStatus>(status)) {
    case VerdictStatus::accepted:
      co_return traffic;
    case VerdictStatus::authentication_failed:
      throw HandshakeRefused(
          "authentication failed: the peer rejected our proof (the shared secrets differ)");
    case VerdictStatus::refused:
      throw HandshakeRefused(fmt::format("the peer refused the connection: {}", reason));
  }
  throw ProtocolError(fmt::format("unknown handshake verdict {}", status));
}

}  // namespace

asio::awaitable<ServerHandshake> server_handshake(
    LinkStream& socket, std::string_view secret,
    const std::function<std::string(const Hello&)>& admit) {
  try {
    co_await socket.secure(asio::ssl::stream_base::server);
  } catch (const boost::system::system_error& error) {
    if (!is_tls_refusal(error.code())) throw;
    tls_refused(socket, error, true);
  }
  ServerHandshake result;
  HelloBytes hello_bytes{};
  result.traffic.bytes_received +=
      co_await asio::async_read(socket, asio::buffer(hello_bytes), asio::use_awaitable);
  result.hello = decode_hello(hello_bytes);

  const Nonce server_nonce = random_nonce();
  const Mac server_mac = proof(secret, kServerLabel, hello_bytes, server_nonce);
  std::array<std::uint8_t, kChallengeBytes> challenge{};
  std::memcpy(challenge.data(), server_nonce.data(), server_nonce.size());
  std::memcpy(challenge.data() + server_nonce.size(), server_mac.data(), server_mac.size());
  result.traffic.bytes_sent +=
      co_await asio::async_write(socket, asio::buffer(challenge), asio::use_awaitable);

  Mac response{};
  result.traffic.bytes_received +=
      co_await asio::async_read(socket, asio::buffer(response), asio::use_awaitable);

  VerdictStatus status = VerdictStatus::accepted;
  if (!equal_macs(response, proof(secret, kClientLabel, hello_bytes, server_nonce))) {
    status = VerdictStatus::authentication_failed;
    result.refusal = "authentication failed (its proof does not match our secret)";
  } else if (auto reason = admit(result.hello); !reason.empty()) {
    status = VerdictStatus::refused;
    result.refusal = std::move(reason);
  }
  // Only an authenticated client learns why it was refused.
  const std::string_view reason =
      status == VerdictStatus::refused
          ? std::string_view(result.refusal).substr(0, kMaxVerdictReasonBytes)
          : std::string_view{};
  std::array<std::byte, kVerdictHeaderBytes> verdict{};
  ByteWriter(verdict).put(status).zeros(1).put(static_cast<std::uint16_t>(reason.size()));
  const std::array<asio::const_buffer, 2> message{asio::buffer(verdict),
                                                  asio::buffer(reason.data(), reason.size())};
  result.traffic.bytes_sent += co_await asio::async_write(socket, message, asio::use_awaitable);
  result.accepted = status == VerdictStatus::accepted;
  co_return result;
}

}  // namespace pulseloco::transport::tcp
