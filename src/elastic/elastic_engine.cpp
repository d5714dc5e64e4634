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
#include <pulseloco/elastic/membership_messages.h>
#include <pulseloco/elastic/worker_link.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/transport/subgroup.h>
#include <pulseloco/transport/tcp/exposure.h>

namespace pulseloco {
namespace {

using elastic::Json;

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

// A generation as local rank 0 passes it on to the worker's other local ranks.
Json group_to_json(const elastic::GroupAssignment& group) {
  const auto addresses = [](const std::vector<transport::PeerAddress>& list) {
    Json out = Json::array();
    for (const auto& address : list)
      out.push_back(Json{{"host", address.host}, {"port", address.port}});
    return out;
  };
  Json lanes = Json::array();
  for (const auto& list : group.local_rank_peers)
    lanes.push_back(addresses(list));
  return Json{{"generation", group.generation}, {"rank", group.rank},
              {"ids", group.worker_ids},        {"peers", addresses(group.peers)},
              {"local_ranks", lanes},           {"group_key", group.group_key},
              {"joined", group.joined},         {"lost", group.lost}};
}

elastic::GroupAssignment group_from_json(const Json& json) {
  const auto addresses = [](const Json& list) {
    std::vector<transport::PeerAddress> out;
    for (const auto& address : list)
      out.push_back(
          {address.at("host").get<std::string>(), address.at("port").get<std::uint16_t>()});
    return out;
  };
  elastic::GroupAssignment group;
  group.generation = json.at("generation").get<std::uint64_t>();
  group.rank = json.at("rank").get<int>();
  group.worker_ids = json.at("ids").get<std::vector<std::string>>();
  group.peers = addresses(json.at("peers"));
  for (const auto& list : json.at("local_ranks"))
    group.local_rank_peers.push_back(addresses(list));
  group.group_key = json.at("group_key").get<std::string>();
  group.joined = json.at("joined").get<std::vector<std::string>>();
  group.lost = json.at("lost").get<std::vector<std::string>>();
  return group;
}

// An error as it crosses the worker's link: its kind and message.
Json error_to_json(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& failed) {
    return Json{{"kind", static_cast<int>(failed.kind())}, {"error", failed.message()}};
  }
  return {};  // not reached: only pulseloco errors cross the link
}

[[noreturn]] void throw_from_json(const Json& json, std::string_view where) {
  transport::throw_error_of_kind(static_cast<ErrorKind>(json.at("kind").get<int>()),
                                 fmt::format("{}: {}", where, json.at("error").get<std::string>()),
                                 {});
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
  const int ranks_per_worker = elastic_.ranks_per_worker;
  if (ranks_per_worker < 1 || elastic_.local_rank < 0 || elastic_.local_rank >= ranks_per_worker)
    throw InvalidArgument(fmt::format("a worker's local rank {} of {} ranks does not exist",
                                      elastic_.local_rank, ranks_per_worker));
  if (ranks_per_worker > 1 && elastic_.worker_link.empty())
    throw InvalidArgument(
        "a worker of several ranks needs the address of its link (ElasticOptions::worker_link)");
  if (ranks_per_worker > 1 && options.overlap != Overlap::blocking)
    throw InvalidArgument(
        fmt::format("a worker of several ranks runs blocking windows only (overlap is '{}')",
                    overlap_name(options.overlap)));
  if (elastic_.worker_link_timeout.count() <= 0)
    throw InvalidArgument("worker_link_timeout must be positive");
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

  // A worker of several ranks: its local ranks link up and learn each other's data addresses;
  // local rank 0's id names the worker.
  std::vector<transport::PeerAddress> local_rank_addresses;
  if (ranks_per_worker > 1) {
    link_ =
        std::make_unique<elastic::WorkerLink>(elastic_.transport, elastic_.worker_link,
                                              elastic_.local_rank, ranks_per_worker, worker_id_);
    const auto stated =
        link_->allgather(Json{{"id", worker_id_}, {"host", data.host}, {"port", data.port}}.dump(),
                         elastic_.worker_link_timeout);
    for (std::size_t j = 0; j < stated.size(); ++j) {
      const Json local_rank = Json::parse(stated[j]);
      if (j == 0)
        worker_id_ = local_rank.at("id").get<std::string>();
      else
        local_rank_addresses.push_back(
            {local_rank.at("host").get<std::string>(), local_rank.at("port").get<std::uint16_t>()});
    }
  }
  (void)ask_for_worker(
      [&] {
        membership_ = std::make_unique<elastic::MembershipClient>(elastic::MembershipClientOptions{
            .coordinator = elastic_.coordinator,
            .worker_id = worker_id_,
            .data_address = data,
            .local_rank_addresses = local_rank_addresses,
            .secret = elastic_.transport.tcp.secret,
            .run_id = elastic_.transport.run_id,
            .link_security = elastic_.transport.tcp.link_security,
            .tls_files = elastic_.transport.tcp.tls_files,
            .connect_timeout = elastic_.transport.connect_timeout,
        });
        return std::string();
      },
      elastic_.transport.connect_timeout);
  if (link_) {
    logger().info(
        "worker {}: local rank {} of {} registered with the coordinator at {} (data "
        "plane {})",
        worker_id_, elastic_.local_rank, ranks_per_worker, elastic_.coordinator,
        transport::to_string(data));
  } else {
    logger().info("worker {} registered with the coordinator at {} (data plane {})", worker_id_,
                  elastic_.coordinator, transport::to_string(data));
  }
  if (elastic_.on_registered) elastic_.on_registered();
  regroup("join");
}

std::string ElasticEngine::who() const {
  return link_ ? fmt::format("worker {} (local rank {})", worker_id_, elastic_.local_rank)
               : fmt::format("worker {}", worker_id_);
}

std::string ElasticEngine::ask_for_worker(const std::function<std::string()>& ask,
                                          std::chrono::milliseconds wait) {
  if (!link_) return ask();
  std::exception_ptr failed;
  Json answer;
  if (elastic_.local_rank == 0) {
    try {
      answer = Json{{"answer", ask()}};
    } catch (const Error&) {
      failed = std::current_exception();
      answer = error_to_json(failed);
    }
  }
  const Json passed =
      Json::parse(link_->from_local_rank_0(answer.dump(), wait + elastic_.worker_link_timeout));
  if (failed) std::rethrow_exception(failed);
  if (passed.contains("error"))
    throw_from_json(passed, fmt::format("worker {} (from its local rank 0)", worker_id_));
  return passed.at("answer").get<std::string>();
}

std::string ElasticEngine::agree_across_local_ranks(const std::string& retry,
                                                    const std::exception_ptr& fatal) {
  if (!link_) {
    if (fatal) std::rethrow_exception(fatal);
    return retry;
  }
  const Json mine = fatal ? error_to_json(fatal) : Json{{"retry", retry}};
  const auto outcomes = link_->allgather(mine.dump(), elastic_.worker_link_timeout);
  if (fatal) std::rethrow_exception(fatal);
  std::string first_retry;
  for (std::size_t j = 0; j < outcomes.size(); ++j) {
    const Json outcome = Json::parse(outcomes[j]);
    if (outcome.contains("error"))
      throw_from_json(outcome, fmt::format("worker {}'s local rank {} failed", worker_id_, j));
    if (first_retry.empty() && !outcome.at("retry").get<std::string>().empty())
      first_retry =
          j == static_cast<std::size_t>(elastic_.local_rank)
              ? outcome.at("retry").get<std::string>()
              : fmt::format("local rank {}: {}", j, outcome.at("retry").get<std::string>());
  }
  return first_retry;
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
  if (membership_) membership_->leave();  // local rank 0, for the whole worker
  if (engine_) engine_->detach();
  link_.reset();
}

void ElasticEngine::regroup(std::string reason) {
  if (left_) throw MembershipError("this worker has left the run");
  for (int attempt = 1;; ++attempt) {
    engine_->detach();  // the data socket stays listening for the next generation
    // Every local rank has left the old generation before local rank 0 asks for the next one. A
    // member's rank that receives the next generation connects at once, and the old group's
    // listener, still serving this worker's port on a local rank that has not detached yet,
    // would turn it away (another group of the job) and fail that generation.
    if (link_) (void)link_->allgather("detached", elastic_.worker_link_timeout);
    group_ = group_from_json(Json::parse(ask_for_worker(
        [&] {
          return group_to_json(membership_->next_group(
                                   reason, transport::deadline_after(elastic_.admission_timeout)))
              .dump();
        },
        elastic_.admission_timeout)));
    group::TransportOptions options = elastic_.transport;
    options.backend = transport::Backend::tcp;
    options.rendezvous = group::RendezvousMethod::peer_list;
    options.peers.clear();
    for (const auto& peer : group_.peers_of_local_rank(elastic_.local_rank))
      options.peers.push_back(transport::to_string(peer));
    options.rank = group_.rank;
    options.world_size = group_.size();
    options.group_key =
        link_ ? fmt::format("{}.local{}", group_.group_key, elastic_.local_rank) : group_.group_key;
    options.tcp.listen_socket = data_socket_->get();  // the port of this worker's entry
    std::string retry;
    std::exception_ptr fatal;
    try {
      engine_->attach(group::make_transport(options),
                      GroupInfo{.generation = group_.generation, .members = group_.worker_ids});
    } catch (const Error& error) {
      if (!recoverable(error) || attempt >= elastic_.max_attempts_per_window)
        fatal = std::current_exception();
      else
        retry = error.what();
    }
    retry = agree_across_local_ranks(retry, fatal);
    if (retry.empty()) {
      ++groups_joined_;
      logger().log(shared_line_level(group_.rank),
                   "{}: rank {} of {} in group generation {} (joined: [{}], lost: [{}])", who(),
                   group_.rank, group_.size(), group_.generation, fmt::join(group_.joined, ", "),
                   fmt::join(group_.lost, ", "));
      return;
    }
    logger().warn("{}: group generation {} failed to form ({}); asking for another", who(),
                  group_.generation, retry);
    reason = retry;
  }
}

WindowReport ElasticEngine::run_window() {
  WindowReport report = run_window_with_retries();
  // The boundary after a committed window: the coordinator may ask every member to re-form the
  // group now, to admit waiting workers (its join policy).
  const std::string regroup_now = ask_for_worker(
      [&] {
        return std::string(
            membership_->boundary(engine_->committed_windows(),
                                  transport::deadline_after(elastic_.transport.connect_timeout))
                ? "regroup"
                : "");
      },
      elastic_.transport.connect_timeout);
  if (!regroup_now.empty()) regroup("admitting new workers");
  return report;
}

WindowReport ElasticEngine::run_window_with_retries() {
  // The window's number, and the windows committed before it (the two part once a window was
  // dropped).
  const std::uint64_t attempted = engine_->next_window();
  const std::uint64_t committed_before = engine_->committed_windows();
  // A worker of several ranks retries until every local rank's window committed: a local rank
  // whose window committed waits for the others (they regroup together; it runs no window
  // again), as each share's window commits or not in its own group.
  std::optional<WindowReport> report;
  for (int attempt = 1;; ++attempt) {
    std::string retry;
    std::exception_ptr fatal;
    if (!report) {
      try {
        report = engine_->run_window();
      } catch (const Error& error) {
        if (!recoverable(error) || attempt >= elastic_.max_attempts_per_window)
          fatal = std::current_exception();
        else
          retry = error.what();
      }
    }
    std::optional<WindowReport> committed;
    if (!retry.empty()) {
      committed = engine_->take_committed_report();
      logger().warn("{}: window {} failed in group generation {} ({}); re-forming the group", who(),
                    attempted, group_.generation, retry);
    }
    const std::string worker_retry = agree_across_local_ranks(retry, fatal);
    if (worker_retry.empty()) return *report;
    regroup(worker_retry);
    if (report || engine_->committed_windows() == committed_before) continue;
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
    report = std::move(committed);
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
