// The elastic-membership coordinator (coordinator.h); membership_messages.h has its messages.
//
// State machine of the coordinator (docs/elastic.md is written from this block)
// -----------------------------------------------------------------------------
// Phases: forming (generation 0) -> running (generations 1, 2, ...) -> finished | stopped.
// A registered worker is, at any time, one of:
//   idle     registered, has not asked for a group yet
//   waiting  asked next_group and is not a member of the current generation (a joiner); joiners
//            queue in arrival order
//   member   in the current generation, in a window (no request pending)
//   asked    in the current generation, waiting in next_group for the next generation
//   left     sent leave (it is no longer waited for; its connection is closed)
//   lost     its connection closed, or it violated the protocol
//   removed  excluded at a regroup for not asking within the regroup timeout; every later
//            request of this connection gets an error reply (MembershipError on the worker);
//            the worker may register again, on a new connection, as a new worker
//
// forming: generation 1 forms as soon as initial_workers workers wait; they are its members in
//   arrival order. A waiting worker whose connection closes leaves the queue.
// running, generation g:
//   * a regroup of g is TRIGGERED by a member asking next_group (it saw a failure; its reason is
//     logged), or by a boundary decision "regroup". It starts the regroup timer.
//   * boundary(window) from a member: while a regroup of g is pending the answer is "regroup".
//     Otherwise the decision for (g, window) is taken once, at the first member's question, and
//     recorded, so every member of g gets the same answer for that window: "regroup" iff
//     workers are waiting, there is room for at least one (max_workers), and
//     window % join_every_windows == 0.
//   * a member leaving or being lost does not trigger a regroup by itself (its peers' collectives
//     fail and they ask); it is simply not waited for.
//   * a pending regroup COMPLETES when every member of g has asked, left or been lost, or when
//     the regroup timeout has passed since the trigger; members that did neither are removed.
//     Then generation g+1 is formed from the members that asked, in their rank order in g,
//     followed by waiting workers in arrival order up to max_workers. If no member asked, the
//     run is finished when some member left, else it stops ("no member of generation g asked
//     for a new group"): a generation of new workers alone would have no state to start from.
//     If g+1 would have fewer than min_workers members, the run stops ("the group fell to N
//     workers, below the minimum M").
//   * with no regroup pending, once no member of g is still in a window (all left or were
//     lost): finished when at least one left, else stopped ("every worker of generation g was
//     lost").
// Every new generation gets a fresh group key (16 random bytes in hex, and the generation), and
// each member is told its rank, every member's id and data address in rank order, and which
// workers joined and which members of g are no longer in it.
// finished: wait() returns; waiting workers (and any later next_group) get the error "the run
//   has finished".
// stopped: wait() throws MembershipError with the reason; every waiting worker (members that
//   asked, and joiners) gets that reason as an error reply, and so does any later request.
// Every transition is logged at info level (warn for refusals, violations, removals; error when
// the run stops).
#include <pulseloco/elastic/coordinator.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <openssl/rand.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/thread_name.h>
#include <pulseloco/elastic/membership_messages.h>
#include <pulseloco/transport/tcp/exposure.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/tcp/listener.h>
#include <pulseloco/transport/tcp/server_outcome.h>
#include <pulseloco/transport/tcp/tls_context.h>

namespace pulseloco::elastic {
namespace {

namespace asio = boost::asio;
namespace tcp = transport::tcp;

// A worker that does not take a reply of a few bytes within this long is treated as lost.
constexpr auto kWriteTimeout = std::chrono::seconds(30);
// How long the coordinator's destructor lets queued replies drain.
constexpr auto kShutdownGrace = std::chrono::seconds(2);

bool is_wildcard_host(std::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::";
}

std::string random_group_key(std::uint64_t generation) {
  std::array<std::uint8_t, 16> bytes{};
  if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1)
    throw IoError("OpenSSL RAND_bytes failed to produce a group key");
  std::string key;
  for (const auto byte : bytes)
    key += fmt::format("{:02x}", byte);
  return fmt::format("{}-g{}", key, generation);
}

std::string plural(std::size_t n, std::string_view word) {
  return fmt::format("{} {}{}", n, word, n == 1 ? "" : "s");
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The coordinator

struct Coordinator::Impl {
  enum class Phase : std::uint8_t { forming, running, finished, stopped };
  enum class Standing : std::uint8_t { idle, waiting, member, asked, left, lost, removed };

  struct Connection {
    Connection(std::shared_ptr<tcp::Socket> accepted, std::shared_ptr<tcp::TlsContext> tls)
        : socket(accepted), link(std::move(accepted), std::move(tls)) {}
    const std::shared_ptr<tcp::Socket> socket;
    tcp::LinkStream link;  // over `socket`
    std::string from;      // remote address, for the log
    std::string worker_id;
    transport::PeerAddress data_address;
    bool registered = false;
    bool closed = false;           // on_closed ran: no longer part of anything
    bool request_pending = false;  // a request is unanswered (next_group)
    Standing standing = Standing::idle;
    std::uint64_t removed_at = 0;  // the generation it was removed from
    std::deque<std::string> outbox;
    bool writing = false;
    bool close_after_flush = false;

    [[nodiscard]] std::string name() const {
      return registered ? fmt::format("worker {}", worker_id) : fmt::format("connection {}", from);
    }
  };
  using ConnectionPtr = std::shared_ptr<Connection>;

  explicit Impl(CoordinatorOptions coordinator_options)
      : options(std::move(coordinator_options)),
        job(transport::derive_job_id(options.secret, options.run_id)),
        tls(tcp::TlsContext::make(options.link_security, options.secret, options.tls_files)),
        regroup_timer(io),
        shutdown_timer(io) {}

  const CoordinatorOptions options;
  const transport::JobId job;
  const std::shared_ptr<tcp::TlsContext> tls;  // null: plain links
  asio::io_context io;
  std::optional<tcp::Listener> listener;
  asio::steady_timer regroup_timer;
  asio::steady_timer shutdown_timer;
  std::thread thread;

  // --- State of the io thread --------------------------------------------------------------
  std::set<ConnectionPtr> connections;  // every open connection
  Phase phase = Phase::forming;
  std::vector<ConnectionPtr> members;  // the current generation, in rank order
  std::deque<ConnectionPtr> joiners;   // waiting workers, in arrival order
  bool regroup_pending = false;
  std::uint64_t regroup_serial = 0;  // tells a stale timer completion from the current one
  std::map<std::uint64_t, bool> boundary_decisions;  // window -> regroup, this generation
  std::string end_reason;                            // why the run stopped
  bool shutting_down = false;

  // --- Shared with other threads -------------------------------------------------------------
  std::atomic<std::uint64_t> current_generation{0};
  std::atomic<int> refused{0};
  std::atomic<int> waiting{0};
  tcp::ServerOutcome outcome;

  // ---------------------------------------------------------------------------------------------
  // Connections and messages

  void complete(std::exception_ptr error) { outcome.complete(std::move(error)); }

  static void close_socket(Connection& connection) {
    boost::system::error_code ignored;
    connection.socket->shutdown(tcp::Socket::shutdown_both, ignored);
    connection.socket->close(ignored);
  }

  void send(const ConnectionPtr& connection, const Json& message) {
    if (connection->closed) return;
    connection->outbox.push_back(encode_message(message));
    if (connection->writing) return;
    connection->writing = true;
    asio::co_spawn(io, write_loop(connection), asio::detached);
  }

  void send_error(const ConnectionPtr& connection, const std::string& message) {
    connection->request_pending = false;
    send(connection, Json{{"type", "error"}, {"message", message}});
  }

  // Sends the queued messages one after another; a connection that cannot take them is closed
  // (its read loop then reports it lost).
  asio::awaitable<void> write_loop(ConnectionPtr connection) {
    // Queued messages go out even after the bookkeeping forgot the connection (a refusal, the
    // acknowledgement of a leave); a closed socket ends the loop.
    while (!connection->outbox.empty()) {
      const std::string frame = std::move(connection->outbox.front());
      connection->outbox.pop_front();
      boost::system::error_code error;
      {
        tcp::Watchdog watchdog(io.get_executor(), transport::Clock::now() + kWriteTimeout,
                               [connection] { close_socket(*connection); });
        co_await asio::async_write(connection->link, asio::buffer(frame),
                                   asio::redirect_error(asio::use_awaitable, error));
      }
      if (error) {
        if (!connection->closed && !shutting_down)
          logger().warn("membership coordinator: cannot send to {}: {}", connection->name(),
                        error.message());
        close_socket(*connection);
        break;
      }
    }
    connection->writing = false;
    if (connection->close_after_flush) {
      close_socket(*connection);
      if (shutting_down) forget(connection);
    }
  }

  asio::awaitable<Json> read_message(Connection& connection) {
    std::array<std::byte, kLengthBytes> head{};
    co_await asio::async_read(connection.link, asio::buffer(head), asio::use_awaitable);
    const std::uint32_t length = decode_length(head);
    std::string body(length, '\0');
    co_await asio::async_read(connection.link, asio::buffer(body), asio::use_awaitable);
    co_return parse_message(body);
  }

  // Removes a connection from the bookkeeping (once); during shutdown, the last one ends the
  // grace period early.
  void forget(const ConnectionPtr& connection) {
    connections.erase(connection);
    if (shutting_down && connections.empty()) shutdown_timer.cancel();
  }

  void refuse(const ConnectionPtr& connection, const tcp::PendingConnection& pending,
              std::string_view reason) {
    refused.fetch_add(1);
    pending.warn(fmt::format("membership coordinator: refused a connection from {}: {}",
                             connection->from, reason));
  }

  // A connection the listener accepted: its handshake and registration, then its requests until
  // it closes.
  asio::awaitable<void> serve(tcp::PendingConnection pending) {
    if (shutting_down) co_return;
    const auto connection = std::make_shared<Connection>(pending.socket(), tls);
    connection->from = tcp::remote_description(*connection->socket);
    tcp::apply_socket_options(*connection->socket, transport::TcpOptions{});
    connections.insert(connection);
    if (!co_await admit(connection, pending)) {
      if (!connection->writing) {
        close_socket(*connection);
        forget(connection);
      } else {
        connection->close_after_flush = true;  // the refusal is on its way
        connection->closed = true;
        forget(connection);
      }
      co_return;
    }
    std::string problem;
    bool violation = false;
    try {
      while (!connection->closed) {
        const Json message = co_await read_message(*connection);
        dispatch(connection, message);
      }
    } catch (const ProtocolError& error) {
      violation = true;
      problem = error.message();
    } catch (const nlohmann::json::exception& error) {
      violation = true;
      problem = error.what();
    } catch (const boost::system::system_error& error) {
      problem = error.code() == asio::error::eof ? "connection closed" : error.code().message();
    } catch (const std::exception& error) {
      problem = error.what();
      logger().error("membership coordinator: internal error while serving {}: {}",
                     connection->name(), problem);
    }
    if (violation && !shutting_down)
      logger().warn(
          "membership coordinator: protocol violation by {} (from {}): {}; closing "
          "its connection",
          connection->name(), connection->from, problem);
    on_closed(connection, problem);
  }

  // Handshake and registration, within the listener's handshake deadline; false when the
  // connection was refused.
  asio::awaitable<bool> admit(const ConnectionPtr& connection, tcp::PendingConnection& pending) {
    std::string refusal;
    try {
      const auto result = co_await tcp::server_handshake(
          connection->link, options.secret, [this](const tcp::Hello& hello) -> std::string {
            if (hello.purpose != tcp::Purpose::membership)
              return "this is a membership coordinator, not a rendezvous server or a data "
                     "listener";
            return transport::group_mismatch(hello.group_id, transport::job_only_group_id(job),
                                             /*check_group=*/false);
          });
      if (!result.accepted) {
        refuse(connection, pending, result.refusal);
        co_return false;
      }
      const Json message = co_await read_message(*connection);
      refusal = register_worker(connection, message);
      pending.handshake_done();
      if (refusal.empty()) co_return true;
    } catch (const std::exception& error) {
      if (shutting_down) co_return false;
      if (pending.timed_out() || pending.dropped_for_room()) {
        refusal = pending.failure(error);
      } else if (const auto* io_error = dynamic_cast<const boost::system::system_error*>(&error)) {
        refusal = fmt::format("connection failed during the handshake: {}",
                              io_error->code() == asio::error::eof ? std::string("closed")
                                                                   : io_error->code().message());
      } else {
        refusal = error.what();
      }
      refuse(connection, pending, refusal);
      co_return false;
    }
    refuse(connection, pending, refusal);
    send(connection, Json{{"type", "refused"}, {"reason", refusal}});
    co_return false;
  }

  // Validates a registration; returns the refusal, or "" once the worker is registered.
  std::string register_worker(const ConnectionPtr& connection, const Json& message) {
    if (message["type"] != "register")
      return fmt::format("expected a registration, got a '{}' message",
                         message["type"].get<std::string>());
    const auto id = message.find("worker_id");
    const auto host = message.find("data_host");
    const auto port = message.find("data_port");
    if (id == message.end() || !id->is_string() || host == message.end() || !host->is_string() ||
        port == message.end() || !port->is_number_unsigned())
      return "malformed registration (worker_id, data_host and data_port are required)";
    const std::string worker_id = id->get<std::string>();
    if (auto problem = check_name(worker_id, "worker id"); !problem.empty()) return problem;
    std::string data_host = host->get<std::string>();
    if (data_host.size() > kMaxNameBytes)
      return fmt::format("the data host is longer than {} bytes", kMaxNameBytes);
    const auto data_port = port->get<std::uint64_t>();
    if (data_port == 0 || data_port > 65535)
      return fmt::format("data port {} is not in 1..65535", data_port);
    for (const auto& other : connections) {
      if (other == connection || !other->registered || other->closed) continue;
      if (other->worker_id == worker_id && other->standing != Standing::removed &&
          other->standing != Standing::left)
        return fmt::format("worker id '{}' is taken by a live worker (connected from {})",
                           worker_id, other->from);
    }
    if (is_wildcard_host(data_host)) {
      boost::system::error_code error;
      const auto remote = connection->socket->remote_endpoint(error);
      if (error) return "cannot tell the address of the connection for its wildcard data host";
      data_host = remote.address().to_string();
    }
    connection->worker_id = worker_id;
    connection->data_address =
        transport::PeerAddress{data_host, static_cast<std::uint16_t>(data_port)};
    connection->registered = true;
    logger().info("membership coordinator: worker {} registered from {} (data address {})",
                  worker_id, connection->from, to_string(connection->data_address));
    send(connection, Json{{"type", "registered"}, {"generation", current_generation.load()}});
    return {};
  }

  void dispatch(const ConnectionPtr& connection, const Json& message) {
    const std::string type = message["type"].get<std::string>();
    if (connection->standing == Standing::left)
      throw ProtocolError(fmt::format("a '{}' message after leave", type));
    if (type == "leave") {
      on_leave(connection);
      return;
    }
    if (connection->request_pending)
      throw ProtocolError(fmt::format("a '{}' request while its next_group is unanswered", type));
    if (type == "next_group") {
      on_next_group(connection, string_field(message, "reason"));
    } else if (type == "boundary") {
      on_boundary(connection, unsigned_field(message, "window"));
    } else {
      throw ProtocolError(fmt::format("unknown message type '{}'", type));
    }
  }

  // The error every request gets once the run is over or this worker was removed; "" if none.
  [[nodiscard]] std::string refusal_for(const Connection& connection) const {
    if (phase == Phase::stopped) return end_reason;
    if (phase == Phase::finished) return "the run has finished";
    if (connection.standing == Standing::removed)
      return fmt::format(
          "worker {} was removed from the group at generation {}: it did not ask for a new "
          "group within the regroup timeout ({} ms); register again to rejoin",
          connection.worker_id, connection.removed_at, options.regroup_timeout.count());
    return {};
  }

  [[nodiscard]] std::uint64_t generation() const { return current_generation.load(); }

  void on_next_group(const ConnectionPtr& connection, const std::string& reason) {
    if (auto refusal = refusal_for(*connection); !refusal.empty()) {
      send_error(connection, refusal);
      return;
    }
    connection->request_pending = true;
    if (connection->standing == Standing::member) {
      connection->standing = Standing::asked;
      logger().info(
          "membership coordinator: worker {} asks for a new group after generation {}: "
          "{}",
          connection->worker_id, generation(), reason);
      if (!regroup_pending)
        start_regroup(fmt::format("worker {} asked ({})", connection->worker_id, reason));
      check_regroup();
      return;
    }
    connection->standing = Standing::waiting;
    joiners.push_back(connection);
    waiting.store(static_cast<int>(joiners.size()));
    logger().info("membership coordinator: worker {} waits to join ({}); {} waiting",
                  connection->worker_id, reason, plural(joiners.size(), "worker"));
    if (phase == Phase::forming) form_first();
  }

  void on_boundary(const ConnectionPtr& connection, std::uint64_t window) {
    if (auto refusal = refusal_for(*connection); !refusal.empty()) {
      send_error(connection, refusal);
      return;
    }
    if (connection->standing != Standing::member) {
      send_error(connection, fmt::format("worker {} is not a member of generation {}; call "
                                         "next_group first",
                                         connection->worker_id, generation()));
      return;
    }
    bool regroup = true;
    if (!regroup_pending) {
      const auto recorded = boundary_decisions.find(window);
      if (recorded != boundary_decisions.end()) {
        regroup = recorded->second;
      } else {
        const auto in_group = static_cast<std::size_t>(
            std::count_if(members.begin(), members.end(),
                          [](const auto& m) { return m->standing == Standing::member; }));
        const std::size_t admissible = admissible_joiners(in_group);
        regroup = admissible > 0 && window % options.join_every_windows == 0;
        boundary_decisions.emplace(window, regroup);
        if (regroup)
          start_regroup(fmt::format("admitting {} at the boundary before window {}",
                                    plural(admissible, "waiting worker"), window));
      }
    }
    send(connection, Json{{"type", "boundary"}, {"regroup", regroup}});
  }

  void on_leave(const ConnectionPtr& connection) {
    const Standing before = connection->standing;
    connection->standing = Standing::left;
    connection->request_pending = false;
    if (before == Standing::waiting) drop_joiner(connection);
    logger().info("membership coordinator: worker {} left{}", connection->worker_id,
                  before == Standing::member || before == Standing::asked
                      ? fmt::format(" (a member of generation {})", generation())
                      : std::string());
    send(connection, Json{{"type", "bye"}});
    connection->close_after_flush = true;
    if (before == Standing::member || before == Standing::asked) on_member_gone();
  }

  void on_closed(const ConnectionPtr& connection, const std::string& problem) {
    if (connection->closed) return;
    connection->closed = true;
    close_socket(*connection);
    forget(connection);
    if (shutting_down || !connection->registered) return;
    const Standing before = connection->standing;
    if (before == Standing::left || before == Standing::removed) return;
    connection->standing = Standing::lost;
    connection->request_pending = false;
    if (before == Standing::waiting) {
      drop_joiner(connection);
      logger().info("membership coordinator: worker {} lost while waiting to join ({})",
                    connection->worker_id, problem);
      return;
    }
    if (before == Standing::member || before == Standing::asked) {
      logger().info("membership coordinator: worker {} lost (a member of generation {}: {})",
                    connection->worker_id, generation(), problem);
      on_member_gone();
      return;
    }
    logger().info("membership coordinator: worker {} lost ({})", connection->worker_id, problem);
  }

  void drop_joiner(const ConnectionPtr& connection) {
    std::erase(joiners, connection);
    waiting.store(static_cast<int>(joiners.size()));
  }

  // ---------------------------------------------------------------------------------------------
  // Generations

  [[nodiscard]] std::size_t admissible_joiners(std::size_t group_size) const {
    if (options.max_workers <= 0) return joiners.size();
    const auto limit = static_cast<std::size_t>(options.max_workers);
    return group_size >= limit ? 0 : std::min(joiners.size(), limit - group_size);
  }

  void start_regroup(const std::string& cause) {
    regroup_pending = true;
    const std::uint64_t serial = ++regroup_serial;
    logger().info("membership coordinator: regroup of generation {} triggered: {}", generation(),
                  cause);
    regroup_timer.expires_after(options.regroup_timeout);
    regroup_timer.async_wait([this, serial](const boost::system::error_code& error) {
      if (error || !regroup_pending || serial != regroup_serial || shutting_down) return;
      guarded([this] { complete_regroup(); });
    });
  }

  // A member left or was lost.
  void on_member_gone() {
    if (phase != Phase::running) return;
    if (regroup_pending) {
      check_regroup();
      return;
    }
    const bool someone_in_window = std::any_of(members.begin(), members.end(), [](const auto& m) {
      return m->standing == Standing::member || m->standing == Standing::asked;
    });
    if (someone_in_window) return;
    const bool someone_left = std::any_of(members.begin(), members.end(), [](const auto& m) {
      return m->standing == Standing::left;
    });
    if (someone_left) {
      finish();
    } else {
      stop(fmt::format("every worker of generation {} was lost", generation()));
    }
  }

  void check_regroup() {
    if (!regroup_pending) return;
    const bool still_waiting_for_one =
        std::any_of(members.begin(), members.end(),
                    [](const auto& m) { return m->standing == Standing::member; });
    if (!still_waiting_for_one) complete_regroup();
  }

  void complete_regroup() {
    regroup_pending = false;
    regroup_timer.cancel();
    std::vector<ConnectionPtr> survivors;
    bool someone_left = false;
    for (const auto& member : members) {
      if (member->standing == Standing::asked) survivors.push_back(member);
      if (member->standing == Standing::left) someone_left = true;
      if (member->standing == Standing::member) {
        member->standing = Standing::removed;
        member->removed_at = generation();
        logger().warn(
            "membership coordinator: worker {} removed from the group at generation {}: "
            "it did not ask for a new group within the regroup timeout ({} ms)",
            member->worker_id, generation(), options.regroup_timeout.count());
      }
    }
    if (survivors.empty()) {
      if (someone_left) {
        finish();
      } else {
        stop(fmt::format("no member of generation {} asked for a new group", generation()));
      }
      return;
    }
    const std::size_t admitted = admissible_joiners(survivors.size());
    const std::size_t size = survivors.size() + admitted;
    if (size < static_cast<std::size_t>(options.min_workers)) {
      stop(fmt::format("the group fell to {}, below the minimum {}", plural(size, "worker"),
                       options.min_workers));
      return;
    }
    for (std::size_t i = 0; i < admitted; ++i)
      survivors.push_back(joiners[i]);
    form(std::move(survivors), admitted);
  }

  void form_first() {
    if (joiners.size() < static_cast<std::size_t>(options.initial_workers)) return;
    const auto count = static_cast<std::size_t>(options.initial_workers);
    std::vector<ConnectionPtr> first(joiners.begin(),
                                     joiners.begin() + static_cast<std::ptrdiff_t>(count));
    form(std::move(first), count);
    phase = Phase::running;
  }

  // Makes `group` (previous members first, then `admitted` joiners from the queue's front) the
  // next generation and tells each member its place.
  void form(std::vector<ConnectionPtr> group, std::size_t admitted) {
    const std::uint64_t next = generation() + 1;
    const std::string group_key = random_group_key(next);  // before any state changes
    std::vector<std::string> ids;
    Json workers = Json::array();
    for (const auto& member : group) {
      ids.push_back(member->worker_id);
      workers.push_back(Json{{"id", member->worker_id},
                             {"host", member->data_address.host},
                             {"port", member->data_address.port}});
    }
    std::vector<std::string> joined;
    for (const auto& member : group)
      if (member->standing == Standing::waiting) joined.push_back(member->worker_id);
    std::vector<std::string> lost;
    for (const auto& member : members)
      if (std::find(group.begin(), group.end(), member) == group.end())
        lost.push_back(member->worker_id);

    joiners.erase(joiners.begin(), joiners.begin() + static_cast<std::ptrdiff_t>(admitted));
    waiting.store(static_cast<int>(joiners.size()));
    members = std::move(group);
    boundary_decisions.clear();
    current_generation.store(next);
    logger().info(
        "membership coordinator: generation {} formed with {}: [{}]; joined [{}]; "
        "lost [{}]; {} waiting",
        next, plural(members.size(), "worker"), fmt::join(ids, ", "), fmt::join(joined, ", "),
        fmt::join(lost, ", "), joiners.size());
    for (std::size_t rank = 0; rank < members.size(); ++rank) {
      auto& member = members[rank];
      member->standing = Standing::member;
      member->request_pending = false;
      send(member, Json{{"type", "group"},
                        {"generation", next},
                        {"rank", rank},
                        {"workers", workers},
                        {"group_key", group_key},
                        {"joined", joined},
                        {"lost", lost}});
    }
  }

  void finish() {
    phase = Phase::finished;
    regroup_pending = false;
    regroup_timer.cancel();
    logger().info("membership coordinator: the run has finished (generation {}); {} turned away",
                  generation(), plural(joiners.size(), "waiting worker"));
    for (const auto& joiner : joiners)
      send_error(joiner, "the run has finished");
    joiners.clear();
    waiting.store(0);
    complete(nullptr);
  }

  void stop(std::string reason) {
    phase = Phase::stopped;
    regroup_pending = false;
    regroup_timer.cancel();
    end_reason = std::move(reason);
    logger().error("membership coordinator: the run stops: {}", end_reason);
    for (const auto& member : members)
      if (member->request_pending) send_error(member, end_reason);
    for (const auto& joiner : joiners)
      send_error(joiner, end_reason);
    joiners.clear();
    waiting.store(0);
    complete(std::make_exception_ptr(MembershipError(end_reason)));
  }

  // Runs a state-machine step outside a connection's coroutine; a failure in it (which would be
  // a bug or an exhausted system) is logged instead of escaping io.run().
  template <typename Step>
  void guarded(Step step) {
    try {
      step();
    } catch (const std::exception& error) {
      logger().error("membership coordinator: internal error: {}", error.what());
    }
  }

  void begin_shutdown() {
    shutting_down = true;
    listener->close();
    regroup_timer.cancel();
    for (const auto& connection :
         std::vector<ConnectionPtr>(connections.begin(), connections.end())) {
      if (connection->writing) {
        connection->close_after_flush = true;  // let its last reply go out
      } else {
        close_socket(*connection);
        forget(connection);
      }
    }
    if (connections.empty()) return;
    shutdown_timer.expires_after(kShutdownGrace);
    shutdown_timer.async_wait([this](const boost::system::error_code& error) {
      if (!error) io.stop();
    });
  }
};

Coordinator::Coordinator(CoordinatorOptions options) {
  if (options.initial_workers < 1)
    throw InvalidArgument(fmt::format("coordinator: initial_workers is {}; it must be at least 1",
                                      options.initial_workers));
  if (options.min_workers < 1 || options.min_workers > options.initial_workers)
    throw InvalidArgument(
        fmt::format("coordinator: min_workers is {}; it must be in 1..initial_workers ({})",
                    options.min_workers, options.initial_workers));
  if (options.max_workers < 0 ||
      (options.max_workers > 0 && options.max_workers < options.initial_workers))
    throw InvalidArgument(fmt::format(
        "coordinator: max_workers is {}; it must be 0 (no limit) or at least initial_workers ({})",
        options.max_workers, options.initial_workers));
  if (options.join_every_windows < 1)
    throw InvalidArgument("coordinator: join_every_windows must be at least 1");
  if (options.regroup_timeout.count() <= 0)
    throw InvalidArgument(fmt::format("coordinator: regroup_timeout is {} ms; it must be positive",
                                      options.regroup_timeout.count()));
  tcp::require_authentication_beyond_loopback(
      "membership coordinator", options.host,
      transport::effective_link_security(options.link_security, options.secret, options.tls_files),
      options.allow_insecure);
  impl_ = std::make_unique<Impl>(std::move(options));
  auto& impl = *impl_;
  const std::string& host = impl.options.host;
  impl.listener.emplace(impl.io, impl.io.get_executor(), "membership coordinator", host,
                        impl.options.port);
  logger().info(
      "membership coordinator: listening on {}:{} (initial {}, minimum {}, maximum {}, joins "
      "every {} windows, regroup timeout {} ms)",
      host, impl.listener->port(), impl.options.initial_workers, impl.options.min_workers,
      impl.options.max_workers == 0 ? std::string("unlimited")
                                    : std::to_string(impl.options.max_workers),
      impl.options.join_every_windows, impl.options.regroup_timeout.count());
  impl.listener->start(
      [&impl](tcp::PendingConnection connection) { return impl.serve(std::move(connection)); });
  impl.thread = std::thread([&impl] {
    set_this_thread_name("pl-membership");
    for (;;) {
      try {
        impl.io.run();
        return;
      } catch (const std::exception& error) {  // a bug: keep serving the other workers
        logger().error("membership coordinator: internal error: {}", error.what());
      }
    }
  });
}

Coordinator::~Coordinator() {
  asio::post(impl_->io, [&impl = *impl_] { impl.begin_shutdown(); });
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::uint16_t Coordinator::port() const noexcept {
  return impl_->listener->port();
}

std::uint64_t Coordinator::generation() const {
  return impl_->current_generation.load();
}

void Coordinator::wait() {
  impl_->outcome.wait();
}

int Coordinator::refused_connections() const noexcept {
  return impl_->refused.load();
}

int Coordinator::waiting_workers() const noexcept {
  return impl_->waiting.load();
}
}  // namespace pulseloco::elastic
