#include <pulseloco/transport/tcp/handshake.h>

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/ssl.h>

#include <algorithm>
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

// What a server sends, in its client's terms, when the client's link security is not its own
// (TLS against plaintext), and then closes: a plaintext client reads it where the challenge was
// due, a TLS client's OpenSSL finds it is no TLS record. Only the security mode is revealed,
// which any stranger learns by connecting.
//   notice (16 bytes): magic "PLOCOLS1", the server's links (1 plaintext, 2 TLS), 7 zero bytes
constexpr std::array<std::uint8_t, 8> kNoticeMagic = {'P', 'L', 'O', 'C', 'O', 'L', 'S', '1'};
constexpr std::size_t kNoticeBytes = 16;
constexpr std::uint8_t kNoticePlaintext = 1;
constexpr std::uint8_t kNoticeTls = 2;
static_assert(kNoticeBytes < kChallengeBytes, "a notice must be shorter than a challenge");

// The two sides' views of a mismatch; the client's is what it fails with.
constexpr std::string_view kServerSpeaksTls =
    "link security differs: the server's links use TLS and ours are plaintext (set the same "
    "PULSELOCO_LINK_SECURITY, PULSELOCO_SAME_HOST_PLAINTEXT and secret on both sides: no "
    "secret, or hmac, means plaintext)";
constexpr std::string_view kServerSpeaksPlaintext =
    "link security differs: the server's links are plaintext and ours use TLS (set the same "
    "PULSELOCO_LINK_SECURITY, PULSELOCO_SAME_HOST_PLAINTEXT and secret on both sides: no "
    "secret, or hmac, means plaintext)";
constexpr std::string_view kClientSpeaksPlaintext =
    "link security differs: the client speaks plaintext (no secret, or "
    "PULSELOCO_LINK_SECURITY=hmac) and our links use TLS";
constexpr std::string_view kClientSpeaksTls =
    "link security differs: the client speaks TLS and our links are plaintext (no secret, or "
    "PULSELOCO_LINK_SECURITY=hmac)";

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

std::array<std::uint8_t, kNoticeBytes> encode_notice(std::uint8_t server_links) {
  std::array<std::uint8_t, kNoticeBytes> out{};
  ByteWriter(std::as_writable_bytes(std::span(out)))
      .put_bytes(kNoticeMagic)
      .put(server_links)
      .zeros(kNoticeBytes - kNoticeMagic.size() - 1);
  return out;
}

// Sends the notice on the bare socket, ends our sending side and throws HandshakeRefused with
// `why`. The caller has read everything the client sent, so that closing sends no reset that
// could overtake the notice.
asio::awaitable<void> refuse_with_notice(Socket& socket, std::uint8_t server_links,
                                         std::string_view why) {
  const auto notice = encode_notice(server_links);
  boost::system::error_code ignored;
  co_await asio::async_write(socket, asio::buffer(notice),
                             asio::redirect_error(asio::use_awaitable, ignored));
  socket.shutdown(Socket::shutdown_send, ignored);
  throw HandshakeRefused(why);
}

// A TLS server's first look at its client, before OpenSSL reads anything: a client that speaks
// the handshake in plaintext is refused with a notice it understands.
asio::awaitable<void> refuse_plaintext_client(LinkStream& link) {
  std::uint8_t first = 0;
  boost::system::error_code error;
  (void)co_await link.socket().async_receive(asio::buffer(&first, 1), Socket::message_peek,
                                             asio::redirect_error(asio::use_awaitable, error));
  if (error || first != kHelloMagic[0]) co_return;  // TLS (or nothing): OpenSSL's to judge
  HelloBytes hello{};
  co_await asio::async_read(link.socket(), asio::buffer(hello), asio::use_awaitable);
  if (!std::equal(kHelloMagic.begin(), kHelloMagic.end(), hello.begin()))
    throw ProtocolError("not a pulseloco connection (neither TLS nor the handshake)");
  co_await refuse_with_notice(link.socket(), kNoticeTls, kClientSpeaksPlaintext);
}

// A plaintext server's look at a hello that is no hello: a TLS ClientHello (a handshake record,
// TLS major version 3, message type 1) is refused with a notice, the rest of its record read
// first.
asio::awaitable<void> refuse_tls_client(LinkStream& link, const HelloBytes& hello) {
  constexpr std::size_t kRecordHeaderBytes = 5;
  constexpr std::size_t kMaxRecordBytes = (std::size_t{1} << 14) + 2048;  // RFC 8446 5.2
  if (hello[0] != 0x16 || hello[1] != 0x03 || hello[5] != 0x01) co_return;
  const std::size_t record = kRecordHeaderBytes + ((std::size_t{hello[3]} << 8) | hello[4]);
  if (record > kRecordHeaderBytes + kMaxRecordBytes) co_return;
  if (record > hello.size()) {
    std::vector<std::uint8_t> rest(record - hello.size());
    co_await asio::async_read(link.socket(), asio::buffer(rest), asio::use_awaitable);
  }
  co_await refuse_with_notice(link.socket(), kNoticePlaintext, kClientSpeaksTls);
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
    co_await stream.secure(LinkStream::Role::client);
    co_return co_await client_exchange(stream, hello, secret);
  } catch (const boost::system::system_error& error) {
    // Under TLS 1.3 the server checks our certificate after our side of the handshake is
    // done: its refusal arrives as an alert on the first read of the exchange.
    if (!is_tls_refusal(error.code())) throw;
    // What a plaintext server's notice is to OpenSSL: the answer is no TLS record at all.
    if (ERR_GET_REASON(static_cast<unsigned long>(error.code().value())) ==
        SSL_R_WRONG_VERSION_NUMBER)
      throw HandshakeRefused(kServerSpeaksPlaintext);
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
  boost::system::error_code read_error;
  const std::size_t challenge_read = co_await asio::async_read(
      socket, asio::buffer(challenge), asio::redirect_error(asio::use_awaitable, read_error));
  traffic.bytes_received += challenge_read;
  if (read_error) {
    // A TLS server's notice, then the end of the stream: never a challenge, which is longer.
    if (!socket.encrypted() && challenge_read == kNoticeBytes &&
        std::equal(kNoticeMagic.begin(), kNoticeMagic.end(), challenge.begin()) &&
        challenge[kNoticeMagic.size()] == kNoticeTls)
      throw HandshakeRefused(kServerSpeaksTls);
    throw boost::system::system_error(read_error);
  }
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
  if (socket.encrypted()) co_await refuse_plaintext_client(socket);
  try {
    co_await socket.secure(LinkStream::Role::server);
  } catch (const boost::system::system_error& error) {
    if (!is_tls_refusal(error.code())) throw;
    tls_refused(socket, error, true);
  }
  ServerHandshake result;
  HelloBytes hello_bytes{};
  result.traffic.bytes_received +=
      co_await asio::async_read(socket, asio::buffer(hello_bytes), asio::use_awaitable);
  if (!socket.encrypted()) co_await refuse_tls_client(socket, hello_bytes);
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
