// Internal: mutual authentication of a new TCP connection (rendezvous and data plane alike): an
// HMAC-SHA256 challenge-response over the shared secret, with fresh 32-byte nonces from
// OpenSSL's RAND_bytes on both sides and constant-time comparison (CRYPTO_memcmp).
//
//   client -> server  hello     (80 bytes): magic, purpose, ranks, lane, group id, client nonce
//   server -> client  challenge (64 bytes): server nonce,
//                                           HMAC(K, "pulseloco-server-v1" | hello | server nonce)
//   client -> server  response  (32 bytes): HMAC(K, "pulseloco-client-v1" | hello | server nonce)
//   server -> client  verdict   (4 + n):    accepted | authentication failed | refused + reason
//
// Each side proves knowledge of K over a nonce the other side chose, so neither proof can be
// replayed. The server decides on the hello's claims (rank, lane, group) only after the client
// proved itself. This authenticates peers; it does not encrypt or sign the data that follows
// (frame checksums detect corruption, not tampering): with TLS (link_stream.h) the handshake
// runs inside the encrypted stream, after TLS has authenticated the peer in its own way.
//
// A client whose link security is not the server's (plaintext against TLS, either way round)
// cannot run any of this: the server answers with a 16-byte notice of its own security instead
// (in plaintext; to a TLS client it is no TLS record) and closes, and both sides fail with
// HandshakeRefused naming the mismatch.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/group_table.h>
#include <pulseloco/transport/tcp/link_stream.h>

namespace pulseloco::transport::tcp {

inline constexpr std::size_t kHelloBytes = 80;
inline constexpr std::size_t kChallengeBytes = 64;
inline constexpr std::size_t kResponseBytes = 32;
inline constexpr std::size_t kVerdictHeaderBytes = 4;
inline constexpr std::size_t kMaxVerdictReasonBytes = 512;

// patch_push: a subscriber of a patch push server (src/patch/push_server.h).
enum class Purpose : std::uint8_t { rendezvous = 1, data = 2, membership = 3, patch_push = 4 };

using Nonce = std::array<std::uint8_t, 32>;
using Mac = std::array<std::uint8_t, 32>;

struct Hello {
  Purpose purpose = Purpose::data;
  std::uint32_t src_rank = 0;  // the connecting rank
  std::uint32_t dst_rank = 0;  // the rank it means to reach
  std::uint32_t world_size = 0;
  std::uint16_t lane = 0;   // which of the connections to that peer
  std::uint16_t lanes = 0;  // connections per peer the client uses
  GroupId group_id{};
  Nonce nonce{};
};

// Bytes a handshake moved, for TransportStats.
struct HandshakeTraffic {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
};

// Thrown by client_handshake when the server does not prove knowledge of our secret, refuses us
// or secures its links otherwise (TLS against plaintext); what() says which. A refusal is the
// server's answer, not a failure of the network: retrying cannot change it.
struct HandshakeRefused : ProtocolError {
  using ProtocolError::ProtocolError;
};

// Client side, after the TLS handshake of an encrypted stream. Fills hello.nonce. Throws
// HandshakeRefused when TLS refused the server or us (wrong key or certificate), the server's
// proof is wrong (the secrets differ), the server refused us (with its reason) or its link
// security is not ours, boost::system::system_error on I/O failure.
[[nodiscard]] asio::awaitable<HandshakeTraffic> client_handshake(LinkStream& stream, Hello hello,
                                                                 std::string_view secret);

struct ServerHandshake {
  Hello hello;
  bool accepted = false;
  std::string refusal;  // why not accepted
  HandshakeTraffic traffic;
};

// Server side, after the TLS handshake of an encrypted stream. `admit` is called once the client
// has proved knowledge of the secret; it returns an empty string to accept (and may claim resources
// then) or the reason for refusing. Throws HandshakeRefused when TLS refused the client (wrong key
// or certificate), ProtocolError on a malformed hello, boost::system::system_error on I/O failure.
[[nodiscard]] asio::awaitable<ServerHandshake> server_handshake(
    LinkStream& socket, std::string_view secret,
    const std::function<std::string(const Hello&)>& admit);

// HMAC-SHA256 (exposed for tests).
[[nodiscard]] Mac hmac_sha256(std::string_view key, std::span<const std::uint8_t> message);

}  // namespace pulseloco::transport::tcp
