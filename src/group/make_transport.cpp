#include <pulseloco/group/make_transport.h>

#include <fmt/format.h>

#include <mutex>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/build_config.h>
#include <pulseloco/group/linked_backends.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/group/test_hooks.h>
#include <pulseloco/transport/bootstrap.h>
#include <pulseloco/transport/tcp/exposure.h>

namespace pulseloco::group {

using transport::Backend;
using transport::GroupTable;
using transport::TcpTransport;
using transport::Transport;

const transport::MpiBackend& require_mpi_backend(std::string_view purpose) {
  if (const auto* mpi = transport::linked_mpi_backend()) return *mpi;
  if (PULSELOCO_HAS_MPI)
    throw InvalidArgument(fmt::format(
        "{}: backend mpi is not linked into this program: link pulseloco::transport_mpi", purpose));
  throw InvalidArgument(fmt::format(
      "{}: backend mpi is not built into this pulseloco (configure with -DPULSELOCO_WITH_MPI=ON)",
      purpose));
}

const transport::NcclBackend& require_nccl_backend(std::string_view purpose) {
  if (const auto* nccl = transport::linked_nccl_backend()) return *nccl;
  if (PULSELOCO_HAS_NCCL)
    throw InvalidArgument(fmt::format(
        "{}: backend nccl is not linked into this program: link pulseloco::transport_nccl",
        purpose));
  throw InvalidArgument(
      fmt::format("{}: backend nccl is not built into this pulseloco (configure with "
                  "-DPULSELOCO_WITH_NCCL=ON)",
                  purpose));
}

namespace {

// Where the data listener listens when the options do not say: on loopback when the group
// evidently lives on this host (its own peer-list entry or the master address is loopback, or the
// MPI launcher put every rank on this node), so that a single-host run is not reachable from
// elsewhere; else on every interface.
std::string default_listen_addr(const TransportOptions& options, RendezvousMethod method) {
  const auto own_peer_host = [&]() -> std::string {
    if (options.rank < 0 || options.rank >= static_cast<int>(options.peers.size())) return {};
    return transport::parse_peer_address(options.peers[static_cast<std::size_t>(options.rank)],
                                         "PULSELOCO_PEERS")
        .host;
  };
  std::string host;
  if (method == RendezvousMethod::peer_list) {
    host = own_peer_host();
  } else if (method == RendezvousMethod::environment && options.advertise_addr.empty() &&
             options.socket_ifname.empty()) {
    host = options.master_addr;
  } else if (method == RendezvousMethod::mpi && options.advertise_addr.empty() &&
             options.socket_ifname.empty() && mpi_launcher_reports_one_host()) {
    host = "127.0.0.1";  // the MPI rendezvous advertises 127.0.0.1 when all ranks share a host
  }
  if (!transport::tcp::is_loopback_host(host)) return {};
  return host == "localhost" ? "127.0.0.1" : host;
}

// Without a run id every job with this secret presents the same job id to a rendezvous server
// and, with a peer list, to the data listeners: a process of another such job that reaches this
// group's master address or peer list is taken for one of its ranks. The MPI rendezvous is
// immune (MPI's world is the job). Warns rather than refuses, so that groups formed this way
// keep working.
void warn_when_another_job_could_join(const TransportOptions& options, RendezvousMethod method) {
  if (!options.run_id.empty()) return;
  std::string_view name;
  std::string shared;
  bool beyond_loopback = !transport::tcp::is_loopback_host(options.tcp.listen_addr);
  if (method == RendezvousMethod::environment) {
    name = "environment";
    shared = fmt::format("the master address {}:{}", options.master_addr, options.master_port);
    beyond_loopback = beyond_loopback || !transport::tcp::is_loopback_host(options.master_addr);
  } else if (method == RendezvousMethod::peer_list) {
    name = "peer_list";
    shared = "the peer list";
  } else {
    return;
  }
  if (!beyond_loopback) return;
  logger().warn(
      "{} rendezvous: this group is reachable beyond loopback and has no run id "
      "(PULSELOCO_RUN_ID): a process of another job with the same secret and {} can take one "
      "of its ranks, and the two jobs then train together. Give every job its own "
      "PULSELOCO_RUN_ID (python -m pulseloco.launch sets a fresh one)",
      name, shared);
}

// No launcher variables and no world size: the group is this process alone. Said once per
// process, since a program meant for several ranks would otherwise train on its own in silence.
void warn_alone_by_default() {
  static std::once_flag warned;
  std::call_once(warned, [] {
    logger().warn(
        "{}",
        "no launcher variables (RANK, WORLD_SIZE, MASTER_ADDR, PULSELOCO_PEERS or mpirun's) and "
        "no world size: this process trains as a group of one. To run several ranks, start it "
        "with `python -m pulseloco.launch --nproc-per-node N` (or torchrun, or mpirun); to run "
        "alone without this warning, set the world size to 1 (group={\"world_size\": 1} in "
        "Python, TransportOptions::world_size in C++)");
  });
}

// The TCP group of `options` (validated), found by its rendezvous.
std::unique_ptr<TcpTransport> form_tcp_group(const TransportOptions& given) {
  const RendezvousMethod method = resolve_rendezvous(given);
  TransportOptions options = given;
  if (options.tcp.listen_addr.empty())
    options.tcp.listen_addr = default_listen_addr(options, method);
  warn_when_another_job_could_join(options, method);
  std::unique_ptr<TcpTransport> made;
  switch (method) {
    case RendezvousMethod::peer_list:
      made = std::make_unique<TcpTransport>(options.tcp, peer_list_rendezvous(options),
                                            options.connect_timeout);
      break;
    case RendezvousMethod::environment:
      made = std::make_unique<TcpTransport>(
          options.tcp,
          [&options](std::uint16_t port) { return environment_rendezvous(options, port); },
          options.connect_timeout);
      break;
    case RendezvousMethod::mpi:
      made = std::make_unique<TcpTransport>(
          options.tcp, [&options](std::uint16_t port) { return mpi_rendezvous(options, port); },
          options.connect_timeout);
      break;
    case RendezvousMethod::automatic: {  // a group of one
      if (options.rank > 0)
        throw InvalidArgument(fmt::format("rank {} in a group of one", options.rank));
      if (options.world_size == -1) warn_alone_by_default();
      GroupTable table;
      table.rank = 0;
      table.peers.push_back(transport::PeerAddress{"127.0.0.1", 0});
      made = std::make_unique<TcpTransport>(options.tcp, std::move(table), options.connect_timeout);
      break;
    }
  }
  if (const auto hook = corrupt_frame_from_environment()) made->corrupt_outgoing_frame(*hook);
  return made;
}

std::unique_ptr<Transport> make_mpi_transport(const TransportOptions& options) {
  const transport::MpiBackend& mpi = require_mpi_backend("transport 'mpi'");
  auto made = mpi.make_transport(options.mpi);
  if (options.rank != -1 && options.rank != made->rank())
    throw InvalidArgument(
        fmt::format("mpi transport: the configured rank {} differs from the MPI rank {}",
                    options.rank, made->rank()));
  if (options.world_size != -1 && options.world_size != made->size())
    throw InvalidArgument(
        fmt::format("mpi transport: the configured world size {} differs from MPI's {}",
                    options.world_size, made->size()));
  return made;
}

std::unique_ptr<Transport> make_nccl_transport(const TransportOptions& options) {
  const transport::NcclBackend& nccl = require_nccl_backend("transport 'nccl'");
  NcclBootstrap method = options.nccl_bootstrap;
  if (method == NcclBootstrap::automatic)
    method = launched_by_mpi() && transport::backend_available(Backend::mpi) ? NcclBootstrap::mpi
                                                                             : NcclBootstrap::tcp;
  const transport::FormBootstrap form_bootstrap =
      [&options, method]() -> std::unique_ptr<transport::Bootstrap> {
    if (method == NcclBootstrap::mpi) {
      auto world = require_mpi_backend("nccl transport: the bootstrap over MPI").world();
      if ((options.rank != -1 && options.rank != world->rank()) ||
          (options.world_size != -1 && options.world_size != world->size()))
        throw InvalidArgument(
            fmt::format("nccl transport: configured rank {} of {} differs from MPI's rank {} of {}",
                        options.rank, options.world_size, world->rank(), world->size()));
      return world;
    }
    // A TCP group of one connection per peer, closed once the id is delivered.
    TransportOptions bootstrap = options;
    bootstrap.tcp.connections_per_peer = 1;
    return std::make_unique<transport::TransportBootstrap>(form_tcp_group(bootstrap));
  };
  return nccl.make_transport(options.nccl, form_bootstrap, options.connect_timeout);
}

}  // namespace

std::unique_ptr<Transport> make_transport(const TransportOptions& options) {
  validate(options);
  std::unique_ptr<Transport> made;
  switch (options.backend) {
    case Backend::tcp:
      made = form_tcp_group(options);
      break;
    case Backend::mpi:
      made = make_mpi_transport(options);
      break;
    case Backend::nccl:
      made = make_nccl_transport(options);
      break;
  }
  if (!made)
    throw InvalidArgument(
        fmt::format("unknown transport backend {}", static_cast<int>(options.backend)));
  tag_log_with_group_rank(made->rank());
  return made;
}

std::unique_ptr<TcpTransport> make_tcp_transport(const TransportOptions& options) {
  validate(options);
  auto made = form_tcp_group(options);
  tag_log_with_group_rank(made->rank());
  return made;
}

}  // namespace pulseloco::group
