// The elastic-membership coordinator and its client (transport/membership.h).
//
// Wire protocol
// -------------
// One TCP connection per worker, for the worker's whole life. It starts with the HMAC-SHA256
// challenge-response of tcp/handshake.h (purpose `membership`; any other purpose, a wrong secret
// or a malformed hello is refused). After it, both directions carry messages: a u32
// little-endian length (1 .. 1 MiB) followed by that many bytes of UTF-8 JSON, an object with a
// string "type". Every request gets exactly one reply, in order.
//
//   worker -> coordinator                          coordinator -> worker
//   {type: register, worker_id,                    {type: registered, generation}
//    data_host, data_port}                         {type: refused, reason}  (connection closed)
//   {type: next_group, reason}                     {type: group, generation, rank, workers:
//                                                    [{id, host, port}], group_key, joined, lost}
//                                                  {type: error, message}
//   {type: boundary, window}                       {type: boundary, regroup}  or  {type: error}
//   {type: leave}                                  {type: bye}  (connection closed)
//
// The registration must complete within kRegistrationTimeout of the connection. A wildcard or
// empty data_host is replaced by the address the connection comes from. A message that is not
// a framed JSON object of a known type, a length above the limit, or a second request while one
// is unanswered is a protocol violation: the coordinator logs it and closes that connection,
// and the worker is treated as lost. Nothing such a connection does reaches other workers.
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
#include <pulseloco/transport/membership.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <openssl/rand.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/thread_name.h>
#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/waiting.h>

namespace pulseloco::transport {
namespace {

namespace asio = boost::asio;
using tcp::Socket;
using Json = nlohmann::json;

// Requests and replies are a few hundred bytes (a group table a few KiB); anything near this
// bound is not a membership message.
constexpr std::uint32_t kMaxMessageBytes = std::uint32_t{1} << 20;
// A connection gets this long to authenticate and register.
constexpr auto kRegistrationTimeout = std::chrono::seconds(10);
// A worker that does not take a reply of a few bytes within this long is treated as lost.
constexpr auto kWriteTimeout = std::chrono::seconds(30);
// How long leave() waits for the coordinator's acknowledgement.
constexpr auto kLeaveTimeout = std::chrono::seconds(5);
// How long the coordinator's destructor lets queued replies drain.
constexpr auto kShutdownGrace = std::chrono::seconds(2);
constexpr std::size_t kMaxNameBytes = 255;

std::string encode_frame(const Json& message) {
  const std::string body = message.dump(-1, ' ', false, Json::error_handler_t::replace);
  const auto length = static_cast<std::uint32_t>(body.size());
  std::string frame(4, '\0');
  for (int i = 0; i < 4; ++i)
    frame[static_cast<std::size_t>(i)] = static_cast<char>(length >> (8 * i));
  frame += body;
  return frame;
}

std::uint32_t decode_length(const std::uint8_t* bytes) {
  std::uint32_t length = 0;
  for (int i = 3; i >= 0; --i)
    length = (length << 8) | bytes[i];
  return length;
}

void check_length(std::uint32_t length) {
  if (length == 0 || length > kMaxMessageBytes)
    throw ProtocolError(fmt::format("a message of {} bytes (membership messages are 1 to {} bytes)",
                                    length, kMaxMessageBytes));
}

Json parse_message(std::string_view body) {
  Json message = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (message.is_discarded() || !message.is_object() || !message.contains("type") ||
      !message["type"].is_string())
    throw ProtocolError("a message that is not a JSON object with a string \"type\"");
  return message;
}

// A string field of a message; throws ProtocolError naming it when absent or of another type.
std::string string_field(const Json& message, const char* name) {
  const auto it = message.find(name);
  if (it == message.end() || !it->is_string())
    throw ProtocolError(fmt::format("'{}' message without a string '{}'",
                                    message["type"].get<std::string>(), name));
  return it->get<std::string>();
}

std::uint64_t unsigned_field(const Json& message, const char* name) {
  const auto it = message.find(name);
  if (it == message.end() || !it->is_number_unsigned())
    throw ProtocolError(fmt::format("'{}' message without an unsigned integer '{}'",
                                    message["type"].get<std::string>(), name));
  return it->get<std::uint64_t>();
}

std::string check_name(std::string_view name, std::string_view what) {
  if (name.empty()) return fmt::format("the {} is empty", what);
  if (name.size() > kMaxNameBytes)
    return fmt::format("the {} is longer than {} bytes", what, kMaxNameBytes);
  for (const char c : name)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      return fmt::format("the {} contains a control character", what);
  return {};
}

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
    explicit Connection(asio::io_context& io) : socket(io) {}
    Socket socket;
    std::string from;  // remote address, for the log
    std::string worker_id;
    PeerAddress data_address;
    bool registered = false;
    bool closed = false;           // on_closed ran: no longer part of anything
    bool request_pending = false;  // a request is unanswered (next_group)
    bool registration_timed_out = false;
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
        acceptor(io),
        regroup_timer(io),
        shutdown_timer(io) {}

  const CoordinatorOptions options;
  asio::io_context io;
  tcp::Acceptor acceptor;
  asio::steady_timer regroup_timer;
  asio::steady_timer shutdown_timer;
  std::uint16_t listening_port = 0;
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
  std::mutex mutex;
  std::condition_variable changed;
  bool done = false;
  std::exception_ptr failure;

  // ---------------------------------------------------------------------------------------------
  // Connections and messages

  void complete(std::exception_ptr error) {
    {
      const std::lock_guard lock(mutex);
      if (done) return;
      done = true;
      failure = std::move(error);
    }
    changed.notify_all();
  }

  static void close_socket(Connection& connection) {
    boost::system::error_code ignored;
    connection.socket.shutdown(Socket::shutdown_both, ignored);
    connection.socket.close(ignored);
  }

  void send(const ConnectionPtr& connection, const Json& message) {
    if (connection->closed) return;
    connection->outbox.push_back(encode_frame(message));
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
        tcp::Watchdog watchdog(io.get_executor(), Clock::now() + kWriteTimeout,
                               [connection] { close_socket(*connection); });
        co_await asio::async_write(connection->socket, asio::buffer(frame),
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
    std::array<std::uint8_t, 4> head{};
    co_await asio::async_read(connection.socket, asio::buffer(head), asio::use_awaitable);
    const std::uint32_t length = decode_length(head.data());
    check_length(length);
    std::string body(length, '\0');
    co_await asio::async_read(connection.socket, asio::buffer(body), asio::use_awaitable);
    co_return parse_message(body);
  }

  // Removes a connection from the bookkeeping (once); during shutdown, the last one ends the
  // grace period early.
  void forget(const ConnectionPtr& connection) {
    connections.erase(connection);
    if (shutting_down && connections.empty()) shutdown_timer.cancel();
  }

  void refuse(const ConnectionPtr& connection, std::string_view reason) {
    refused.fetch_add(1);
    logger().warn("membership coordinator: refused a connection from {}: {}", connection->from,
                  reason);
  }

  asio::awaitable<void> accept_loop() {
    for (;;) {
      auto connection = std::make_shared<Connection>(io);
      boost::system::error_code error;
      co_await acceptor.async_accept(connection->socket,
                                     asio::redirect_error(asio::use_awaitable, error));
      if (shutting_down || error == asio::error::operation_aborted) co_return;
      if (error) {  // out of file descriptors, say: pause instead of spinning
        logger().warn("membership coordinator: accept failed: {}", error.message());
        asio::steady_timer pause(io);
        pause.expires_after(std::chrono::milliseconds(100));
        co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, error));
        continue;
      }
      connection->from = tcp::remote_description(connection->socket);
      tcp::apply_socket_options(connection->socket, TransportOptions{});
      connections.insert(connection);
      asio::co_spawn(io, serve(std::move(connection)), asio::detached);
    }
  }

  asio::awaitable<void> serve(ConnectionPtr connection) {
    if (!co_await admit(connection)) {
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

  // Handshake and registration; false when the connection was refused.
  asio::awaitable<bool> admit(const ConnectionPtr& connection) {
    std::string refusal;
    try {
      tcp::Watchdog watchdog(io.get_executor(), Clock::now() + kRegistrationTimeout, [connection] {
        connection->registration_timed_out = true;
        close_socket(*connection);
      });
      const auto result = co_await tcp::server_handshake(
          connection->socket, options.secret, [](const tcp::Hello& hello) -> std::string {
            if (hello.purpose != tcp::Purpose::membership)
              return "this is a membership coordinator, not a rendezvous server or a data "
                     "listener";
            return {};
          });
      if (!result.accepted) {
        refuse(connection, result.refusal);
        co_return false;
      }
      const Json message = co_await read_message(*connection);
      refusal = register_worker(connection, message);
      if (refusal.empty()) co_return true;
    } catch (const std::exception& error) {
      if (shutting_down) co_return false;
      if (connection->registration_timed_out) {
        refusal = fmt::format("did not authenticate and register within {} s",
                              std::chrono::seconds(kRegistrationTimeout).count());
      } else if (const auto* io_error = dynamic_cast<const boost::system::system_error*>(&error)) {
        refusal = fmt::format("connection failed during the handshake: {}",
                              io_error->code() == asio::error::eof ? std::string("closed")
                                                                   : io_error->code().message());
      } else {
        refusal = error.what();
      }
      refuse(connection, refusal);
      co_return false;
    }
    refuse(connection, refusal);
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
      const auto remote = connection->socket.remote_endpoint(error);
      if (error) return "cannot tell the address of the connection for its wildcard data host";
      data_host = remote.address().to_string();
    }
    connection->worker_id = worker_id;
    connection->data_address = PeerAddress{data_host, static_cast<std::uint16_t>(data_port)};
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
    boost::system::error_code ignored;
    acceptor.close(ignored);
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
  if (options.secret.empty())
    logger().warn(
        "membership coordinator: no shared secret (PULSELOCO_SECRET): connections are not "
        "authenticated");
  impl_ = std::make_unique<Impl>(std::move(options));
  auto& impl = *impl_;
  const std::string& host = impl.options.host;
  try {
    const auto endpoint = tcp::Endpoint(
        asio::ip::make_address(host.empty() ? std::string("0.0.0.0") : host), impl.options.port);
    impl.acceptor.open(endpoint.protocol());
    impl.acceptor.set_option(asio::socket_base::reuse_address(true));
    impl.acceptor.bind(endpoint);
    impl.acceptor.listen(asio::socket_base::max_listen_connections);
    impl.listening_port = impl.acceptor.local_endpoint().port();
  } catch (const boost::system::system_error& error) {
    throw IoError(fmt::format("membership coordinator: cannot listen on {}:{}: {}", host,
                              impl.options.port, error.code().message()));
  }
  logger().info(
      "membership coordinator: listening on {}:{} (initial {}, minimum {}, maximum {}, joins "
      "every {} windows, regroup timeout {} ms)",
      host, impl.listening_port, impl.options.initial_workers, impl.options.min_workers,
      impl.options.max_workers == 0 ? std::string("unlimited")
                                    : std::to_string(impl.options.max_workers),
      impl.options.join_every_windows, impl.options.regroup_timeout.count());
  asio::co_spawn(impl.io, impl.accept_loop(), asio::detached);
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
  return impl_->listening_port;
}

std::uint64_t Coordinator::generation() const {
  return impl_->current_generation.load();
}

void Coordinator::wait() {
  std::unique_lock lock(impl_->mutex);
  impl_->changed.wait(lock, [&] { return impl_->done; });
  if (impl_->failure) std::rethrow_exception(impl_->failure);
}

int Coordinator::refused_connections() const noexcept {
  return impl_->refused.load();
}

int Coordinator::waiting_workers() const noexcept {
  return impl_->waiting.load();
}

// ------------------------------------------------------------------------------------------------
// The client

struct MembershipClient::Impl {
  enum class Request : std::uint8_t { none, next_group, boundary };

  explicit Impl(MembershipClientOptions client_options)
      : options(std::move(client_options)), socket(io) {}

  const MembershipClientOptions options;
  PeerAddress coordinator;
  asio::io_context io;
  Socket socket;
  std::string inbox;                    // received bytes not yet taken as messages
  std::mutex mutex;                     // one call at a time
  Request outstanding = Request::none;  // sent, reply not yet received (after a timeout)
  std::uint64_t outstanding_window = 0;
  std::exception_ptr broken;  // why the connection is unusable, once it is
  bool left = false;
  std::uint64_t generation = 0;

  [[noreturn]] void fail(std::exception_ptr error) {
    broken = error;
    boost::system::error_code ignored;
    socket.close(ignored);
    std::rethrow_exception(error);
  }

  [[noreturn]] void lost(const boost::system::error_code& error) {
    fail(std::make_exception_ptr(PeerLostError(fmt::format(
        "coordinator lost: the connection to the membership coordinator at {} {}",
        to_string(coordinator),
        error == asio::error::eof ? std::string("was closed") : "failed: " + error.message()))));
  }

  void check_usable() {
    if (broken) std::rethrow_exception(broken);
    if (left)
      throw MembershipError(
          fmt::format("worker {} has left the run (leave() was called)", options.worker_id));
  }

  // Runs the io_context until `done`; at `deadline` calls `cancel` and lets the cancelled
  // operation finish. Returns false when the deadline came first.
  template <typename Cancel>
  bool run_until(const bool& done, Deadline deadline, Cancel cancel) {
    io.restart();
    while (!done && Clock::now() < deadline)
      io.run_one_until(deadline);
    if (done) return true;
    cancel();
    io.restart();
    while (!done)
      io.run_one();
    return false;
  }

  void write_message(const Json& message, Deadline deadline) {
    const std::string frame = encode_frame(message);
    bool done = false;
    boost::system::error_code error;
    asio::async_write(socket, asio::buffer(frame),
                      [&](const boost::system::error_code& result, std::size_t) {
                        error = result;
                        done = true;
                      });
    // A message cut short would desynchronise the stream: at the deadline the connection goes.
    if (!run_until(done, deadline, [&] {
          boost::system::error_code ignored;
          socket.close(ignored);
        }))
      fail(std::make_exception_ptr(TimeoutError(
          fmt::format("membership: could not send to the coordinator at {} before the deadline",
                      to_string(coordinator)))));
    if (error) lost(error);
  }

  // The next complete message in `inbox`, if any.
  std::optional<Json> take_message() {
    if (inbox.size() < 4) return std::nullopt;
    const std::uint32_t length = decode_length(reinterpret_cast<const std::uint8_t*>(inbox.data()));
    try {
      check_length(length);
    } catch (const ProtocolError& error) {
      fail(std::make_exception_ptr(ProtocolError(fmt::format(
          "membership coordinator at {} sent {}", to_string(coordinator), error.message()))));
    }
    if (inbox.size() < 4 + std::size_t{length}) return std::nullopt;
    Json message;
    try {
      message = parse_message(std::string_view(inbox).substr(4, length));
    } catch (const ProtocolError& error) {
      fail(std::make_exception_ptr(ProtocolError(fmt::format(
          "membership coordinator at {} sent {}", to_string(coordinator), error.message()))));
    }
    inbox.erase(0, 4 + std::size_t{length});
    return message;
  }

  // The next message, or nullopt when the deadline passed first (the connection stays usable:
  // bytes received so far are kept).
  std::optional<Json> read_message(Deadline deadline) {
    for (;;) {
      if (auto message = take_message()) return message;
      std::array<char, 4096> chunk{};
      bool done = false;
      boost::system::error_code error;
      std::size_t received = 0;
      socket.async_read_some(asio::buffer(chunk),
                             [&](const boost::system::error_code& result, std::size_t n) {
                               error = result;
                               received = n;
                               done = true;
                             });
      const bool in_time = run_until(done, deadline, [&] {
        boost::system::error_code ignored;
        socket.cancel(ignored);
      });
      inbox.append(chunk.data(), received);
      if (!in_time && (error == asio::error::operation_aborted || !error)) {
        if (auto message = take_message()) return message;
        return std::nullopt;
      }
      if (error) lost(error);
    }
  }

  // The reply to the outstanding request; TimeoutError (leaving it outstanding) at the deadline.
  // Reads and drops the reply to a boundary question that timed out earlier (its answer is no
  // longer wanted), so that the next reply read is the next request's.
  void discard_stale_boundary_reply(Deadline deadline, long long budget_ms) {
    if (!read_message(deadline))
      throw TimeoutError(
          fmt::format("membership: the coordinator at {} did not answer an earlier "
                      "boundary question within {} ms",
                      to_string(coordinator), budget_ms));
    outstanding = Request::none;
  }

  Json await_reply(Deadline deadline, std::string_view what, long long budget_ms) {
    auto reply = read_message(deadline);
    if (!reply)
      throw TimeoutError(
          fmt::format("membership: the coordinator at {} did not answer {} within "
                      "{} ms",
                      to_string(coordinator), what, budget_ms));
    outstanding = Request::none;
    const std::string type = (*reply)["type"].get<std::string>();
    if (type == "error") {
      const auto message = reply->find("message");
      throw MembershipError(message != reply->end() && message->is_string()
                                ? message->get<std::string>()
                                : std::string("the coordinator refused the request"));
    }
    return *std::move(reply);
  }

  [[noreturn]] void unexpected(const Json& reply, std::string_view expected) {
    fail(std::make_exception_ptr(ProtocolError(
        fmt::format("membership coordinator at {} sent a '{}' message where a '{}' "
                    "reply was due",
                    to_string(coordinator), reply["type"].get<std::string>(), expected))));
  }

  // Connects, authenticates and registers, retrying connection failures until the deadline.
  void connect_and_register() {
    const Deadline deadline = deadline_after(options.connect_timeout);
    const auto timeout_ms = options.connect_timeout.count();
    auto backoff = std::chrono::milliseconds(20);
    std::string last_problem = "no attempt";
    for (;;) {
      if (Clock::now() >= deadline)
        throw TimeoutError(fmt::format(
            "membership: could not register with the coordinator at {} within {} ms (last "
            "problem: {})",
            to_string(coordinator), timeout_ms, last_problem));
      boost::system::error_code error;
      socket.close(error);
      inbox.clear();
      try {
        const auto endpoint = tcp::resolve_endpoint(io, coordinator.host, coordinator.port);
        bool done = false;
        socket.async_connect(endpoint, [&](const boost::system::error_code& result) {
          error = result;
          done = true;
        });
        if (!run_until(done, deadline, [&] {
              boost::system::error_code ignored;
              socket.close(ignored);
            }))
          error = asio::error::timed_out;
      } catch (const IoError& resolve_error) {
        error = asio::error::host_not_found;
        last_problem = resolve_error.what();
      }
      if (!error) {
        tcp::apply_socket_options(socket, TransportOptions{});
        error = handshake(deadline);
        if (!error) break;
      }
      if (error != asio::error::host_not_found) last_problem = error.message();
      std::this_thread::sleep_until(std::min(deadline, Clock::now() + backoff));  // retry pace
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }

    write_message(Json{{"type", "register"},
                       {"worker_id", options.worker_id},
                       {"data_host", options.data_address.host},
                       {"data_port", options.data_address.port}},
                  deadline);
    const auto reply = read_message(deadline);
    if (!reply)
      fail(std::make_exception_ptr(TimeoutError(
          fmt::format("membership: the coordinator at {} did not answer the registration of "
                      "worker {} within {} ms",
                      to_string(coordinator), options.worker_id, timeout_ms))));
    const std::string type = (*reply)["type"].get<std::string>();
    if (type == "refused") {
      const auto reason = reply->find("reason");
      fail(std::make_exception_ptr(ProtocolError(fmt::format(
          "membership coordinator at {} refused worker {}: {}", to_string(coordinator),
          options.worker_id,
          reason != reply->end() && reason->is_string() ? reason->get<std::string>()
                                                        : std::string("no reason given")))));
    }
    if (type != "registered") unexpected(*reply, "registered");
    logger().debug("membership: worker {} registered with the coordinator at {}", options.worker_id,
                   to_string(coordinator));
  }

  // The handshake; an I/O error code to retry on, or throws ProtocolError when refused.
  boost::system::error_code handshake(Deadline deadline) {
    auto run = [this, deadline]() -> asio::awaitable<void> {
      tcp::Watchdog watchdog(io.get_executor(), deadline, [this] {
        boost::system::error_code ignored;
        socket.close(ignored);
      });
      tcp::Hello hello;
      hello.purpose = tcp::Purpose::membership;
      (void)co_await tcp::client_handshake(socket, hello, options.secret);
    };
    auto outcome = asio::co_spawn(io, run(), asio::use_future);
    io.restart();
    io.run();
    try {
      outcome.get();
    } catch (const tcp::HandshakeRefused& refused) {
      fail(std::make_exception_ptr(ProtocolError(fmt::format(
          "membership coordinator at {}: {}", to_string(coordinator), refused.message()))));
    } catch (const boost::system::system_error& error) {
      return error.code() ? error.code() : asio::error::connection_aborted;
    }
    return {};
  }

  GroupAssignment parse_group(const Json& reply) {
    try {
      GroupAssignment group;
      group.generation = reply.at("generation").get<std::uint64_t>();
      group.rank = reply.at("rank").get<int>();
      for (const auto& worker : reply.at("workers")) {
        group.worker_ids.push_back(worker.at("id").get<std::string>());
        group.peers.push_back(PeerAddress{worker.at("host").get<std::string>(),
                                          worker.at("port").get<std::uint16_t>()});
      }
      group.group_key = reply.at("group_key").get<std::string>();
      group.joined = reply.at("joined").get<std::vector<std::string>>();
      group.lost = reply.at("lost").get<std::vector<std::string>>();
      if (group.generation <= generation || group.rank < 0 || group.rank >= group.size() ||
          group.worker_ids[static_cast<std::size_t>(group.rank)] != options.worker_id ||
          group.group_key.empty())
        throw ProtocolError("inconsistent group");
      return group;
    } catch (const std::exception& error) {
      fail(std::make_exception_ptr(ProtocolError(
          fmt::format("membership coordinator at {} sent an invalid group for worker {}: {}",
                      to_string(coordinator), options.worker_id, error.what()))));
    }
  }
};

MembershipClient::MembershipClient(MembershipClientOptions options) {
  if (auto problem = check_name(options.worker_id, "worker id"); !problem.empty())
    throw InvalidArgument(fmt::format("membership client: {}", problem));
  if (options.data_address.port == 0)
    throw InvalidArgument(
        fmt::format("membership client: worker {} has no data port", options.worker_id));
  if (options.data_address.host.size() > kMaxNameBytes)
    throw InvalidArgument(
        fmt::format("membership client: data host longer than {} bytes", kMaxNameBytes));
  if (options.connect_timeout.count() <= 0)
    throw InvalidArgument("membership client: connect_timeout must be positive");
  const PeerAddress coordinator = parse_peer_address(options.coordinator, "membership coordinator");
  impl_ = std::make_unique<Impl>(std::move(options));
  impl_->coordinator = coordinator;
  impl_->connect_and_register();
}

MembershipClient::~MembershipClient() {
  boost::system::error_code ignored;
  impl_->socket.close(ignored);
}

GroupAssignment MembershipClient::next_group(std::string_view reason, Deadline deadline) {
  auto& impl = *impl_;
  const std::lock_guard lock(impl.mutex);
  impl.check_usable();
  const long long budget_ms = to_ms(deadline - Clock::now());
  if (impl.outstanding == Impl::Request::boundary) {
    // A boundary question that timed out earlier: its answer is no longer wanted.
    impl.discard_stale_boundary_reply(deadline, budget_ms);
  }
  if (impl.outstanding == Impl::Request::none) {
    impl.write_message(Json{{"type", "next_group"}, {"reason", std::string(reason)}}, deadline);
    impl.outstanding = Impl::Request::next_group;
  }
  const Json reply = impl.await_reply(deadline, "with a new group", budget_ms);
  if (reply["type"] != "group") impl.unexpected(reply, "group");
  GroupAssignment group = impl.parse_group(reply);
  impl.generation = group.generation;
  logger().debug("membership: worker {} is rank {} of {} in generation {}", impl.options.worker_id,
                 group.rank, group.size(), group.generation);
  return group;
}

bool MembershipClient::boundary(std::uint64_t window, Deadline deadline) {
  auto& impl = *impl_;
  const std::lock_guard lock(impl.mutex);
  impl.check_usable();
  if (impl.generation == 0)
    throw InvalidArgument(fmt::format(
        "membership: worker {} asked about a window boundary before it was placed in a group "
        "(call next_group first)",
        impl.options.worker_id));
  if (impl.outstanding == Impl::Request::next_group)
    throw InvalidArgument(fmt::format(
        "membership: worker {} asked about a window boundary while its next_group request is "
        "still unanswered (call next_group again)",
        impl.options.worker_id));
  const long long budget_ms = to_ms(deadline - Clock::now());
  if (impl.outstanding == Impl::Request::boundary && impl.outstanding_window != window) {
    impl.discard_stale_boundary_reply(deadline, budget_ms);
  }
  if (impl.outstanding == Impl::Request::none) {
    impl.write_message(Json{{"type", "boundary"}, {"window", window}}, deadline);
    impl.outstanding = Impl::Request::boundary;
    impl.outstanding_window = window;
  }
  const Json reply = impl.await_reply(
      deadline, fmt::format("the boundary question for window {}", window), budget_ms);
  const auto regroup = reply.find("regroup");
  if (reply["type"] != "boundary" || regroup == reply.end() || !regroup->is_boolean())
    impl.unexpected(reply, "boundary");
  return regroup->get<bool>();
}

void MembershipClient::leave() noexcept {
  auto& impl = *impl_;
  const std::lock_guard lock(impl.mutex);
  if (impl.left) return;
  impl.left = true;
  if (impl.broken) return;
  try {
    const Deadline deadline = deadline_after(kLeaveTimeout);
    impl.write_message(Json{{"type", "leave"}}, deadline);
    // Replies to requests that timed out earlier may come first; the acknowledgement is last.
    while (auto reply = impl.read_message(deadline))
      if ((*reply)["type"] == "bye") break;
  } catch (const std::exception& error) {
    logger().debug("membership: worker {} left without an acknowledgement: {}",
                   impl.options.worker_id, error.what());
  }
  boost::system::error_code ignored;
  impl.socket.close(ignored);
}

}  // namespace pulseloco::transport
