#include <pulseloco/group/rendezvous_server.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <openssl/rand.h>

#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/thread_name.h>
#include <pulseloco/group/progress_lines.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/group/rendezvous_messages.h>
#include <pulseloco/transport/tcp/exposure.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/tcp/listener.h>
#include <pulseloco/transport/tcp/refusals.h>
#include <pulseloco/transport/tcp/server_outcome.h>
#include <pulseloco/transport/tcp/tls_context.h>

namespace pulseloco::group {
namespace {

namespace asio = boost::asio;
namespace tcp = transport::tcp;

// The failures wait() throws (made outside the coroutines: GCC 12 mishandles temporaries with
// destructors in them).
std::exception_ptr timed_out(const std::string& message, std::vector<int> missing) {
  ErrorContext context;
  context.ranks = std::move(missing);
  return std::make_exception_ptr(TimeoutError(message, std::move(context)));
}

std::exception_ptr refused_member(const std::string& message) {
  return std::make_exception_ptr(ProtocolError(message));
}

}  // namespace

struct RendezvousServer::Impl {
  struct Member {
    std::shared_ptr<tcp::LinkStream> link;
    transport::PeerAddress address;
    std::string from;  // where its registration came from
    bool claimed = false;
    bool registered = false;
  };

  Impl(const std::string& host, std::uint16_t port, int world, const transport::TcpOptions& link,
       transport::Deadline until, const std::string& run_id, std::chrono::milliseconds linger_for)
      : listener(io, io.get_executor(), "rendezvous server", host, port),
        timer(io),
        linger_timer(io),
        linger(linger_for),
        world_size(world),
        secret(link.secret),
        job(transport::derive_job_id(secret, run_id)),
        table_job(run_id.empty() ? transport::random_job_id() : job),
        tls(tcp::TlsContext::make(link)),
        deadline(until) {
    members.resize(static_cast<std::size_t>(world));
    told.resize(static_cast<std::size_t>(world));
  }

  asio::io_context io;
  tcp::Listener listener;
  asio::steady_timer timer;
  asio::steady_timer linger_timer;  // a failed rendezvous stops listening when it fires
  const std::chrono::milliseconds linger;
  const int world_size;
  const std::string secret;
  const transport::JobId job;                  // what registering ranks present
  const transport::JobId table_job;            // the job half of the group id the table carries
  const std::shared_ptr<tcp::TlsContext> tls;  // null: plain links
  const transport::Deadline deadline;
  std::vector<Member> members;  // touched only on the io thread
  int registered = 0;
  bool finished = false;                 // no more registrations (complete or failed)
  bool failed = false;                   // it failed: late ranks are told why while it lingers
  bool listening = true;                 // the listener is open
  std::string failed_because;            // why the rendezvous failed
  std::vector<std::byte> failure_reply;  // what the ranks are told then
  std::vector<bool> told;                // per rank: it was sent the failure
  int told_count = 0;
  tcp::RefusalRecord refusals;
  std::atomic<int> refused{0};

  tcp::ServerOutcome outcome;
  tcp::ServerOutcome closed;              // completes when the listener is closed for good
  std::optional<ProgressLines> progress;  // while ranks are missing: which
  std::thread thread;

  // A progress line of a long wait: the ranks that have not registered yet.
  void log_missing(double seconds) {
    if (finished) {
      progress->stop();
      return;
    }
    std::vector<int> missing;
    for (std::size_t rank = 0; rank < members.size(); ++rank)
      if (!members[rank].registered) missing.push_back(static_cast<int>(rank));
    logger().warn(
        "rendezvous server: waiting {:.1f} s so far for {} {} to register ({} of {} "
        "registered)",
        seconds, missing.size() == 1 ? "rank" : "ranks", fmt::join(missing, ", "), registered,
        world_size);
  }

  void complete(std::exception_ptr error) { outcome.complete(std::move(error)); }

  // Decides on an authenticated hello: "" admits it (claiming its rank), else the reason. Sets
  // `fatal` when the refusal must end the rendezvous: the process holds the secret but belongs
  // to another job or world size, or claims a rank that is taken; going on would let two jobs
  // mix, or leave one of the two claimants out with a misleading error later. Once the
  // rendezvous has failed, a rank of this job is admitted only to be sent the failure.
  std::string admit(const tcp::Hello& hello, const std::string& from, int& claimed, bool& fatal) {
    if (hello.purpose != tcp::Purpose::rendezvous)
      return "this is a rendezvous server, not a data listener";
    if (finished && !failed) return "the rendezvous is already over";
    fatal = !finished;
    if (auto mismatch = transport::group_mismatch(hello.group_id, transport::job_only_group_id(job),
                                                  /*check_group=*/false);
        !mismatch.empty())
      return mismatch;
    if (hello.world_size != static_cast<std::uint32_t>(world_size))
      return fmt::format("its world size {} differs from this rendezvous's {}", hello.world_size,
                         world_size);
    if (hello.src_rank >= hello.world_size)
      return fmt::format("rank {} is out of range", hello.src_rank);
    if (finished) {
      fatal = false;
      claimed = static_cast<int>(hello.src_rank);  // told the failure once it has registered
      return {};
    }
    auto& member = members[hello.src_rank];
    if (member.claimed)
      return fmt::format("rank {} is taken: {} registered it first", hello.src_rank, member.from);
    fatal = false;
    member.claimed = true;
    member.from = from;
    claimed = static_cast<int>(hello.src_rank);
    return {};
  }

  asio::awaitable<void> serve(tcp::PendingConnection connection) {
    const auto link = std::make_shared<tcp::LinkStream>(connection.socket(), tls);
    const std::string from = tcp::remote_description(link->socket());
    int claimed = -1;
    bool authenticated = false;
    bool fatal = false;
    try {
      const auto result = co_await tcp::server_handshake(
          *link, secret, [&](const tcp::Hello& hello) -> std::string {
            authenticated = true;  // admit runs only once the client proved the secret
            return admit(hello, from, claimed, fatal);
          });
      if (!result.accepted) {
        refused.fetch_add(1);
        const std::string refusal = fmt::format(
            "{} claiming rank {}: {}", from, result.hello.src_rank,
            authenticated ? result.refusal : std::string("failed authentication (wrong secret)"));
        connection.warn(fmt::format("rendezvous server: refused {}", refusal));
        if (fatal) {
          const std::string message = fmt::format("rendezvous: refused {}", refusal);
          co_await fail_now(refused_member(message), RendezvousFailure::refused_member, message);
        } else {
          refusals.add(refusal);
        }
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
      if (finished) {
        // It arrived, or finished its handshake, after the rendezvous failed: it learns why, as
        // the registered ranks did.
        if (failed) co_await tell_failure(*link, claimed);
        co_return;
      }
      auto& member = members[static_cast<std::size_t>(claimed)];
      member.link = link;
      member.address = std::move(address);
      member.registered = true;
      ++registered;
      logger().debug("rendezvous server: rank {} registered {} ({}/{})", claimed,
                     to_string(member.address), registered, world_size);
      if (registered == world_size) co_await send_table();
    } catch (const std::exception& error) {
      // TLS refuses a wrong key before any hello: the peer failed authentication.
      const bool refused_by_tls = dynamic_cast<const tcp::HandshakeRefused*>(&error) != nullptr;
      if (refused_by_tls) refused.fetch_add(1);
      if (claimed >= 0 && !members[static_cast<std::size_t>(claimed)].registered)
        members[static_cast<std::size_t>(claimed)].claimed = false;  // it may retry
      const std::string why = connection.failure(error);
      refusals.add(refused_by_tls ? fmt::format("{} failed authentication ({})", from, why)
                                  : fmt::format("{} dropped: {}", from, why));
      connection.warn(fmt::format("rendezvous server: connection from {} failed: {}", from, why));
    }
  }

  void stop_listening() {
    if (!listening) return;
    listening = false;
    listener.close();
    linger_timer.cancel();
    closed.complete(nullptr);
  }

  // Sends rank `rank` the failure on `link` and closes its side.
  asio::awaitable<void> tell_failure(tcp::LinkStream& link, int rank) {
    boost::system::error_code write_error;
    co_await asio::async_write(link, asio::buffer(failure_reply),
                               asio::redirect_error(asio::use_awaitable, write_error));
    boost::system::error_code ignored;
    link.socket().shutdown(tcp::Socket::shutdown_send, ignored);
    if (write_error) co_return;
    const auto index = static_cast<std::size_t>(rank);
    if (told[index]) co_return;
    told[index] = true;
    // Nobody is left to tell: the linger has no purpose.
    if (++told_count == world_size) stop_listening();
  }

  asio::awaitable<void> send_table() {
    finished = true;
    stop_listening();
    timer.cancel();
    std::vector<std::byte> table;
    try {
      // The group part is fresh for every rendezvous, so that a process of an earlier one is
      // never taken for a member of this one.
      std::array<std::uint8_t, 8> within{};
      if (RAND_bytes(within.data(), static_cast<int>(within.size())) != 1)
        throw IoError("OpenSSL RAND_bytes failed to produce a group id");
      const transport::GroupId group_id = transport::make_group_id(table_job, within);
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
    std::vector<int> missing;
    for (std::size_t rank = 0; rank < members.size(); ++rank)
      if (!members[rank].registered) missing.push_back(static_cast<int>(rank));
    const std::string message =
        fmt::format("rendezvous: {} {} did not register in time ({} of {} registered){}",
                    missing.size() == 1 ? "rank" : "ranks", fmt::join(missing, ", "), registered,
                    world_size, refusals.summary());
    co_await fail_now(timed_out(message, missing), RendezvousFailure::timed_out, message);
  }

  // Ends the rendezvous with `error` (what wait() throws), telling every registered rank
  // `message` first.
  asio::awaitable<void> fail_now(std::exception_ptr error, RendezvousFailure why,
                                 std::string message) {
    if (finished) co_return;
    finished = true;
    failed = true;
    timer.cancel();
    failed_because = message;
    failure_reply = encode_failure(why, message);
    // Late ranks are told while it lingers; the listener stays open until then.
    linger_timer.expires_after(linger);
    linger_timer.async_wait([this](const boost::system::error_code& cancelled) {
      if (!cancelled) stop_listening();
    });
    for (std::size_t rank = 0; rank < members.size(); ++rank)
      if (members[rank].registered)
        co_await tell_failure(*members[rank].link, static_cast<int>(rank));
    complete(std::move(error));
  }
};

RendezvousServer::RendezvousServer(const std::string& host, std::uint16_t port, int world_size,
                                   const transport::TcpOptions& link, transport::Deadline deadline,
                                   const std::string& run_id, std::chrono::milliseconds linger) {
  if (world_size < 1)
    throw InvalidArgument(fmt::format("rendezvous server: world size {} < 1", world_size));
  tcp::require_authentication_beyond_loopback(
      "rendezvous server", host, transport::effective_link_security(link), link.allow_insecure);
  if (linger < std::chrono::milliseconds::zero())
    throw InvalidArgument(
        fmt::format("rendezvous server: linger {} ms < 0", static_cast<long long>(linger.count())));
  impl_ = std::make_unique<Impl>(host, port, world_size, link, deadline, run_id, linger);
  auto& impl = *impl_;
  impl.listener.start(
      [&impl](tcp::PendingConnection connection) { return impl.serve(std::move(connection)); });
  impl.progress.emplace(impl.io, [&impl](double seconds) { impl.log_missing(seconds); });
  impl.timer.expires_at(deadline);
  impl.timer.async_wait([&impl](const boost::system::error_code& error) {
    if (error || impl.finished) return;
    asio::co_spawn(impl.io, impl.fail_at_deadline(), asio::detached);
  });
  impl.thread = std::thread([&impl] { impl.io.run(); });
  set_thread_name(impl.thread.native_handle(), "pl-rendezvous");
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

void RendezvousServer::wait_closed() {
  impl_->closed.wait();
}

std::exception_ptr RendezvousServer::failure() const {
  return impl_->outcome.failure();
}

int RendezvousServer::refused_connections() const noexcept {
  return impl_->refused.load();
}

}  // namespace pulseloco::group
