// Forming a group: every option of group formation and of every backend, and how each is read
// from the environment. docs/operations.md ("Transports") documents each option and variable.
//
//   auto options = group::from_environment();   // PULSELOCO_*, MASTER_ADDR, RANK, ...
//   options.tcp.connections_per_peer = 8;        // code may override anything
//   std::unique_ptr<transport::Transport> t = group::make_transport(options);   // make_transport.h
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/transport/backend_registry.h>
#include <pulseloco/transport/mpi/mpi_options.h>
#include <pulseloco/transport/nccl/nccl_options.h>
#include <pulseloco/transport/tcp/tcp_options.h>

namespace pulseloco::group {

// How the ranks of a TCP group (or the NCCL bootstrap) find each other.
enum class RendezvousMethod : std::uint8_t {
  automatic,    // mpi when launched by mpirun and the MPI backend is linked; else environment
                // when a master address is known; else peer_list when peers are given; else a
                // group of one (world size 1)
  mpi,          // MPI_Allgather of every rank's listening address (MPI_COMM_WORLD)
  environment,  // torchrun style: rank 0 (or an external server) at master_addr:master_port
  peer_list,    // explicit "host:port" per rank; rank r listens on peers[r]
};

// How the ranks of an NCCL group agree on the NCCL id.
enum class NcclBootstrap : std::uint8_t {
  automatic,  // mpi when launched by mpirun and the MPI backend is linked, else tcp
  mpi,        // MPI_Bcast of the unique id
  tcp,        // the TCP rendezvous: rank 0 sends the unique id over a bootstrap TCP transport
};

struct TransportOptions {
  transport::Backend backend = transport::Backend::tcp;

  // --- Group membership (the TCP rendezvous; the NCCL bootstrap over TCP) ----------------------
  RendezvousMethod rendezvous = RendezvousMethod::automatic;
  int rank = -1;            // -1: from the rendezvous (MPI) or an error where it must be given
  int world_size = -1;      // -1: from the rendezvous, or from the length of `peers`
  std::string master_addr;  // environment rendezvous: where rank 0's server listens
  std::uint16_t master_port = 0;  // environment rendezvous
  // True: rank 0 does not host the rendezvous server; one runs elsewhere (a launcher, a test)
  // as group::RendezvousServer (rendezvous_server.h).
  bool external_rendezvous_server = false;
  std::vector<std::string> peers;  // peer_list rendezvous: "host:port" for every rank
  // peer_list rendezvous: mixed into the group id, so that two groups with the same peer list
  // (successive generations of an elastic run) never accept each other.
  std::string group_key;
  // Names this job (with the secret: transport/tcp/job_id.h), so that two jobs sharing
  // addresses and a secret never accept each other's connections. Empty: the environment and
  // MPI rendezvous generate a job id; a peer list then derives it from the secret alone.
  std::string run_id;
  std::string advertise_addr;  // address peers connect to; "" = found automatically
  std::string socket_ifname;   // advertise this interface's IPv4 address (e.g. "eth0")
  // Forming the group: rendezvous, connecting (retried until then) and authenticating; for
  // NCCL, the bootstrap and creating the communicator.
  std::chrono::milliseconds connect_timeout{60'000};
  NcclBootstrap nccl_bootstrap = NcclBootstrap::automatic;

  // --- Each backend's own options ----------------------------------------------------------------
  transport::TcpOptions tcp;  // the data plane (also the rendezvous' secret and sockets)
  transport::MpiOptions mpi;
  transport::NcclOptions nccl;
};

// Fills options from the environment, starting from `defaults` (a variable that is set
// overrides the default; an empty variable counts as unset). Throws InvalidArgument naming the
// variable when a value does not parse. The variables:
//   PULSELOCO_TRANSPORT            tcp | mpi | nccl
//   PULSELOCO_RENDEZVOUS           auto | mpi | env | peers
//   PULSELOCO_RANK, RANK           this rank
//   PULSELOCO_WORLD_SIZE, WORLD_SIZE
//   PULSELOCO_MASTER_ADDR, MASTER_ADDR; PULSELOCO_MASTER_PORT, MASTER_PORT
//   PULSELOCO_RENDEZVOUS_EXTERNAL  1: the rendezvous server runs outside rank 0
//   PULSELOCO_PEERS                host:port,host:port,...
//   PULSELOCO_GROUP_KEY            (peer_list) distinguishes groups with equal peer lists
//   PULSELOCO_RUN_ID               names the job (distinct per job sharing a secret)
//   PULSELOCO_ADVERTISE_ADDR, PULSELOCO_SOCKET_IFNAME
//   PULSELOCO_CONNECT_TIMEOUT_MS
//   PULSELOCO_LISTEN_ADDR, PULSELOCO_LISTEN_PORT                          (tcp)
//   PULSELOCO_TCP_CONNECTIONS, PULSELOCO_TCP_STRIPE_THRESHOLD, PULSELOCO_TCP_STRIPE_CHUNK
//   PULSELOCO_TCP_NODELAY, PULSELOCO_TCP_SNDBUF, PULSELOCO_TCP_RCVBUF
//   PULSELOCO_TCP_KEEPALIVE, PULSELOCO_TCP_KEEPALIVE_IDLE, PULSELOCO_TCP_KEEPALIVE_INTERVAL,
//   PULSELOCO_TCP_KEEPALIVE_COUNT, PULSELOCO_IO_TIMEOUT_MS
//   PULSELOCO_TCP_MAX_UNEXPECTED, PULSELOCO_TCP_CHECKSUMS, PULSELOCO_TCP_IO_THREADS,
//   PULSELOCO_TCP_BUSY_POLL_US
//   PULSELOCO_SECRET, PULSELOCO_SECRET_FILE (the secret is the file's first line)
//   PULSELOCO_ALLOW_INSECURE       1: listen beyond loopback without a secret
//   PULSELOCO_LINK_SECURITY        tls | hmac (default: tls with a secret or certificates)
//   PULSELOCO_TLS_CERT, PULSELOCO_TLS_KEY, PULSELOCO_TLS_CA (PEM files, all three or none)
//   PULSELOCO_MPI_PART_BYTES                                               (mpi)
//   PULSELOCO_CUDA_DEVICE, PULSELOCO_LOCAL_RANK, LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK (nccl)
//   PULSELOCO_NCCL_BOOTSTRAP       auto | mpi | tcp
// Sizes take an optional binary suffix: 64K, 4M, 1G (also KiB, MiB, GiB). Booleans: 1/0,
// true/false, yes/no, on/off.
[[nodiscard]] TransportOptions from_environment(TransportOptions defaults = {});

// Checks every field; throws InvalidArgument naming the field and the value.
void validate(const TransportOptions& options);

[[nodiscard]] std::string_view rendezvous_name(RendezvousMethod method) noexcept;

}  // namespace pulseloco::group
