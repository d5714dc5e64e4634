// The elastic-membership coordinator (coordinator.h): the I/O around its membership policy.
// membership_policy.h holds every membership decision (who is admitted, when a generation
// forms, ranks, removals, the end of the run); this file accepts and authenticates connections,
// reads the workers' messages, turns them into the policy's events, sends the replies its
// decisions name, logs its notes and runs the regroup timer at the deadline it asks for.
// membership_messages.h has the messages.
#include <pulseloco/elastic/coordinator.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <openssl/rand.h>

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
#include <pulseloco/elastic/membership_policy.h>
#include <pulseloco/group/progress_lines.h>
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

std::string random_group_key(std::uint64_t generation) {
  std::array<std::uint8_t, 16> bytes{};
  if (RAND_bytes(bytes.data(), static_cast<int>(bytes.size())) != 1)
    throw IoError("OpenSSL RAND_bytes failed to produce a group key");
  std::string key;
  for (const auto byte : bytes)
    key += fmt::format("{:02x}", byte);
  return fmt::format("{}-g{}", key, generation);
}

MembershipRules rules_of(const CoordinatorOptions& options) {
  return MembershipRules{.initial_workers = options.initial_workers,
                         .min_workers = options.min_workers,
                         .max_workers = options.max_workers,
                         .join_every_windows = options.join_every_windows,
                         .regroup_timeout = options.regroup_timeout};
}

void log_note(const Note& note) {
  constexpr std::string_view kFormat = "membership coordinator: {}";
  switch (note.level) {
    case Note::Level::info:
      logger().info(kFormat, note.text);
      break;
    case Note::Level::warn:
      logger().warn(kFormat, note.text);
      break;
    case Note::Level::error:
      logger().error(kFormat, note.text);
      break;
  }
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// The coordinator

struct Coordinator::Impl {
  struct Connection {
    Connection(std::shared_ptr<tcp::Socket> accepted, std::shared_ptr<tcp::TlsContext> tls)
        : socket(accepted), link(std::move(accepted), std::move(tls)) {}
    const std::shared_ptr<tcp::Socket> socket;
    tcp::LinkStream link;             // over `socket`
    std::string from;                 // remote address, for the log
    std::optional<WorkerKey> worker;  // once registered
    std::string worker_id;
    bool closed = false;  // on_closed ran: no longer part of anything
    std::deque<std::string> outbox;
    bool writing = false;
    bool close_after_flush = false;

    [[nodiscard]] std::string name() const {
      return worker ? fmt::format("worker {}", worker_id) : fmt::format("connection {}", from);
    }
  };
  using ConnectionPtr = std::shared_ptr<Connection>;

  Impl(CoordinatorOptions coordinator_options, MembershipPolicy membership)
      : options(std::move(coordinator_options)),
        job(transport::derive_job_id(options.secret, options.run_id)),
        tls(tcp::TlsContext::make(options.link_security, options.secret, options.tls_files)),
        regroup_timer(io),
        shutdown_timer(io),
        policy(std::move(membership)) {}

  const CoordinatorOptions options;
  const transport::JobId job;
  const std::shared_ptr<tcp::TlsContext> tls;  // null: plain links
  asio::io_context io;
  std::optional<tcp::Listener> listener;
  asio::steady_timer regroup_timer;
  asio::steady_timer shutdown_timer;
  std::optional<group::ProgressLines> regroup_progress;  // while a regroup is pending
  std::thread thread;

  // --- State of the io thread --------------------------------------------------------------
  std::set<ConnectionPtr> connections;            // every open connection
  std::map<WorkerKey, ConnectionPtr> registered;  // the open connections of registered workers
  MembershipPolicy policy;
  std::optional<transport::Clock::time_point> armed;  // the deadline regroup_timer waits for
  bool shutting_down = false;

  // --- Shared with other threads -------------------------------------------------------------
  std::atomic<std::uint64_t> current_generation{0};
  std::atomic<int> refused{0};
  std::atomic<int> waiting{0};
  tcp::ServerOutcome outcome;

  // ---------------------------------------------------------------------------------------------
  // Connections and messages

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

  // Sends to a registered worker; one whose connection closed meanwhile gets nothing.
  void send_to(WorkerKey worker, const Json& message) {
    if (const auto found = registered.find(worker); found != registered.end())
      send(found->second, message);
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
    std::vector<StatedAddress> local_ranks;
    if (const auto lanes = message.find("local_ranks"); lanes != message.end()) {
      if (!lanes->is_array() || lanes->size() > kMaxLocalRanks)
        return fmt::format(
            "malformed registration (local_ranks must be a list of at most {} "
            "addresses)",
            kMaxLocalRanks);
      for (const auto& lane : *lanes) {
        const auto lane_host = lane.find("host");
        const auto lane_port = lane.find("port");
        if (!lane.is_object() || lane_host == lane.end() || !lane_host->is_string() ||
            lane_port == lane.end() || !lane_port->is_number_unsigned())
          return "malformed registration (each of local_ranks needs a host and a port)";
        local_ranks.push_back({lane_host->get<std::string>(), lane_port->get<std::uint64_t>()});
      }
    }
    boost::system::error_code error;
    const auto remote = connection->socket->remote_endpoint(error);
    const auto registration = policy.register_worker(
        RegistrationRequest{.worker_id = id->get<std::string>(),
                            .data_host = host->get<std::string>(),
                            .data_port = port->get<std::uint64_t>(),
                            .local_ranks = std::move(local_ranks),
                            .remote_address = error ? std::string() : remote.address().to_string(),
                            .from = connection->from});
    if (!registration.key) return registration.refusal;
    connection->worker = *registration.key;
    connection->worker_id = id->get<std::string>();
    registered.emplace(*registration.key, connection);
    log_note(registration.note);
    send(connection, Json{{"type", "registered"}, {"generation", policy.generation()}});
    return {};
  }

  // A request of a registered worker; ProtocolError (the connection is closed) for a malformed
  // or unexpected one.
  void dispatch(const ConnectionPtr& connection, const Json& message) {
    const WorkerKey worker = *connection->worker;
    const std::string type = message["type"].get<std::string>();
    const auto now = transport::Clock::now();
    if (type == "leave") {
      auto decisions = policy.leave(worker);
      send(connection, Json{{"type", "bye"}});
      connection->close_after_flush = true;
      apply(std::move(decisions));
    } else if (type == "next_group") {
      apply(policy.next_group(worker, string_field(message, "reason"), now));
    } else if (type == "boundary") {
      apply(policy.boundary(worker, unsigned_field(message, "window"), now));
    } else {
      throw ProtocolError(fmt::format("unknown message type '{}'", type));
    }
  }

  void on_closed(const ConnectionPtr& connection, const std::string& problem) {
    if (connection->closed) return;
    connection->closed = true;
    close_socket(*connection);
    forget(connection);
    if (shutting_down || !connection->worker) return;
    registered.erase(*connection->worker);
    apply(policy.connection_closed(*connection->worker, problem));
  }

  // ---------------------------------------------------------------------------------------------
  // Carrying out the policy's decisions

  void apply(Decisions decisions) {
    for (const auto& note : decisions.notes)
      log_note(note);
    current_generation.store(policy.generation());
    waiting.store(static_cast<int>(policy.waiting()));
    if (decisions.formed) tell_members(*decisions.formed);
    for (const auto& reply : decisions.boundary_replies)
      send_to(reply.to, Json{{"type", "boundary"}, {"regroup", reply.regroup}});
    for (const auto& error : decisions.errors)
      send_to(error.to, Json{{"type", "error"}, {"message", error.message}});
    if (decisions.ended) {
      const auto& reason = decisions.ended->stop_reason;
      outcome.complete(reason ? std::make_exception_ptr(MembershipError(*reason)) : nullptr);
    }
    arm_regroup_timer();
    watch_regroup();
  }

  // While a regroup is pending: progress lines naming the members it waits for.
  void watch_regroup() {
    if (!policy.deadline() || shutting_down) {
      regroup_progress.reset();
      return;
    }
    if (regroup_progress) return;
    regroup_progress.emplace(io, [this](double seconds) {
      const std::vector<std::string> awaited = policy.awaited_members();
      if (awaited.empty()) return;
      logger().warn(
          "membership coordinator: the regroup of generation {} has waited {:.1f} s so far for "
          "{} {} to ask for the next group (it goes on without them at its deadline)",
          policy.generation(), seconds, awaited.size() == 1 ? "worker" : "workers",
          fmt::join(awaited, ", "));
    });
  }

  // Gives the generation a fresh group key and tells each member its place.
  void tell_members(const Generation& formed) {
    const std::string group_key = random_group_key(formed.number);
    Json workers = Json::array();
    for (std::size_t rank = 0; rank < formed.members.size(); ++rank) {
      Json worker{{"id", formed.worker_ids[rank]},
                  {"host", formed.data_addresses[rank].host},
                  {"port", formed.data_addresses[rank].port}};
      if (!formed.local_rank_addresses[rank].empty()) {
        Json lanes = Json::array();
        for (const auto& address : formed.local_rank_addresses[rank])
          lanes.push_back(Json{{"host", address.host}, {"port", address.port}});
        worker["local_ranks"] = std::move(lanes);
      }
      workers.push_back(std::move(worker));
    }
    for (std::size_t rank = 0; rank < formed.members.size(); ++rank)
      send_to(formed.members[rank], Json{{"type", "group"},
                                         {"generation", formed.number},
                                         {"rank", rank},
                                         {"workers", workers},
                                         {"group_key", group_key},
                                         {"joined", formed.joined},
                                         {"lost", formed.lost}});
  }

  // Makes the timer wait for the policy's deadline (a pending regroup), or for nothing.
  void arm_regroup_timer() {
    const auto deadline = policy.deadline();
    if (deadline == armed || shutting_down) return;
    armed = deadline;
    if (!deadline) {
      regroup_timer.cancel();
      return;
    }
    regroup_timer.expires_at(*deadline);
    regroup_timer.async_wait([this](const boost::system::error_code& error) {
      if (error || shutting_down) return;
      armed.reset();  // this wait is over: apply() arms another while a deadline is pending
      guarded([this] { apply(policy.tick(transport::Clock::now())); });
    });
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
    regroup_progress.reset();
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
  MembershipPolicy policy(rules_of(options));  // validates the membership options first
  tcp::require_authentication_beyond_loopback(
      "membership coordinator", options.host,
      transport::effective_link_security(options.link_security, options.secret, options.tls_files),
      options.allow_insecure);
  impl_ = std::make_unique<Impl>(std::move(options), std::move(policy));
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
  if (impl.options.run_id.empty() && !tcp::is_loopback_host(host)) {
    logger().warn(
        "membership coordinator: listening beyond loopback with no run id (PULSELOCO_RUN_ID): a "
        "worker of another job with the same secret that reaches {}:{} is admitted into this "
        "run, and the two jobs then train together. Give every job its own PULSELOCO_RUN_ID, "
        "the same on the coordinator and its workers",
        host.empty() ? "*" : host, impl.listener->port());
  }
  impl.listener->start(
      [&impl](tcp::PendingConnection connection) { return impl.serve(std::move(connection)); });
  impl.thread = std::thread([&impl] {
    for (;;) {
      try {
        impl.io.run();
        return;
      } catch (const std::exception& error) {  // a bug: keep serving the other workers
        logger().error("membership coordinator: internal error: {}", error.what());
      }
    }
  });
  set_thread_name(impl.thread.native_handle(), "pl-membership");
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
