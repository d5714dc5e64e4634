// Options of the TCP transport (tcp_transport.h). The group layer carries them as
// group::TransportOptions::tcp and reads each from a PULSELOCO_TCP_* variable
// (docs/operations.md, "Environment variables").
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace pulseloco::transport {

// How a TCP link (data plane, rendezvous, membership coordinator) is protected
// (docs/operations.md, "Encrypted links").
enum class LinkSecurity : std::uint8_t {
  automatic,  // tls when a secret or certificates are set, none otherwise
  none,       // plaintext and unauthenticated: no secret and no certificates
  hmac,       // plaintext; peers prove knowledge of the secret (HMAC challenge-response)
  tls,        // TLS 1.3 keyed from the secret (external PSK) or the certificates, with the
              // HMAC challenge-response inside it
};

// PEM files for TLS with certificates (all three or none): this process's certificate chain,
// its private key, and the CA that every peer's certificate must chain to. Without them TLS is
// keyed from the shared secret.
struct TlsFiles {
  std::string cert;  // PULSELOCO_TLS_CERT
  std::string key;   // PULSELOCO_TLS_KEY
  std::string ca;    // PULSELOCO_TLS_CA
  [[nodiscard]] bool empty() const noexcept { return cert.empty() && key.empty() && ca.empty(); }
};

// What `requested` means with this secret and these files: automatic resolves to tls or none,
// hmac without a secret is none. Never returns automatic.
[[nodiscard]] LinkSecurity effective_link_security(LinkSecurity requested,
                                                   const std::string& secret,
                                                   const TlsFiles& tls_files) noexcept;
// "automatic", "none", "hmac", "tls".
[[nodiscard]] const char* to_string(LinkSecurity security) noexcept;

struct TcpOptions {
  std::string listen_addr;        // data listener address; "" = all interfaces
  std::uint16_t listen_port = 0;  // data listener port; 0 = any free port
  // A listening socket the caller owns (bound and listening) to accept on instead of binding
  // listen_addr:listen_port; -1: bind. The transport accepts on a duplicate and hands the
  // socket back open when it ends, so a port held across transports (an elastic worker's data
  // port, from one group generation to the next) is never free for another process to take.
  int listen_socket = -1;

  int connections_per_peer = 2;  // parallel TCP connections per peer
  // Larger messages are striped: a 1 MiB message then travels as two 512 KiB frames on two
  // connections (docs/benchmarks.md, "Frame size", measures the threshold).
  std::size_t stripe_threshold_bytes = std::size_t{512} << 10;
  std::size_t stripe_chunk_bytes = std::size_t{4} << 20;  // largest frame of a striped message
  bool tcp_nodelay = true;
  int socket_send_buffer_bytes = 0;     // SO_SNDBUF; 0 = kernel autotuning
  int socket_receive_buffer_bytes = 0;  // SO_RCVBUF; 0 = kernel autotuning
  bool keepalive = true;                // SO_KEEPALIVE with the three settings below
  int keepalive_idle_s = 60;            // TCP_KEEPIDLE
  int keepalive_interval_s = 10;        // TCP_KEEPINTVL
  int keepalive_count = 6;              // TCP_KEEPCNT
  // A connection that makes no progress this long while it has bytes to send, or is in the
  // middle of a frame, is declared dead (TimeoutError naming the peer); 0 = never. Request
  // deadlines apply independently.
  std::chrono::milliseconds io_timeout{0};
  // Messages that arrive before their irecv is posted are buffered up to this many bytes in
  // all; beyond it the transport stops reading from that connection until a matching irecv is
  // posted (TCP flow control then holds the sender).
  std::size_t max_unexpected_bytes = std::size_t{1} << 30;
  bool payload_checksums = true;  // xxh3-64 of every frame's payload (headers always)
  // Threads that run this transport's Asio io_context while no caller waits: a caller waiting
  // on a request runs it itself, and the I/O threads step aside meanwhile (tcp/progress.h).
  int io_threads = 1;
  // How long a thread that has run out of work polls for more (yielding the core in between)
  // before it sleeps in the reactor: a caller in wait(), and an I/O thread after its last
  // handler. The next frame of a collective round usually follows within microseconds; polling
  // saves the sleep and wake-up, as MPI and NCCL do by polling all the time. A waiting caller
  // keeps polling while handlers keep running. 0: sleep in the reactor at once.
  // docs/benchmarks.md ("Busy polling, socket buffers, pipeline chunk") measures
  // the default.
  std::chrono::microseconds busy_poll{100};
  // Shared secret for the HMAC-SHA256 challenge-response of every TCP connection (data plane
  // and rendezvous). Empty: connections are still checked (with an empty key) but not
  // authenticated, so an empty secret is refused (InvalidArgument) unless every listener of the
  // process is on loopback or allow_insecure is set.
  std::string secret;
  // Listen beyond loopback without a secret anyway (a trusted network); a warning is logged.
  bool allow_insecure = false;
  // Encryption of every TCP link (PULSELOCO_LINK_SECURITY) and the certificates for it.
  LinkSecurity link_security = LinkSecurity::automatic;
  TlsFiles tls_files;
  // Data-plane links between two ranks of this host (same_host_link()) stay plaintext even when
  // the others use TLS (PULSELOCO_SAME_HOST_PLAINTEXT; docs/operations.md, "Same-host links",
  // says who can then read them). Every rank must agree: a link where one end encrypts and the
  // other does not is refused as a link security mismatch.
  bool same_host_plaintext = false;
};

[[nodiscard]] LinkSecurity effective_link_security(const TcpOptions& options) noexcept;

// Checks every field; throws InvalidArgument naming the field and the value.
void validate(const TcpOptions& options);
// The link security fields alone (also for the elastic coordinator and membership client).
void validate_link_security(LinkSecurity requested, const std::string& secret,
                            const TlsFiles& tls_files);

}  // namespace pulseloco::transport
