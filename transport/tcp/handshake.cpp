#include <pulseloco/transport/tcp/handshake.h>

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>
#include <vector>

#include <pulseloco/base/errors.h>

namespace pulseloco::transport::tcp {
namespace {

constexpr std::array<std::uint8_t, 8> kHelloMagic = {'P', 'L', 'O', 'C', 'O', 'H', 'S', '1'};
constexpr std::uint8_t kHandshakeVersion = 1;
constexpr std::string_view kServerLabel = "pulseloco-server-v1";
constexpr std::string_view kClientLabel = "pulseloco-client-v1";

enum class VerdictStatus : std::uint8_t { accepted = 0, authentication_failed = 1, refused = 2 };

void put_u16(std::uint8_t* out, std::uint16_t v) {
  for (int i = 0; i < 2; ++i)
    out[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
void put_u32(std::uint8_t* out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i)
    out[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint16_t get_u16(const std::uint8_t* in) {
  return static_cast<std::uint16_t>(in[0] | (in[1] << 8));
}
std::uint32_t get_u32(const std::uint8_t* in) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i)
    v = (v << 8) | in[i];
  return v;
}

using HelloBytes = std::array<std::uint8_t, kHelloBytes>;

HelloBytes encode_hello(const Hello& hello) {
  HelloBytes out{};
  std::memcpy(out.data(), kHelloMagic.data(), kHelloMagic.size());
  out[8] = kHandshakeVersion;
  out[9] = static_cast<std::uint8_t>(hello.purpose);
  put_u16(out.data() + 10, 0);
  put_u32(out.data() + 12, hello.src_rank);
  put_u32(out.data() + 16, hello.dst_rank);
  put_u32(out.data() + 20, hello.world_size);
  put_u16(out.data() + 24, hello.lane);
  put_u16(out.data() + 26, hello.lanes);
  std::memcpy(out.data() + 28, hello.group_id.data(), hello.group_id.size());
  std::memcpy(out.data() + 44, hello.nonce.data(), hello.nonce.size());
  return out;  // bytes 76..79 stay zero
}

Hello decode_hello(const HelloBytes& in) {
  if (std::memcmp(in.data(), kHelloMagic.data(), kHelloMagic.size()) != 0)
    throw ProtocolError("not a pulseloco connection (bad handshake magic)");
  if (in[8] != kHandshakeVersion)
    throw ProtocolError(fmt::format("unsupported handshake version {} (this build speaks {})",
                                    in[8], kHandshakeVersion));
  if (in[9] != static_cast<std::uint8_t>(Purpose::rendezvous) &&
      in[9] != static_cast<std::uint8_t>(Purpose::data) &&
      in[9] != static_cast<std::uint8_t>(Purpose::membership))
    throw ProtocolError(fmt::format("unknown connection purpose {}", in[9]));
  Hello hello;
  hello.purpose = static_cast<Purpose>(in[9]);
  hello.src_rank = get_u32(in.data() + 12);
  hello.dst_rank = get_u32(in.data() + 16);
  hello.world_size = get_u32(in.data() + 20);
  hello.lane = get_u16(in.data() + 24);
  hello.lanes = get_u16(in.data() + 26);
  std::memcpy(hello.group_id.data(), in.data() + 28, hello.group_id.size());
  std::memcpy(hello.nonce.data(), in.data() + 44, hello.nonce.size());
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

asio::awaitable<HandshakeTraffic> client_handshake(Socket& socket, Hello hello,
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

  std::array<std::uint8_t, kVerdictHeaderBytes> verdict{};
  traffic.bytes_received +=
      co_await asio::async_read(socket, asio::buffer(verdict), asio::use_awaitable);
  const std::size_t reason_bytes =
      std::min<std::size_t>(get_u16(verdict.data() + 2), kMaxVerdictReasonBytes);
  std::string reason(reason_bytes, '\0');
  if (reason_bytes > 0)
    traffic.bytes_received +=
        co_await asio::async_read(socket, asio::buffer(reason), asio::use_awaitable);
  switch (static_cast<VerdictStatus>(verdict[0])) {
    case VerdictStatus::accepted:
      co_return traffic;
    case VerdictStatus::authentication_failed:
      throw HandshakeRefused(
          "authentication failed: the peer rejected our proof (the shared secrets differ)");
    case VerdictStatus::refused:
      throw HandshakeRefused(fmt::format("the peer refused the connection: {}", reason));
  }
  throw ProtocolError(fmt::format("unknown handshake verdict {}", verdict[0]));
}

asio::awaitable<ServerHandshake> server_handshake(
    Socket& socket, std::string_view secret,
    const std::function<std::string(const Hello&)>& admit) {
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
  std::array<std::uint8_t, kVerdictHeaderBytes> verdict{};
  verdict[0] = static_cast<std::uint8_t>(status);
  verdict[2] = static_cast<std::uint8_t>(reason.size());
  verdict[3] = static_cast<std::uint8_t>(reason.size() >> 8);
  const std::array<asio::const_buffer, 2> message{asio::buffer(verdict),
                                                  asio::buffer(reason.data(), reason.size())};
  result.traffic.bytes_sent += co_await asio::async_write(socket, message, asio::use_awaitable);
  result.accepted = status == VerdictStatus::accepted;
  co_return result;
}

}  // namespace pulseloco::transport::tcp
