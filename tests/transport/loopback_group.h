// Test helpers: groups of TCP transports on loopback inside one process (one thread per rank),
// joined by an external rendezvous server on an ephemeral port, and deterministic payloads.
// Usable by any test that needs real TCP transports (the collectives' tests too).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <pulseloco/base/errors.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/rendezvous_server.h>
#include <pulseloco/transport/tcp/tcp_transport.h>

namespace pulseloco::transport::testing {

// Runs fn(rank) on `count` threads at once and rethrows the first exception (by rank order)
// after all of them finished.
inline void run_parallel(int count, const std::function<void(int rank)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(count));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(count));
  for (int rank = 0; rank < count; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        fn(rank);
      } catch (...) {
        errors[static_cast<std::size_t>(rank)] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads)
    thread.join();
  for (auto& error : errors)
    if (error) std::rethrow_exception(error);
}

// Options for rank `rank` of a loopback group whose rendezvous server listens on `port`.
inline group::TransportOptions loopback_options(group::TransportOptions base, int rank,
                                                int world_size, std::uint16_t port) {
  base.backend = Backend::tcp;
  base.rendezvous = group::RendezvousMethod::environment;
  base.rank = rank;
  base.world_size = world_size;
  base.master_addr = "127.0.0.1";
  base.master_port = port;
  base.external_rendezvous_server = true;
  base.tcp.listen_addr = "127.0.0.1";
  return base;
}

// The link securities the conformance tests run under: plaintext without a secret, and TLS
// keyed from a secret (the default whenever a secret is set).
inline std::vector<LinkSecurity> conformance_link_securities() {
  return {LinkSecurity::none, LinkSecurity::tls};
}

// `base` with links secured by `security` (none, hmac or tls from a secret).
inline group::TransportOptions secured(LinkSecurity security, group::TransportOptions base = {}) {
  base.tcp.link_security = security == LinkSecurity::none ? LinkSecurity::automatic : security;
  base.tcp.secret = security == LinkSecurity::none ? "" : "the loopback group's secret";
  return base;
}

// gtest's name for a test instantiated with `security`.
inline std::string link_name(LinkSecurity security) {
  return security == LinkSecurity::none ? "Plain" : security == LinkSecurity::hmac ? "Hmac" : "Tls";
}

// `world_size` connected TCP transports, index = rank.
inline std::vector<std::unique_ptr<TcpTransport>> make_loopback_group(
    int world_size, const group::TransportOptions& base = {}) {
  group::RendezvousServer server("127.0.0.1", 0, world_size, base.tcp,
                                 deadline_after(base.connect_timeout));
  std::vector<std::unique_ptr<TcpTransport>> ranks(static_cast<std::size_t>(world_size));
  run_parallel(world_size, [&](int rank) {
    ranks[static_cast<std::size_t>(rank)] =
        group::make_tcp_transport(loopback_options(base, rank, world_size, server.port()));
  });
  server.wait();
  return ranks;
}

// Whether `port` on 127.0.0.1 can be bound now (0: any; then `port` is set to the one bound).
inline bool bind_probe(std::uint16_t& port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("socket() failed");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  socklen_t length = sizeof address;
  const bool bound = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                     ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(fd);
  if (bound) port = ntohs(address.sin_port);
  return bound;
}

// A TCP port on 127.0.0.1 that was free a moment ago (the caller must cope with losing a race).
// It lies below the range the system hands out for bind(0) and outgoing connections, as the
// Python launcher's ports do: tests beside this one open many connections, and one of them could
// take a port that bind(0) had found free.
inline std::uint16_t pick_free_port() {
  int low = 32768;
  if (std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range"); !(range >> low)) low = 32768;
  if (low > 11000) {
    std::mt19937 chooser(std::random_device{}());
    std::uniform_int_distribution<int> below(10000, low - 1);
    for (int attempt = 0; attempt < 100; ++attempt) {
      auto port = static_cast<std::uint16_t>(below(chooser));
      if (bind_probe(port)) return port;
    }
  }
  std::uint16_t any = 0;
  if (!bind_probe(any)) throw std::runtime_error("bind() to an ephemeral port failed");
  return any;
}

// `count` addresses 127.0.0.1:<port> with ports that were free a moment ago, for the peer-list
// rendezvous (the caller retries when it loses a port to another process: IoError).
inline std::vector<std::string> free_peer_list(int count) {
  std::vector<std::string> peers;
  while (static_cast<int>(peers.size()) < count) {
    const std::string peer = "127.0.0.1:" + std::to_string(pick_free_port());
    if (std::find(peers.begin(), peers.end(), peer) == peers.end()) peers.push_back(peer);
  }
  return peers;
}

// Options for `rank` of a group joined by the peer-list rendezvous.
inline group::TransportOptions peer_list_options(const std::vector<std::string>& peers, int rank,
                                                 std::string secret,
                                                 std::chrono::milliseconds connect_timeout) {
  group::TransportOptions options;
  options.rendezvous = group::RendezvousMethod::peer_list;
  options.peers = peers;
  options.rank = rank;
  options.tcp.secret = std::move(secret);
  options.connect_timeout = connect_timeout;
  return options;
}

// How each rank of a 2-rank peer-list group that must not form failed: the message and the peer
// its error names.
struct FormationFailures {
  std::array<std::string, 2> what;
  std::array<std::optional<int>, 2> blamed;
};

// Forms a 2-rank group by peer list, rank r with options_of(peers, r), and returns how each rank
// failed ("" where it did not). Retries (up to 3 times) when a free port was taken meanwhile.
inline FormationFailures failed_formation(
    const std::function<group::TransportOptions(const std::vector<std::string>&, int)>&
        options_of) {
  for (int attempt = 0;; ++attempt) {
    const std::vector<std::string> peers = free_peer_list(2);
    FormationFailures failures;
    bool port_taken = false;
    run_parallel(2, [&](int rank) {
      try {
        (void)group::make_tcp_transport(options_of(peers, rank));
      } catch (const IoError&) {
        port_taken = true;
      } catch (const Error& error) {
        failures.what[static_cast<std::size_t>(rank)] = error.what();
        failures.blamed[static_cast<std::size_t>(rank)] = error.context().peer;
      }
    });
    if (!port_taken || attempt >= 3) return failures;
  }
}

// Deterministic bytes: payload(seed, n) differs for different seeds.
inline std::vector<std::byte> payload(std::uint64_t seed, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 1;
  std::size_t i = 0;
  while (i < bytes) {
    state += 0x9E3779B97F4A7C15ULL;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    for (int b = 0; b < 8 && i < bytes; ++b, ++i)
      out[i] = static_cast<std::byte>(z >> (8 * b));
  }
  return out;
}

}  // namespace pulseloco::transport::testing
