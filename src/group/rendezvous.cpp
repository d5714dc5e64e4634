#include <pulseloco/group/rendezvous.h>

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/group/linked_backends.h>
#include <pulseloco/group/progress_lines.h>
#include <pulseloco/group/rendezvous_messages.h>
#include <pulseloco/group/rendezvous_server.h>
#include <pulseloco/transport/tcp/exposure.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/tcp/tls_context.h>
#include <pulseloco/transport/waiting.h>

namespace pulseloco::group {
namespace {

namespace asio = boost::asio;
namespace tcp = transport::tcp;
using transport::Clock;
using transport::Deadline;
using transport::GroupId;
using transport::GroupTable;
using transport::PeerAddress;

long long elapsed_ms(std::chrono::milliseconds timeout) {
  return static_cast<long long>(timeout.count());
}

// Where rank 0 hosts the rendezvous server: on the master address itself when it is loopback
// (a single-host run), else on every interface of its family.
std::string server_host_for(const std::string& host) {
  if (tcp::is_loopback_host(host)) return host == "localhost" ? "127.0.0.1" : host;
  boost::system::error_code error;
  const auto address = asio::ip::make_address(host, error);
  return (!error && address.is_v6()) ? "::" : "0.0.0.0";
}

std::string local_hostname() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

// The first IPv4 address of an interface that is up and not loopback; "" when there is none.
std::string first_external_ipv4() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string found;
  for (ifaddrs* entry = list; entry != nullptr && found.empty(); entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || entry->ifa_addr->sa_family != AF_INET) continue;
    if ((entry->ifa_flags & IFF_UP) == 0 || (entry->ifa_flags & IFF_LOOPBACK) != 0) continue;
    const std::string_view name = entry->ifa_name;
    if (name.starts_with("docker") || name.starts_with("virbr")) continue;
    char text[INET_ADDRSTRLEN] = {};
    const auto* in = reinterpret_cast<const sockaddr_in*>(entry->ifa_addr);
    if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text) != nullptr) found = text;
  }
  ::freeifaddrs(list);
  return found;
}

bool is_wildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::";
}

// The address a rank advertises when the options name one; "" when it must be found otherwise.
std::string configured_advertise_address(const TransportOptions& options) {
  if (!options.advertise_addr.empty()) return options.advertise_addr;
  if (!options.socket_ifname.empty()) return interface_address(options.socket_ifname);
  if (!is_wildcard(options.tcp.listen_addr)) return options.tcp.listen_addr;
  return {};
}

// Which variable the master port came from, and what to do when something else holds it
// (torchrun's store listens on MASTER_PORT itself).
std::string master_port_hint(const TransportOptions& options) {
  const char* pulseloco_port = std::getenv("PULSELOCO_MASTER_PORT");
  const char* torch_port = std::getenv("MASTER_PORT");
  const std::string port = std::to_string(options.master_port);
  std::string source = "the master_port option";
  if (pulseloco_port != nullptr && port == pulseloco_port) {
    source = "PULSELOCO_MASTER_PORT";
  } else if (torch_port != nullptr && port == torch_port) {
    source = "MASTER_PORT";
  }
  return fmt::format(
      "port {} comes from {}; when another program listens there (torchrun's store listens on "
      "MASTER_PORT), give pulseloco a free port of its own with PULSELOCO_MASTER_PORT",
      port, source);
}

void require_rank_and_size(const TransportOptions& options, std::string_view method) {
  if (options.world_size < 1)
    throw InvalidArgument(fmt::format(
        "{} rendezvous: the world size is not set (WORLD_SIZE or PULSELOCO_WORLD_SIZE)", method));
  if (options.rank < 0 || options.rank >= options.world_size)
    throw InvalidArgument(
        fmt::format("{} rendezvous: rank {} is not in [0, {}) (RANK or PULSELOCO_RANK)", method,
                    options.rank, options.world_size));
}

// Reads the server's reply (the table or its failure) and checks it against this rank's
// registration.
GroupTable table_from_reply(std::span<const std::byte> reply, const TransportOptions& options,
                            const PeerAddress& mine, const ErrorContext& context) {
  TableReply decoded = decode_table_reply(reply, context);
  if (!decoded.ok && decoded.why == RendezvousFailure::refused_member)
    throw ProtocolError(decoded.failure, context);
  if (!decoded.ok) throw TimeoutError(decoded.failure, context);
  if (decoded.peers.size() != static_cast<std::size_t>(options.world_size))
    throw ProtocolError(fmt::format("rendezvous: the table has {} ranks, expected {}",
                                    decoded.peers.size(), options.world_size),
                        context);
  GroupTable table;
  table.rank = options.rank;
  table.group_id = decoded.group_id;
  table.peers = std::move(decoded.peers);
  if (table.peers[static_cast<std::size_t>(options.rank)] != mine)
    throw ProtocolError(
        fmt::format("rendezvous: the table lists {} for this rank, which registered {}",
                    to_string(table.peers[static_cast<std::size_t>(options.rank)]),
                    to_string(mine)),
        context);
  return table;
}

asio::awaitable<GroupTable> register_with_server(asio::io_context& io,
                                                 const TransportOptions& options,
                                                 std::uint16_t listen_port, Deadline deadline) {
  const std::string server = to_string(PeerAddress{options.master_addr, options.master_port});
  const ErrorContext context{.rank = options.rank};
  const auto tls = tcp::TlsContext::make(options.tcp);
  auto backoff = std::chrono::milliseconds(20);
  bool answered = false;  // the server answered a handshake: it is a rendezvous server
  std::string last_problem = "no attempt";
  for (;;) {
    if (Clock::now() >= deadline)
      throw TimeoutError(fmt::format("rendezvous: could not register with the server at {} "
                                     "within {} ms (last problem: {})",
                                     server, elapsed_ms(options.connect_timeout), last_problem),
                         context);
    auto socket = std::make_shared<tcp::Socket>(io);
    boost::system::error_code error;
    try {
      const auto endpoint = tcp::resolve_endpoint(io, options.master_addr, options.master_port);
      tcp::Watchdog watchdog(io.get_executor(), deadline, [socket] {
        boost::system::error_code ignored;
        socket->close(ignored);
      });
      co_await socket->async_connect(endpoint, asio::redirect_error(asio::use_awaitable, error));
    } catch (const IoError& resolve_error) {
      error = asio::error::host_not_found;
      last_problem = resolve_error.what();
    }
    if (error) {
      if (error != asio::error::host_not_found) last_problem = error.message();
      asio::steady_timer pause(io);
      pause.expires_at(std::min(deadline, Clock::now() + backoff));
      co_await pause.async_wait(asio::use_awaitable);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
      continue;
    }
    tcp::apply_socket_options(*socket, options.tcp);
    PeerAddress mine{configured_advertise_address(options), listen_port};
    if (mine.host.empty()) mine.host = socket->local_endpoint().address().to_string();

    tcp::Watchdog watchdog(io.get_executor(), deadline, [socket] {
      boost::system::error_code ignored;
      socket->close(ignored);
    });
    tcp::Hello hello;
    hello.purpose = tcp::Purpose::rendezvous;
    hello.src_rank = static_cast<std::uint32_t>(options.rank);
    hello.world_size = static_cast<std::uint32_t>(options.world_size);
    hello.group_id =
        transport::job_only_group_id(transport::derive_job_id(options.tcp.secret, options.run_id));
    try {
      tcp::LinkStream link(socket, tls);
      (void)co_await tcp::client_handshake(link, hello, options.tcp.secret);
      answered = true;
      const std::vector<std::byte> registration = encode_registration(mine);
      co_await asio::async_write(link, asio::buffer(registration), asio::use_awaitable);

      std::vector<std::byte> reply;
      boost::system::error_code read_error;
      // The table is a few bytes per rank; anything near this bound is not a table.
      constexpr std::size_t kMaxReplyBytes = std::size_t{64} << 20;
      co_await asio::async_read(link, asio::dynamic_buffer(reply, kMaxReplyBytes),
                                asio::redirect_error(asio::use_awaitable, read_error));
      if (read_error != asio::error::eof) throw boost::system::system_error(read_error);
      co_return table_from_reply(reply, options, mine, context);
    } catch (const tcp::HandshakeRefused& refused) {
      throw ProtocolError(fmt::format("rendezvous server at {}: {}", server, refused.message()),
                          context);
    } catch (const boost::system::system_error& io_error) {
      if (watchdog.fired() && !answered)
        throw TimeoutError(
            fmt::format("rendezvous: the server at {} accepted the connection but "
                        "did not answer the handshake within {} ms: is another "
                        "program listening there? ({})",
                        server, elapsed_ms(options.connect_timeout), master_port_hint(options)),
            context);
      if (watchdog.fired())
        throw TimeoutError(fmt::format("rendezvous: the server at {} did not send the table "
                                       "within {} ms (other ranks have not registered yet?)",
                                       server, elapsed_ms(options.connect_timeout)),
                           context);
      throw PeerLostError(fmt::format("rendezvous: the connection to the server at {} failed: {}",
                                      server, io_error.code().message()),
                          context);
    }
  }
}

}  // namespace

std::string interface_address(const std::string& ifname) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0)
    throw IoError(fmt::format("getifaddrs failed: {}", std::strerror(errno)));
  std::string found;
  std::vector<std::string> names;
  for (ifaddrs* entry = list; entry != nullptr; entry = entry->ifa_next) {
    if (entry->ifa_addr == nullptr || entry->ifa_addr->sa_family != AF_INET) continue;
    names.emplace_back(entry->ifa_name);
    if (found.empty() && ifname == entry->ifa_name) {
      char text[INET_ADDRSTRLEN] = {};
      const auto* in = reinterpret_cast<const sockaddr_in*>(entry->ifa_addr);
      if (::inet_ntop(AF_INET, &in->sin_addr, text, sizeof text) != nullptr) found = text;
    }
  }
  ::freeifaddrs(list);
  if (found.empty())
    throw InvalidArgument(
        fmt::format("PULSELOCO_SOCKET_IFNAME: interface '{}' has no IPv4 address "
                    "(interfaces with one: {})",
                    ifname, fmt::join(names, ", ")));
  return found;
}

// register_with_server, logging at wait_progress_interval() while it waits (rank 0's server
// names the ranks that have not registered; `quiet` when it runs in this process).
asio::awaitable<GroupTable> register_logging_progress(asio::io_context& io,
                                                      const TransportOptions& options,
                                                      std::uint16_t listen_port, Deadline deadline,
                                                      bool quiet) {
  std::optional<ProgressLines> progress;
  if (!quiet) {
    progress.emplace(io, [&options](double seconds) {
      logger().warn(
          "rendezvous: rank {} has waited {:.1f} s so far for the group of {} to form at {}:{} "
          "(rank 0 logs which ranks have not registered)",
          options.rank, seconds, options.world_size, options.master_addr, options.master_port);
    });
  }
  co_return co_await register_with_server(io, options, listen_port, deadline);
}

GroupTable environment_rendezvous(const TransportOptions& options, std::uint16_t listen_port) {
  require_rank_and_size(options, "environment");
  if (options.master_addr.empty() || options.master_port == 0)
    throw InvalidArgument(
        "environment rendezvous: MASTER_ADDR and MASTER_PORT (or PULSELOCO_MASTER_ADDR and "
        "PULSELOCO_MASTER_PORT) must be set");
  // Before rank 0 starts the server: an interface without an address is this rank's own error,
  // which waiting for the server would turn into a timeout about missing ranks.
  (void)configured_advertise_address(options);
  const Deadline deadline = transport::deadline_after(options.connect_timeout);
  std::unique_ptr<RendezvousServer> server;
  if (options.rank == 0 && !options.external_rendezvous_server) {
    try {
      server = std::make_unique<RendezvousServer>(server_host_for(options.master_addr),
                                                  options.master_port, options.world_size,
                                                  options.tcp, deadline, options.run_id);
    } catch (const IoError& error) {
      throw IoError(fmt::format("{} ({})", error.message(), master_port_hint(options)),
                    error.context());
    }
  }
  asio::io_context io;
  auto result = asio::co_spawn(
      io, register_logging_progress(io, options, listen_port, deadline, server != nullptr),
      asio::use_future);
  io.run();
  GroupTable table;
  try {
    table = result.get();
  } catch (const Error&) {
    // The server's own reason (a refused member, the ranks that did not register and what it
    // refused meanwhile) says more than this client's view. It ends by the same deadline.
    if (server) {
      try {
        server->wait();
      } catch (const Error&) {
        // Ranks still on their way are told why before the server goes with this process.
        server->wait_closed();
        std::rethrow_exception(server->failure());
      }
    }
    throw;
  }
  if (server) server->wait();  // every rank has its table before rank 0 moves on
  return table;
}

GroupTable peer_list_rendezvous(const TransportOptions& options) {
  const int count = static_cast<int>(options.peers.size());
  if (count == 0) throw InvalidArgument("peer_list rendezvous: PULSELOCO_PEERS is empty");
  if (options.world_size != -1 && options.world_size != count)
    throw InvalidArgument(fmt::format("peer_list rendezvous: {} peers listed but world size {}",
                                      count, options.world_size));
  if (options.rank < 0 || options.rank >= count)
    throw InvalidArgument(
        fmt::format("peer_list rendezvous: rank {} is not in [0, {}) (RANK or PULSELOCO_RANK)",
                    options.rank, count));
  GroupTable table;
  table.rank = options.rank;
  std::string joined = "pulseloco-peers-v1";
  if (!options.group_key.empty()) joined.append("|key=").append(options.group_key);
  for (int rank = 0; rank < count; ++rank) {
    table.peers.push_back(transport::parse_peer_address(
        options.peers[static_cast<std::size_t>(rank)], fmt::format("PULSELOCO_PEERS[{}]", rank)));
    joined.append(",").append(to_string(table.peers.back()));
  }
  std::array<unsigned char, SHA256_DIGEST_LENGTH> digest{};
  SHA256(reinterpret_cast<const unsigned char*>(joined.data()), joined.size(), digest.data());
  table.group_id = transport::make_group_id(
      transport::derive_job_id(options.tcp.secret, options.run_id), std::span(digest).first<8>());
  return table;
}

GroupTable mpi_rendezvous(const TransportOptions& options, std::uint16_t listen_port) {
  const transport::MpiBackend& mpi = require_mpi_backend("MPI rendezvous");
  const std::unique_ptr<transport::Bootstrap> world = mpi.world();
  // What every rank tells the others (all fixed-size, for one MPI_Allgather).
  struct Record {
    char host[transport::kMaxHostBytes + 1];
    char fallback_host[transport::kMaxHostBytes + 1];
    char hostname[transport::kMaxHostBytes + 1];
    std::uint16_t port;
    GroupId group_id;
  };
  Record mine{};
  const std::string configured = configured_advertise_address(options);
  const std::string external = first_external_ipv4();
  const std::string hostname = local_hostname();
  std::snprintf(mine.host, sizeof mine.host, "%s", configured.c_str());
  std::snprintf(mine.fallback_host, sizeof mine.fallback_host, "%s",
                external.empty() ? hostname.c_str() : external.c_str());
  std::snprintf(mine.hostname, sizeof mine.hostname, "%s", hostname.c_str());
  mine.port = listen_port;
  // Rank 0's is the group's: a random job id unless the run id names the job.
  std::array<std::uint8_t, 8> within{};
  if (RAND_bytes(within.data(), static_cast<int>(within.size())) != 1)
    throw IoError("OpenSSL RAND_bytes failed to produce a group id");
  mine.group_id = transport::make_group_id(
      options.run_id.empty() ? transport::random_job_id()
                             : transport::derive_job_id(options.tcp.secret, options.run_id),
      within);

  const int rank = world->rank();
  const int size = world->size();
  if (options.rank != -1 && options.rank != rank)
    throw InvalidArgument(fmt::format(
        "MPI rendezvous: the configured rank {} differs from the MPI rank {}", options.rank, rank));
  if (options.world_size != -1 && options.world_size != size)
    throw InvalidArgument(
        fmt::format("MPI rendezvous: the configured world size {} differs from MPI's {}",
                    options.world_size, size));
  std::vector<Record> records(static_cast<std::size_t>(size));
  try {
    world->allgather(std::as_bytes(std::span(&mine, 1)), std::as_writable_bytes(std::span(records)),
                     transport::deadline_after(options.connect_timeout));
  } catch (const TimeoutError&) {
    throw TimeoutError(fmt::format("MPI rendezvous: not every rank joined within {} ms",
                                   elapsed_ms(options.connect_timeout)),
                       ErrorContext{.rank = rank});
  }
  const bool one_host = std::all_of(records.begin(), records.end(), [&](const Record& r) {
    return std::strncmp(r.hostname, records[0].hostname, sizeof r.hostname) == 0;
  });
  GroupTable table;
  table.rank = rank;
  table.group_id = records[0].group_id;
  for (const auto& record : records) {
    PeerAddress address;
    address.port = record.port;
    if (record.host[0] != '\0') {
      address.host = record.host;
    } else {
      address.host = one_host ? std::string("127.0.0.1") : std::string(record.fallback_host);
    }
    table.peers.push_back(std::move(address));
  }
  return table;
}

RendezvousMethod resolve_rendezvous(const TransportOptions& options) {
  if (options.rendezvous != RendezvousMethod::automatic) return options.rendezvous;
  if (launched_by_mpi() && transport::backend_available(transport::Backend::mpi))
    return RendezvousMethod::mpi;
  if (!options.master_addr.empty()) return RendezvousMethod::environment;
  if (!options.peers.empty()) return RendezvousMethod::peer_list;
  if (options.world_size > 1)
    throw InvalidArgument(fmt::format(
        "world size {} but no way to find the other ranks: set MASTER_ADDR/MASTER_PORT, "
        "PULSELOCO_PEERS, or launch with mpirun",
        options.world_size));
  return RendezvousMethod::automatic;  // a group of one: nothing to find
}

}  // namespace pulseloco::group
