#include <pulseloco/transport/rendezvous.h>

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
#include <atomic>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include <pulseloco/build_config.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/thread_name.h>
#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/handshake.h>

#if PULSELOCO_TRANSPORT_MPI
#include <pulseloco/transport/mpi/mpi_environment.h>
#endif

namespace pulseloco::transport {
namespace {

using tcp::Acceptor;
using tcp::Socket;
namespace asio = boost::asio;

// A stranger gets this long to complete the handshake before its connection is dropped.
constexpr auto kHandshakeTimeout = std::chrono::seconds(10);
constexpr std::size_t kMaxHostBytes = 255;
constexpr std::uint8_t kTableOk = 0;
constexpr std::uint8_t kTableError = 1;

GroupId random_group_id() {
  GroupId id{};
  if (RAND_bytes(id.data(), static_cast<int>(id.size())) != 1)
    throw IoError("OpenSSL RAND_bytes failed to produce a group id");
  return id;
}

long long elapsed_ms(std::chrono::milliseconds timeout) {
  return static_cast<long long>(timeout.count());
}

void append_u16(std::vector<std::uint8_t>& out, std::uint16_t v) {
  out.push_back(static_cast<std::uint8_t>(v));
  out.push_back(static_cast<std::uint8_t>(v >> 8));
}
void append_u32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i)
    out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
void append_address(std::vector<std::uint8_t>& out, const PeerAddress& address) {
  append_u16(out, address.port);
  out.push_back(static_cast<std::uint8_t>(address.host.size()));
  out.insert(out.end(), address.host.begin(), address.host.end());
}

// Reads little-endian fields from a received byte string, failing cleanly at its end.
class Reader {
 public:
  explicit Reader(std::span<const std::uint8_t> bytes) : bytes_(bytes) {}
  std::uint8_t u8() {
    need(1);
    return bytes_[offset_++];
  }
  std::uint16_t u16() {
    need(2);
    const auto v = static_cast<std::uint16_t>(bytes_[offset_] | (bytes_[offset_ + 1] << 8));
    offset_ += 2;
    return v;
  }
  std::uint32_t u32() {
    need(4);
    std::uint32_t v = 0;
    for (int i = 3; i >= 0; --i)
      v = (v << 8) | bytes_[offset_ + static_cast<std::size_t>(i)];
    offset_ += 4;
    return v;
  }
  std::string text(std::size_t n) {
    need(n);
    std::string s(reinterpret_cast<const char*>(bytes_.data() + offset_), n);
    offset_ += n;
    return s;
  }
  PeerAddress address() {
    PeerAddress a;
    a.port = u16();
    a.host = text(u8());
    return a;
  }

 private:
  void need(std::size_t n) const {
    if (bytes_.size() - offset_ < n)
      throw ProtocolError("rendezvous: truncated message from the rendezvous server");
  }
  std::span<const std::uint8_t> bytes_;
  std::size_t offset_ = 0;
};

std::string wildcard_for(const std::string& host) {
  boost::system::error_code error;
  const auto address = asio::ip::make_address(host, error);
  return (!error && address.is_v6()) ? "::" : "0.0.0.0";
}

#if PULSELOCO_TRANSPORT_MPI
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

#endif

bool is_wildcard(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::";
}

// The address a rank advertises when the options name one; "" when it must be found otherwise.
std::string configured_advertise_address(const TransportOptions& options) {
  if (!options.advertise_addr.empty()) return options.advertise_addr;
  if (!options.socket_ifname.empty()) return interface_address(options.socket_ifname);
  if (!is_wildcard(options.listen_addr)) return options.listen_addr;
  return {};
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

}  // namespace

// ------------------------------------------------------------------------------------------------
// Addresses

PeerAddress parse_peer_address(std::string_view text, std::string_view what) {
  std::string_view host;
  std::string_view port_text;
  if (text.starts_with('[')) {
    const auto close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':')
      throw InvalidArgument(fmt::format("{}: '{}' is not [ipv6]:port", what, text));
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string_view::npos)
      throw InvalidArgument(fmt::format("{}: '{}' is not host:port", what, text));
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  unsigned port = 0;
  const auto [end, error] =
      std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (host.empty() || error != std::errc{} || end != port_text.data() + port_text.size() ||
      port == 0 || port > 65535)
    throw InvalidArgument(
        fmt::format("{}: '{}' is not host:port with a port in 1..65535", what, text));
  if (host.size() > kMaxHostBytes)
    throw InvalidArgument(fmt::format("{}: host name longer than {} bytes", what, kMaxHostBytes));
  return {std::string(host), static_cast<std::uint16_t>(port)};
}

std::string to_string(const PeerAddress& address) {
  if (address.host.find(':') != std::string::npos)
    return fmt::format("[{}]:{}", address.host, address.port);
  return fmt::format("{}:{}", address.host, address.port);
}

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

// ------------------------------------------------------------------------------------------------
// The rendezvous server

struct RendezvousServer::Impl {
  struct Member {
    std::shared_ptr<Socket> socket;
    PeerAddress address;
    bool claimed = false;
    bool registered = false;
  };

  Impl(int world, std::string key, Deadline until)
      : acceptor(io), timer(io), world_size(world), secret(std::move(key)), deadline(until) {
    members.resize(static_cast<std::size_t>(world));
  }

  asio::io_context io;
  Acceptor acceptor;
  asio::steady_timer timer;
  const int world_size;
  const std::string secret;
  const Deadline deadline;
  std::vector<Member> members;  // touched only on the io thread
  int registered = 0;
  bool finished = false;  // no more registrations (complete or failed)
  std::atomic<int> refused{0};

  std::mutex mutex;
  std::condition_variable changed;
  bool done = false;
  std::exception_ptr failure;
  std::thread thread;

  void complete(std::exception_ptr error) {
    {
      const std::lock_guard lock(mutex);
      done = true;
      failure = std::move(error);
    }
    changed.notify_all();
  }

  asio::awaitable<void> accept_loop() {
    while (!finished) {
      auto socket = std::make_shared<Socket>(io);
      boost::system::error_code error;
      co_await acceptor.async_accept(*socket, asio::redirect_error(asio::use_awaitable, error));
      if (finished || error == asio::error::operation_aborted) co_return;
      if (error) {
        logger().warn("rendezvous server: accept failed: {}", error.message());
        continue;
      }
      asio::co_spawn(io, serve(std::move(socket)), asio::detached);
    }
  }

  asio::awaitable<void> serve(std::shared_ptr<Socket> socket) {
    const std::string from = tcp::remote_description(*socket);
    int claimed = -1;
    try {
      PeerAddress address;
      {
        tcp::Watchdog watchdog(io.get_executor(),
                               std::min(deadline, Clock::now() + kHandshakeTimeout), [socket] {
                                 boost::system::error_code ignored;
                                 socket->close(ignored);
                               });
        const auto result = co_await tcp::server_handshake(
            *socket, secret, [&](const tcp::Hello& hello) -> std::string {
              if (hello.purpose != tcp::Purpose::rendezvous)
                return "this is a rendezvous server, not a data listener";
              if (hello.world_size != static_cast<std::uint32_t>(world_size))
                return fmt::format("world size {} differs from this rendezvous's {}",
                                   hello.world_size, world_size);
              if (hello.src_rank >= hello.world_size)
                return fmt::format("rank {} is out of range", hello.src_rank);
              if (finished) return "the rendezvous is already over";
              auto& member = members[hello.src_rank];
              if (member.claimed)
                return fmt::format("rank {} has already registered", hello.src_rank);
              member.claimed = true;
              claimed = static_cast<int>(hello.src_rank);
              return {};
            });
        if (!result.accepted) {
          refused.fetch_add(1);
          logger().warn("rendezvous server: refused a connection from {} claiming rank {}: {}",
                        from, result.hello.src_rank, result.refusal);
          co_return;
        }
        std::array<std::uint8_t, 3> head{};
        co_await asio::async_read(*socket, asio::buffer(head), asio::use_awaitable);
        address.port = static_cast<std::uint16_t>(head[0] | (head[1] << 8));
        address.host.resize(head[2]);
        if (!address.host.empty())
          co_await asio::async_read(*socket, asio::buffer(address.host), asio::use_awaitable);
        if (address.port == 0 || address.host.empty())
          throw ProtocolError(fmt::format("rank {} registered an invalid address '{}'", claimed,
                                          to_string(address)));
      }
      if (finished) co_return;
      auto& member = members[static_cast<std::size_t>(claimed)];
      member.socket = socket;
      member.address = std::move(address);
      member.registered = true;
      ++registered;
      logger().debug("rendezvous server: rank {} registered {} ({}/{})", claimed,
                     to_string(member.address), registered, world_size);
      if (registered == world_size) co_await send_table();
    } catch (const std::exception& error) {
      if (claimed >= 0 && !members[static_cast<std::size_t>(claimed)].registered)
        members[static_cast<std::size_t>(claimed)].claimed = false;  // it may retry
      logger().warn("rendezvous server: connection from {} failed: {}", from, error.what());
    }
  }

  asio::awaitable<void> send_table() {
    finished = true;
    timer.cancel();
    boost::system::error_code ignored;
    acceptor.close(ignored);
    std::vector<std::uint8_t> table;
    try {
      const GroupId group_id = random_group_id();
      table.push_back(kTableOk);
      table.insert(table.end(), group_id.begin(), group_id.end());
      append_u32(table, static_cast<std::uint32_t>(world_size));
      for (const auto& member : members)
        append_address(table, member.address);
    } catch (...) {
      complete(std::current_exception());
      co_return;
    }
    for (std::size_t rank = 0; rank < members.size(); ++rank) {
      boost::system::error_code error;
      co_await asio::async_write(*members[rank].socket, asio::buffer(table),
                                 asio::redirect_error(asio::use_awaitable, error));
      if (error)
        logger().warn("rendezvous server: could not send the table to rank {}: {}", rank,
                      error.message());
      members[rank].socket->shutdown(Socket::shutdown_send, ignored);
    }
    logger().debug("rendezvous server: sent the table of {} ranks", world_size);
    complete(nullptr);
  }

  asio::awaitable<void> fail_at_deadline() {
    finished = true;
    boost::system::error_code ignored;
    acceptor.close(ignored);
    std::vector<int> missing;
    for (std::size_t rank = 0; rank < members.size(); ++rank)
      if (!members[rank].registered) missing.push_back(static_cast<int>(rank));
    const std::string message =
        fmt::format("rendezvous: ranks {} did not register in time ({} of {} registered)",
                    fmt::join(missing, ", "), registered, world_size);
    std::vector<std::uint8_t> reply{kTableError};
    const std::string_view text = std::string_view(message).substr(0, 60000);
    append_u16(reply, static_cast<std::uint16_t>(text.size()));
    reply.insert(reply.end(), text.begin(), text.end());
    for (auto& member : members) {
      if (!member.registered) continue;
      boost::system::error_code error;
      co_await asio::async_write(*member.socket, asio::buffer(reply),
                                 asio::redirect_error(asio::use_awaitable, error));
      member.socket->shutdown(Socket::shutdown_send, ignored);
    }
    ErrorContext context;
    context.ranks = missing;
    complete(std::make_exception_ptr(TimeoutError(message, std::move(context))));
  }
};

RendezvousServer::RendezvousServer(const std::string& host, std::uint16_t port, int world_size,
                                   std::string secret, Deadline deadline)
    : impl_(std::make_unique<Impl>(world_size, std::move(secret), deadline)) {
  if (world_size < 1)
    throw InvalidArgument(fmt::format("rendezvous server: world size {} < 1", world_size));
  auto& impl = *impl_;
  try {
    const auto endpoint =
        tcp::Endpoint(asio::ip::make_address(host.empty() ? "0.0.0.0" : host), port);
    impl.acceptor.open(endpoint.protocol());
    impl.acceptor.set_option(asio::socket_base::reuse_address(true));
    impl.acceptor.bind(endpoint);
    impl.acceptor.listen(asio::socket_base::max_listen_connections);
  } catch (const boost::system::system_error& error) {
    throw IoError(fmt::format("rendezvous server: cannot listen on {}:{}: {}", host, port,
                              error.code().message()));
  }
  asio::co_spawn(impl.io, impl.accept_loop(), asio::detached);
  impl.timer.expires_at(deadline);
  impl.timer.async_wait([&impl](const boost::system::error_code& error) {
    if (error || impl.finished) return;
    asio::co_spawn(impl.io, impl.fail_at_deadline(), asio::detached);
  });
  impl.thread = std::thread([&impl] {
    set_this_thread_name("pl-rendezvous");
    impl.io.run();
  });
}

RendezvousServer::~RendezvousServer() {
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::uint16_t RendezvousServer::port() const noexcept {
  boost::system::error_code error;
  return impl_->acceptor.local_endpoint(error).port();
}

void RendezvousServer::wait() {
  std::unique_lock lock(impl_->mutex);
  impl_->changed.wait(lock, [&] { return impl_->done; });
  if (impl_->failure) std::rethrow_exception(impl_->failure);
}

int RendezvousServer::refused_connections() const noexcept {
  return impl_->refused.load();
}

// ------------------------------------------------------------------------------------------------
// The environment rendezvous client

namespace {

asio::awaitable<GroupTable> register_with_server(asio::io_context& io,
                                                 const TransportOptions& options,
                                                 std::uint16_t listen_port, Deadline deadline) {
  const std::string server = to_string(PeerAddress{options.master_addr, options.master_port});
  const ErrorContext context{.rank = options.rank};
  auto backoff = std::chrono::milliseconds(20);
  std::string last_problem = "no attempt";
  for (;;) {
    if (Clock::now() >= deadline)
      throw TimeoutError(fmt::format("rendezvous: could not register with the server at {} "
                                     "within {} ms (last problem: {})",
                                     server, elapsed_ms(options.connect_timeout), last_problem),
                         context);
    auto socket = std::make_shared<Socket>(io);
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
    tcp::apply_socket_options(*socket, options);
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
    try {
      (void)co_await tcp::client_handshake(*socket, hello, options.secret);
      std::vector<std::uint8_t> registration;
      append_address(registration, mine);
      co_await asio::async_write(*socket, asio::buffer(registration), asio::use_awaitable);

      std::vector<std::uint8_t> reply;
      boost::system::error_code read_error;
      // The table is a few bytes per rank; anything near this bound is not a table.
      constexpr std::size_t kMaxReplyBytes = std::size_t{64} << 20;
      co_await asio::async_read(*socket, asio::dynamic_buffer(reply, kMaxReplyBytes),
                                asio::redirect_error(asio::use_awaitable, read_error));
      if (read_error != asio::error::eof) throw boost::system::system_error(read_error);
      Reader reader(reply);
      if (reader.u8() == kTableError) throw TimeoutError(reader.text(reader.u16()), context);
      GroupTable table;
      table.rank = options.rank;
      for (auto& byte : table.group_id)
        byte = reader.u8();
      const auto count = reader.u32();
      if (count != static_cast<std::uint32_t>(options.world_size))
        throw ProtocolError(fmt::format("rendezvous: the table has {} ranks, expected {}", count,
                                        options.world_size),
                            context);
      for (std::uint32_t rank = 0; rank < count; ++rank)
        table.peers.push_back(reader.address());
      if (table.peers[static_cast<std::size_t>(options.rank)] != mine)
        throw ProtocolError(
            fmt::format("rendezvous: the table lists {} for this rank, which "
                        "registered {}",
                        to_string(table.peers[static_cast<std::size_t>(options.rank)]),
                        to_string(mine)),
            context);
      co_return table;
    } catch (const tcp::HandshakeRefused& refused) {
      throw ProtocolError(fmt::format("rendezvous server at {}: {}", server, refused.message()),
                          context);
    } catch (const boost::system::system_error& io_error) {
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

GroupTable environment_rendezvous(const TransportOptions& options, std::uint16_t listen_port) {
  require_rank_and_size(options, "environment");
  if (options.master_addr.empty() || options.master_port == 0)
    throw InvalidArgument(
        "environment rendezvous: MASTER_ADDR and MASTER_PORT (or PULSELOCO_MASTER_ADDR and "
        "PULSELOCO_MASTER_PORT) must be set");
  const Deadline deadline = deadline_after(options.connect_timeout);
  std::unique_ptr<RendezvousServer> server;
  if (options.rank == 0 && !options.external_rendezvous_server)
    server =
        std::make_unique<RendezvousServer>(wildcard_for(options.master_addr), options.master_port,
                                           options.world_size, options.secret, deadline);
  asio::io_context io;
  auto result = asio::co_spawn(io, register_with_server(io, options, listen_port, deadline),
                               asio::use_future);
  io.run();
  GroupTable table = result.get();
  if (server) server->wait();  // every rank has its table before rank 0 moves on
  return table;
}

// ------------------------------------------------------------------------------------------------
// peer_list and MPI

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
    table.peers.push_back(parse_peer_address(options.peers[static_cast<std::size_t>(rank)],
                                             fmt::format("PULSELOCO_PEERS[{}]", rank)));
    joined.append(",").append(to_string(table.peers.back()));
  }
  std::array<unsigned char, SHA256_DIGEST_LENGTH> digest{};
  SHA256(reinterpret_cast<const unsigned char*>(joined.data()), joined.size(), digest.data());
  std::copy_n(digest.begin(), table.group_id.size(), table.group_id.begin());
  return table;
}

GroupTable mpi_rendezvous(const TransportOptions& options, std::uint16_t listen_port) {
#if PULSELOCO_TRANSPORT_MPI
  mpi::ensure_initialized();
  struct Record {
    char host[kMaxHostBytes + 1];
    char fallback_host[kMaxHostBytes + 1];
    char hostname[kMaxHostBytes + 1];
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
  mine.group_id = random_group_id();

  int rank = 0;
  int size = 0;
  std::vector<Record> records;
  {
    const std::lock_guard lock(mpi::call_mutex());
    mpi::check(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
    mpi::check(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
    if (options.rank != -1 && options.rank != rank)
      throw InvalidArgument(
          fmt::format("MPI rendezvous: the configured rank {} differs from the MPI rank {}",
                      options.rank, rank));
    if (options.world_size != -1 && options.world_size != size)
      throw InvalidArgument(
          fmt::format("MPI rendezvous: the configured world size {} differs from MPI's {}",
                      options.world_size, size));
    records.resize(static_cast<std::size_t>(size));
  }
  MPI_Request request = MPI_REQUEST_NULL;
  {
    const std::lock_guard lock(mpi::call_mutex());
    mpi::check(MPI_Iallgather(&mine, sizeof(Record), MPI_BYTE, records.data(), sizeof(Record),
                              MPI_BYTE, MPI_COMM_WORLD, &request),
               "MPI_Iallgather (rendezvous)");
  }
  const Deadline deadline = deadline_after(options.connect_timeout);
  for (int done = 0; done == 0;) {
    {
      const std::lock_guard lock(mpi::call_mutex());
      mpi::check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), "MPI_Test (rendezvous)");
    }
    if (done != 0) break;
    if (Clock::now() >= deadline) {
      mpi::mark_unclean();
      throw TimeoutError(fmt::format("MPI rendezvous: not every rank joined within {} ms",
                                     elapsed_ms(options.connect_timeout)),
                         ErrorContext{.rank = rank});
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // MPI progress polling
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
#else
  (void)options;
  (void)listen_port;
  throw InvalidArgument(
      "MPI rendezvous: this build of pulseloco has no MPI support (configure with "
      "-DPULSELOCO_WITH_MPI=ON)");
#endif
}

RendezvousMethod resolve_rendezvous(const TransportOptions& options) {
  if (options.rendezvous != RendezvousMethod::automatic) return options.rendezvous;
  if (launched_by_mpi() && PULSELOCO_TRANSPORT_MPI) return RendezvousMethod::mpi;
  if (!options.master_addr.empty()) return RendezvousMethod::environment;
  if (!options.peers.empty()) return RendezvousMethod::peer_list;
  if (options.world_size > 1)
    throw InvalidArgument(fmt::format(
        "world size {} but no way to find the other ranks: set MASTER_ADDR/MASTER_PORT, "
        "PULSELOCO_PEERS, or launch with mpirun",
        options.world_size));
  return RendezvousMethod::automatic;  // a group of one: nothing to find
}

}  // namespace pulseloco::transport
