#include <pulseloco/elastic/membership_client.h>

#include <fmt/format.h>

#include <array>
#include <mutex>
#include <optional>
#include <thread>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/elastic/membership_messages.h>
#include <pulseloco/group/progress_lines.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/tcp/tls_context.h>
#include <pulseloco/transport/waiting.h>

namespace pulseloco::elastic {
namespace {

namespace asio = boost::asio;
namespace tcp = transport::tcp;
using tcp::Socket;
using transport::Clock;
using transport::Deadline;
using transport::deadline_after;
using transport::PeerAddress;
using transport::to_ms;

// How long leave() waits for the coordinator's acknowledgement.
constexpr auto kLeaveTimeout = std::chrono::seconds(5);

}  // namespace

// ------------------------------------------------------------------------------------------------
// The client

struct MembershipClient::Impl {
  enum class Request : std::uint8_t { none, next_group, boundary };

  explicit Impl(MembershipClientOptions client_options)
      : options(std::move(client_options)),
        tls(tcp::TlsContext::make(options.link_security, options.secret, options.tls_files)),
        owned_socket(std::make_shared<Socket>(io)),
        socket(*owned_socket),
        link(owned_socket, nullptr) {}

  const MembershipClientOptions options;
  const std::shared_ptr<tcp::TlsContext> tls;  // null: plain links
  PeerAddress coordinator;
  asio::io_context io;
  const std::shared_ptr<Socket> owned_socket;
  Socket& socket;
  tcp::LinkStream link;                 // over `socket`, new for each connection
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
    const std::string frame = encode_message(message);
    bool done = false;
    boost::system::error_code error;
    asio::async_write(link, asio::buffer(frame),
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
    if (inbox.size() < kLengthBytes) return std::nullopt;
    std::uint32_t length = 0;
    try {
      length = decode_length(std::as_bytes(std::span(inbox).first<kLengthBytes>()));
    } catch (const ProtocolError& error) {
      fail(std::make_exception_ptr(ProtocolError(fmt::format(
          "membership coordinator at {} sent {}", to_string(coordinator), error.message()))));
    }
    if (inbox.size() < kLengthBytes + std::size_t{length}) return std::nullopt;
    Json message;
    try {
      message = parse_message(std::string_view(inbox).substr(kLengthBytes, length));
    } catch (const ProtocolError& error) {
      fail(std::make_exception_ptr(ProtocolError(fmt::format(
          "membership coordinator at {} sent {}", to_string(coordinator), error.message()))));
    }
    inbox.erase(0, kLengthBytes + std::size_t{length});
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
      link.async_read_some(asio::buffer(chunk),
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
        tcp::apply_socket_options(socket, transport::TcpOptions{});
        link = tcp::LinkStream(owned_socket, tls);
        error = handshake(deadline);
        if (!error) break;
      }
      if (error != asio::error::host_not_found) last_problem = error.message();
      std::this_thread::sleep_until(std::min(deadline, Clock::now() + backoff));  // retry pace
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }

    Json registration{{"type", "register"},
                      {"worker_id", options.worker_id},
                      {"data_host", options.data_address.host},
                      {"data_port", options.data_address.port}};
    if (!options.local_rank_addresses.empty()) {
      Json lanes = Json::array();
      for (const auto& address : options.local_rank_addresses)
        lanes.push_back(Json{{"host", address.host}, {"port", address.port}});
      registration["local_ranks"] = std::move(lanes);
    }
    write_message(registration, deadline);
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
      hello.group_id =
          transport::job_only_group_id(transport::derive_job_id(options.secret, options.run_id));
      (void)co_await tcp::client_handshake(link, hello, options.secret);
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
        auto& lanes = group.local_rank_peers.emplace_back();
        if (const auto listed = worker.find("local_ranks"); listed != worker.end()) {
          for (const auto& lane : *listed)
            lanes.push_back(PeerAddress{lane.at("host").get<std::string>(),
                                        lane.at("port").get<std::uint16_t>()});
        }
        if (lanes.size() != options.local_rank_addresses.size())
          throw ProtocolError(fmt::format("worker {} has {} local ranks, this one {}",
                                          group.worker_ids.back(), lanes.size() + 1,
                                          options.local_rank_addresses.size() + 1));
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

std::vector<PeerAddress> GroupAssignment::peers_of_local_rank(int local_rank) const {
  if (local_rank == 0) return peers;
  std::vector<PeerAddress> lane;
  for (std::size_t member = 0; member < local_rank_peers.size(); ++member) {
    const auto& listed = local_rank_peers[member];
    if (local_rank < 0 || static_cast<std::size_t>(local_rank) > listed.size())
      throw InvalidArgument(fmt::format("group generation {}: worker {} has no local rank {}",
                                        generation, worker_ids[member], local_rank));
    lane.push_back(listed[static_cast<std::size_t>(local_rank) - 1]);
  }
  return lane;
}

MembershipClient::MembershipClient(MembershipClientOptions options) {
  if (auto problem = check_name(options.worker_id, "worker id"); !problem.empty())
    throw InvalidArgument(fmt::format("membership client: {}", problem));
  if (options.data_address.port == 0)
    throw InvalidArgument(
        fmt::format("membership client: worker {} has no data port", options.worker_id));
  if (options.data_address.host.size() > kMaxNameBytes)
    throw InvalidArgument(
        fmt::format("membership client: data host longer than {} bytes", kMaxNameBytes));
  if (options.local_rank_addresses.size() > kMaxLocalRanks)
    throw InvalidArgument(
        fmt::format("membership client: more than {} local ranks", kMaxLocalRanks + 1));
  if (options.connect_timeout.count() <= 0)
    throw InvalidArgument("membership client: connect_timeout must be positive");
  const PeerAddress coordinator =
      transport::parse_peer_address(options.coordinator, "membership coordinator");
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
  Json reply;
  {
    const group::ProgressLines progress(impl.io, [&impl](double seconds) {
      logger().warn(
          "membership: worker {} has waited {:.1f} s so far for the coordinator at {} to form the "
          "next group (the coordinator logs which workers it waits for)",
          impl.options.worker_id, seconds, to_string(impl.coordinator));
    });
    reply = impl.await_reply(deadline, "with a new group", budget_ms);
  }
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

}  // namespace pulseloco::elastic
