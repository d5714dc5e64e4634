#include <pulseloco/elastic/elastic_engine.h>

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/log_lines.h>
#include <pulseloco/base/unique_fd.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/transport/tcp/exposure.h>

namespace pulseloco {
namespace {

// Failures a new group can cure: a member died, stalled, was cut off or sent garbage. Invalid
// arguments, divergence, non-finite values and membership decisions are not retried.
[[nodiscard]] bool recoverable(const Error& error) noexcept {
  switch (error.kind()) {
    case ErrorKind::peer_lost:
    case ErrorKind::aborted:
    case ErrorKind::timeout:
    case ErrorKind::protocol:
    case ErrorKind::io:
      return true;
    default:
      return false;
  }
}

std::string default_worker_id() {
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) != 0) host[0] = '\0';
  return fmt::format("{}-{}", host[0] != '\0' ? host.data() : "worker", ::getpid());
}

// This worker's data listening socket on `address` ("" = every interface) and `port` (0 = any
// free port), held for the whole run: every generation's transport accepts on it, so no other
// process can take the port between two generations.
UniqueFd listen_for_data(const std::string& address, std::uint16_t port) {
  UniqueFd socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (socket.get() < 0) throw IoError("cannot create the data listening socket");
  const int one = 1;
  (void)::setsockopt(socket.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in bound{};
  bound.sin_family = AF_INET;
  bound.sin_port = htons(port);
  if (address.empty()) {
    bound.sin_addr.s_addr = htonl(INADDR_ANY);
  } else if (::inet_pton(AF_INET, address.c_str(), &bound.sin_addr) != 1) {
    throw InvalidArgument(
        fmt::format("listen address '{}' is not an IPv4 address (elastic runs)", address));
  }
  if (::bind(socket.get(), reinterpret_cast<const sockaddr*>(&bound), sizeof(bound)) != 0 ||
      ::listen(socket.get(), SOMAXCONN) != 0) {
    throw IoError(fmt::format("cannot listen for the data plane on {}:{}: {}",
                              address.empty() ? "*" : address, port, std::strerror(errno)));
  }
  return socket;
}

std::uint16_t port_of(const UniqueFd& socket) {
  sockaddr_in bound{};
  socklen_t length = sizeof(bound);
  if (::getsockname(socket.get(), reinterpret_cast<sockaddr*>(&bound), &length) != 0) {
    throw IoError("getsockname failed on the data listening socket");
  }
  return ntohs(bound.sin_port);
}

// The local IPv4 address this host uses to reach `host` (the address other workers, which
// reach the same coordinator, most likely reach this one at). No packet is sent.
std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), "9", &hints, &found) != 0 || found == nullptr) {
    throw InvalidArgument(fmt::format("cannot resolve the coordinator host '{}'", host));
  }
  const std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> owner(found, &::freeaddrinfo);
  const UniqueFd socket(::socket(AF_INET, SOCK_DGRAM, 0));
  if (socket.get() < 0 || ::connect(socket.get(), found->ai_addr, found->ai_addrlen) != 0) {
    throw IoError(fmt::format("no route to the coordinator host '{}'", host));
  }
  sockaddr_in local{};
  socklen_t length = sizeof(local);
  if (::getsockname(socket.get(), reinterpret_cast<sockaddr*>(&local), &length) != 0) {
    throw IoError("getsockname failed while finding this host's address");
  }
  std::array<char, INET_ADDRSTRLEN> text{};
  ::inet_ntop(AF_INET, &local.sin_addr, text.data(), text.size());
  return text.data();
}

}  // namespace

ElasticOptions elastic_options_from_environment(ElasticOptions defaults) {
  ElasticOptions options = std::move(defaults);
  if (const char* value = std::getenv("PULSELOCO_COORDINATOR"); value && *value) {
    options.coordinator = value;
  }
  if (const char* value = std::getenv("PULSELOCO_WORKER_ID"); value && *value) {
    options.worker_id = value;
  }
  options.transport = group::from_environment(options.transport);
  return options;
}

ElasticEngine::ElasticEngine(std::vector<NamedTensor> parameters, EngineOptions options,
                             ElasticOptions elastic)
    : elastic_(std::move(elastic)) {
  if (elastic_.coordinator.empty()) {
    throw InvalidArgument("an elastic run needs the coordinator's address (PULSELOCO_COORDINATOR)");
  }
  if (elastic_.transport.backend != transport::Backend::tcp) {
    throw InvalidArgument(
        "elastic membership needs the tcp transport (an MPI job ends when a rank dies; NCCL "
        "communicators are fixed): see docs/elastic.md");
  }
  if (elastic_.max_attempts_per_window < 1) {
    throw InvalidArgument("max_attempts_per_window must be at least 1");
  }
  worker_id_ = elastic_.worker_id.empty() ? default_worker_id() : elastic_.worker_id;
  const transport::PeerAddress coordinator =
      transport::parse_peer_address(elastic_.coordinator, "PULSELOCO_COORDINATOR");

  // The address the other workers reach this one's data listener at.
  transport::PeerAddress data;
  if (!elastic_.transport.advertise_addr.empty()) {
    data.host = elastic_.transport.advertise_addr;
  } else if (!elastic_.transport.socket_ifname.empty()) {
    data.host = group::interface_address(elastic_.transport.socket_ifname);
  } else if (!elastic_.transport.tcp.listen_addr.empty() &&
             elastic_.transport.tcp.listen_addr != "0.0.0.0") {
    data.host = elastic_.transport.tcp.listen_addr;
  } else {
    data.host = local_address_towards(coordinator.host);
  }
  // Where it listens, in every generation: the configured address, else loopback when that is
  // where the others reach it (as a peer list's own loopback entry does for any TCP group), so
  // that a single-host run is not reachable from elsewhere; else every interface.
  std::string listen_addr = elastic_.transport.tcp.listen_addr;
  if (listen_addr.empty() && transport::tcp::is_loopback_host(data.host))
    listen_addr = data.host == "localhost" ? "127.0.0.1" : data.host;
  data_socket_ =
      std::make_unique<UniqueFd>(listen_for_data(listen_addr, elastic_.transport.tcp.listen_port));
  data.port = port_of(*data_socket_);

  // Invalid parameters are refused before this worker registers anywhere.
  engine_ = std::make_unique<Engine>(std::move(parameters), std::move(options));
  membership_ = std::make_unique<elastic::MembershipClient>(elastic::MembershipClientOptions{
      .coordinator = elastic_.coordinator,
      .worker_id = worker_id_,
      .data_address = data,
      .secret = elastic_.transport.tcp.secret,
      .run_id = elastic_.transport.run_id,
      .link_security = elastic_.transport.tcp.link_security,
      .tls_files = elastic_.transport.tcp.tls_files,
      .connect_timeout = elastic_.transport.connect_timeout,
  });
  logger().info("worker {} registered with the coordinator at {} (data plane {})", worker_id_,
                elastic_.coordinator, transport::to_string(data));
  if (elastic_.on_registered) elastic_.on_registered();
  regroup("join");
}

std::uint16_t ElasticEngine::data_port() const {
  return port_of(*data_socket_);
}

ElasticEngine::~ElasticEngine() {
  leave();
}

void ElasticEngine::leave() noexcept {
  if (left_) return;
  left_ = true;
  if (membership_) membership_->leave();
  if (engine_) engine_->detach();
}

void ElasticEngine::regroup(std::string reason) {
  if (left_) throw MembershipError("this worker has left the run");
  for (int attempt = 1;; ++attempt) {
    engine_->detach();  // the data socket stays listening for the next generation
    group_ = membership_->next_group(reason, transport::deadline_after(elastic_.admission_timeout));
    group::TransportOptions options = elastic_.transport;
    options.backend = transport::Backend::tcp;
    options.rendezvous = group::RendezvousMethod::peer_list;
    options.peers.clear();
    for (const auto& peer : group_.peers)
      options.peers.push_back(transport::to_string(peer));
    options.rank = group_.rank;
    options.world_size = group_.size();
    options.group_key = group_.group_key;
    options.tcp.listen_socket = data_socket_->get();  // the port of this worker's entry
    try {
      engine_->attach(group::make_transport(options),
                      GroupInfo{.generation = group_.generation, .members = group_.worker_ids});
      ++groups_joined_;
      logger().log(shared_line_level(group_.rank),
                   "worker {}: rank {} of {} in group generation {} (joined: [{}], lost: [{}])",
                   worker_id_, group_.rank, group_.size(), group_.generation,
                   fmt::join(group_.joined, ", "), fmt::join(group_.lost, ", "));
      return;
    } catch (const Error& error) {
      if (!recoverable(error) || attempt >= elastic_.max_attempts_per_window) throw;
      logger().warn("worker {}: group generation {} failed to form ({}); asking for another",
                    worker_id_, group_.generation, error.what());
      reason = error.what();
    }
  }
}

WindowReport ElasticEngine::run_window() {
  WindowReport report = run_window_with_retries();
  // The boundary after a committed window: the coordinator may ask every member to re-form the
  // group now, to admit waiting workers (its join policy).
  if (membership_->boundary(engine_->committed_windows(),
                            transport::deadline_after(elastic_.transport.connect_timeout))) {
    regroup("admitting new workers");
  }
  return report;
}

WindowReport ElasticEngine::run_window_with_retries() {
  // The window's number, and the windows committed before it (the two part once a window was
  // dropped).
  const std::uint64_t attempted = engine_->next_window();
  const std::uint64_t committed_before = engine_->committed_windows();
  for (int attempt = 1;; ++attempt) {
    try {
      return engine_->run_window();
    } catch (const Error& error) {
      if (!recoverable(error) || attempt >= elastic_.max_attempts_per_window) throw;
      std::optional<WindowReport> committed = engine_->take_committed_report();
      logger().warn("worker {}: window {} failed in group generation {} ({}); re-forming the group",
                    worker_id_, attempted, group_.generation, error.what());
      regroup(error.what());
      if (engine_->committed_windows() > committed_before) {
        // The window had committed (here, or on the others while this worker was deciding);
        // attach() has just checked that every member holds the same state.
        if (!committed) {
          committed.emplace();
          committed->window = attempted;
          committed->mode = engine_->options().mode;
          committed->parameters = engine_->parameter_count();
          committed->steps_per_window = engine_->options().steps_per_window;
        }
        committed->rank = engine_->rank();
        committed->world_size = engine_->world_size();
        committed->generation = group_.generation;
        committed->members = group_.worker_ids;
        committed->digest = engine_->state_digest();
        committed->rank_digests.assign(static_cast<std::size_t>(engine_->world_size()),
                                       committed->digest);
        committed->replicas_identical = true;
        return *committed;
      }
    }
  }
}

std::optional<WindowReport> ElasticEngine::complete_in_flight() {
  try {
    return engine_->complete_in_flight();
  } catch (const Error& error) {
    if (!recoverable(error)) throw;
    logger().warn(
        "worker {}: the window in flight failed in group generation {} ({}); "
        "re-forming the group, which drops it",
        worker_id_, group_.generation, error.what());
    regroup(error.what());
    return std::nullopt;
  }
}

std::optional<WindowReport> ElasticEngine::after_optimizer_step() {
  if (!engine_->next_step_runs_window()) return engine_->after_optimizer_step();
  return run_window();
}

}  // namespace pulseloco
