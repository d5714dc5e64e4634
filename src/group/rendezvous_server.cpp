#include <pulseloco/group/rendezvous_server.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <openssl/rand.h>

#include <atomic>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/thread_name.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/group/rendezvous_messages.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/listener.h>
#include <pulseloco/transport/tcp/server_outcome.h>
#include <pulseloco/transport/tcp/tls_context.h>

namespace pulseloco::group {
namespace {

namespace asio = boost::asio;
namespace tcp = transport::tcp;

}  // namespace

struct RendezvousServer::Impl {
  struct Member {
    std::shared_ptr<tcp::LinkStream> link;
    transport::PeerAddress address;
    bool claimed = false;
    bool registered = false;
  };

  Impl(const std::string& host, std::uint16_t port, int world, const transport::TcpOptions& link,
       transport::Deadline until)
      : listener(io, io.get_executor(), "rendezvous server", host, port),
        timer(io),
        world_size(world),
        secret(link.secret),
        tls(tcp::TlsContext::make(link)),
        deadline(until) {
    members.resize(static_cast<std::size_t>(world));
  }

  asio::io_context io;
  tcp::Listener listener;
  asio::steady_timer timer;
  const int world_size;
  const std::string secret;
  const std::shared_ptr<tcp::TlsContext> tls;  // null: plain links
  const transport::Deadline deadline;
  std::vector<Member> members;  // touched only on the io thread
  int registered = 0;
  bool finished = false;  // no more registrations (complete or failed)
  std::atomic<int> refused{0};

  tcp::ServerOutcome outcome;
  std::thread thread;

  void complete(std::exception_ptr error) { outcome.complete(std::move(error)); }

  asio::awaitable<void> serve(tcp::PendingConnection connection) {
    const auto link = std::make_shared<tcp::LinkStream>(connection.socket(), tls);
    const std::string from = tcp::remote_description(link->socket());
    int claimed = -1;
    try {
      const auto result = co_await tcp::server_handshake(
          *link, secret, [&](const tcp::Hello& hello) -> std::string {
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
        logger().warn("rendezvous server: refused a connection from {} claiming rank {}: {}", from,
                      result.hello.src_rank, result.refusal);
        co_return;
      }
      std::array<std::byte, kRegistrationHeadBytes> head_bytes{};
      co_await asio::async_read(*link, asio::buffer(head_bytes), asio::use_awaitable);
      const RegistrationHead head = decode_registration_head(head_bytes);
      transport::PeerAddress address;
      address.port = head.port;
      address.host.resize(head.host_bytes);
      if (!address.host.empty())
        co_await asio::async_read(*link, asio::buffer(address.host), asio::use_awaitable);
      connection.handshake_done();
      if (address.port == 0 || address.host.empty())
        throw ProtocolError(
            fmt::format("rank {} registered an invalid address '{}'", claimed, to_string(address)));
      if (finished) co_return;
      auto& member = members[static_cast<std::size_t>(claimed)];
      member.link = link;
      member.address = std::move(address);
      member.registered = true;
      ++registered;
      logger().debug("rendezvous server: rank {} registered {} ({}/{})", claimed,
                     to_string(member.address), registered, world_size);
      if (registered == world_size) co_await send_table();
    } catch (const std::exception& error) {
      if (dynamic_cast<const tcp::HandshakeRefused*>(&error) != nullptr) refused.fetch_add(1);
      if (claimed >= 0 && !members[static_cast<std::size_t>(claimed)].registered)
        members[static_cast<std::size_t>(claimed)].claimed = false;  // it may retry
      logger().warn("rendezvous server: connection from {} failed: {}", from, error.what());
    }
  }

  void stop_accepting() {
    finished = true;
    listener.close();
  }

  asio::awaitable<void> send_table() {
    stop_accepting();
    timer.cancel();
    std::vector<std::byte> table;
    try {
      transport::GroupId group_id{};
      if (RAND_bytes(group_id.data(), static_cast<int>(group_id.size())) != 1)
        throw IoError("OpenSSL RAND_bytes failed to produce a group id");
      std::vector<transport::PeerAddress> peers;
      for (const auto& member : members)
        peers.push_back(member.address);
      table = encode_table(group_id, peers);
    } catch (...) {
      complete(std::current_exception());
      co_return;
    }
    for (std::size_t rank = 0; rank < members.size(); ++rank) {
      boost::system::error_code error;
      co_await asio::async_write(*members[rank].link, asio::buffer(table),
                                 asio::redirect_error(asio::use_awaitable, error));
      if (error)
        logger().warn("rendezvous server: could not send the table to rank {}: {}", rank,
                      error.message());
      boost::system::error_code ignored;
      members[rank].link->socket().shutdown(tcp::Socket::shutdown_send, ignored);
    }
    logger().debug("rendezvous server: sent the table of {} ranks", world_size);
    complete(nullptr);
  }

  asio::awaitable<void> fail_at_deadline() {
    stop_accepting();
    std::vector<int> missing;
    for (std::size_t rank = 0; rank < members.size(); ++rank)
      if (!members[rank].registered) missing.push_back(static_cast<int>(rank));
    const std::string message =
        fmt::format("rendezvous: ranks {} did not register in time ({} of {} registered)",
                    fmt::join(missing, ", "), registered, world_size);
    const std::vector<std::byte> reply = encode_failure(message);
    for (auto& member : members) {
      if (!member.registered) continue;
      boost::system::error_code error;
      co_await asio::async_write(*member.link, asio::buffer(reply),
                                 asio::redirect_error(asio::use_awaitable, error));
      boost::system::error_code ignored;
      member.link->socket().shutdown(tcp::Socket::shutdown_send, ignored);
    }
    ErrorContext context;
    context.ranks = missing;
    complete(std::make_exception_ptr(TimeoutError(message, std::move(context))));
  }
};

RendezvousServer::RendezvousServer(const std::string& host, std::uint16_t port, int world_size,
                                   const transport::TcpOptions& link,
                                   transport::Deadline deadline) {
  if (world_size < 1)
    throw InvalidArgument(fmt::format("rendezvous server: world size {} < 1", world_size));
  impl_ = std::make_unique<Impl>(host, port, world_size, link, deadline);
  auto& impl = *impl_;
  impl.listener.start(
      [&impl](tcp::PendingConnection connection) { return impl.serve(std::move(connection)); });
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
  return impl_->listener.port();
}

void RendezvousServer::wait() {
  impl_->outcome.wait();
}

int RendezvousServer::refused_connections() const noexcept {
  return impl_->refused.load();
}

}  // namespace pulseloco::group
