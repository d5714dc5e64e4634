// Creating a transport: every option of every backend, how each is read from the environment,
// and the one factory. docs/operations.md ("Transports") documents each option and variable.
//
//   auto options = transport::from_environment();   // PULSELOCO_*, MASTER_ADDR, RANK, ...
//   options.connections_per_peer = 8;                // code may override anything
//   std::unique_ptr<transport::Transport> t = transport::make_transport(options);
//
// make_transport() blocks until the whole group is connected (and, for TCP, every connection
// authenticated) or options.connect_timeout passes.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

enum class Backend : std::uint8_t {
  tcp,   // Boost.Asio sockets, full mesh, any network
  mpi,   // OpenMPI point-to-point (plus native collectives, see native_collectives.h)
  nccl,  // NCCL send/receive between CUDA devices
};

// How the ranks of a TCP group (or the NCCL bootstrap) find each other.
enum class RendezvousMethod : std::uint8_t {
  automatic,    // mpi when launched by mpirun and MPI is built in; else environment when a
                // master address is known; else peer_list when peers are given; else a group of
                // one (world size 1)
  mpi,          // MPI_Allgather of every rank's listening address (MPI_COMM_WORLD)
  environment,  // torchrun style: rank 0 (or an external server) at master_addr:master_port
  peer_list,    // explicit "host:port" per rank; rank r listens on peers[r]
};

// Which data-plane bytes the corruption test hook flips.
enum class FrameCorruption : std::uint8_t { payload, header };

// The test hook that proves corruption is detected: flip one bit in one outgoing frame.
struct CorruptFrame {
  std::uint64_t frame_index = 0;  // 0-based index among this transport's outgoing data frames
  FrameCorruption target = FrameCorruption::payload;
};

enum class NcclBootstrap : std::uint8_t {
  automatic,  // mpi when launched by mpirun and MPI is built in, else tcp
  mpi,        // MPI_Bcast of the unique id
  tcp,        // the TCP rendezvous: rank 0 sends the unique id over a bootstrap TCP transport
};

struct TransportOptions {
  Backend backend = Backend::tcp;

  // --- Group membership (tcp rendezvous; the NCCL bootstrap over tcp) -------------------------
  RendezvousMethod rendezvous = RendezvousMethod::automatic;
  int rank = -1;            // -1: from the rendezvous (MPI) or an error where it must be given
  int world_size = -1;      // -1: from the rendezvous, or from the length of `peers`
  std::string master_addr;  // environment rendezvous: where rank 0's server listens
  std::uint16_t master_port = 0;  // environment rendezvous
  // True: rank 0 does not host the rendezvous server; one runs elsewhere (a launcher, a test)
  // as transport::RendezvousServer (rendezvous.h).
  bool external_rendezvous_server = false;
  std::vector<std::string> peers;  // peer_list rendezvous: "host:port" for every rank
  // peer_list rendezvous: mixed into the group id, so that two groups with the same peer list
  // (successive generations of an elastic run, membership.h) never accept each other.
  std::string group_key;
  std::string listen_addr;        // data listener address; "" = all interfaces
  std::uint16_t listen_port = 0;  // data listener port; 0 = any free port (not for peer_list)
  std::string advertise_addr;     // address peers connect to; "" = found automatically
  std::string socket_ifname;      // advertise this interface's IPv4 address (e.g. "eth0")

  // --- TCP data plane ---------------------------------------------------------------------------
  int connections_per_peer = 2;                               // parallel TCP connections per peer
  // Larger messages are striped: a 1 MiB message then travels as two 512 KiB frames on two
  // connections, which on loopback took a 4-rank 1 MiB all-gather from 1.32x to 1.09x OpenMPI's
  // time (docs/benchmarks.md, "Frame size").
  std::size_t stripe_threshold_bytes = std::size_t{512} << 10;
  std::size_t stripe_chunk_bytes = std::size_t{4} << 20;      // largest frame of a striped message
  bool tcp_nodelay = true;
  int socket_send_buffer_bytes = 0;     // SO_SNDBUF; 0 = kernel autotuning
  int socket_receive_buffer_bytes = 0;  // SO_RCVBUF; 0 = kernel autotuning
  bool keepalive = true;                // SO_KEEPALIVE with the three settings below
  int keepalive_idle_s = 60;            // TCP_KEEPIDLE
  int keepalive_interval_s = 10;        // TCP_KEEPINTVL
  int keepalive_count = 6;              // TCP_KEEPCNT
  // Forming the group: rendezvous, connecting (retried until then) and authenticating.
  std::chrono::milliseconds connect_timeout{60'000};
  // A connection that makes no progress this long while it has bytes to send, or is in the
  // middle of a frame, is declared dead (TimeoutError naming the peer); 0 = never. Request
  // deadlines apply independently.
  std::chrono::milliseconds io_timeout{0};
  // Messages that arrive before their irecv is posted are buffered up to this many bytes in
  // all; beyond it the transport stops reading from that connection until a matching irecv is
  // posted (TCP flow control then holds the sender).
  std::size_t max_unexpected_bytes = std::size_t{1} << 30;
  bool payload_checksums = true;  // xxh3-64 of every frame's payload (headers always)
  // Threads that run this transport's Asio io_context while no caller waits: a caller waiting
  // on a request runs it itself, and the I/O threads step aside meanwhile (tcp/progress.h).
  int io_threads = 1;
  // How long a thread that has run out of work polls for more (yielding the core in between)
  // before it sleeps in the reactor: a caller in wait(), and an I/O thread after its last
  // handler. The next frame of a collective round usually follows within microseconds; polling
  // saves the sleep and wake-up, as MPI and NCCL do by polling all the time. A waiting caller
  // keeps polling while handlers keep running. 0: sleep in the reactor at once. Measured in
  // docs/benchmarks.md.
  std::chrono::microseconds busy_poll{100};
  // Shared secret for the HMAC-SHA256 challenge-response at connect. Empty: connections are
  // still checked (with an empty key) but not authenticated; a warning is logged.
  std::string secret;
  std::optional<CorruptFrame> corrupt_frame;  // test hook; never set in production

  // --- MPI ------------------------------------------------------------------------------------
  // Messages above this size travel as several MPI messages (MPI counts are ints).
  std::size_t mpi_part_bytes = std::size_t{1} << 30;

  // --- NCCL -------------------------------------------------------------------------------------
  int cuda_device = -1;  // -1: the local rank modulo the number of visible devices
  int local_rank = -1;   // -1: from LOCAL_RANK / OMPI_COMM_WORLD_LOCAL_RANK, else 0
  NcclBootstrap nccl_bootstrap = NcclBootstrap::automatic;
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
//   PULSELOCO_LISTEN_ADDR, PULSELOCO_LISTEN_PORT, PULSELOCO_ADVERTISE_ADDR,
//   PULSELOCO_SOCKET_IFNAME
//   PULSELOCO_TCP_CONNECTIONS, PULSELOCO_TCP_STRIPE_THRESHOLD, PULSELOCO_TCP_STRIPE_CHUNK
//   PULSELOCO_TCP_NODELAY, PULSELOCO_TCP_SNDBUF, PULSELOCO_TCP_RCVBUF
//   PULSELOCO_TCP_KEEPALIVE, PULSELOCO_TCP_KEEPALIVE_IDLE, PULSELOCO_TCP_KEEPALIVE_INTERVAL,
//   PULSELOCO_TCP_KEEPALIVE_COUNT
//   PULSELOCO_CONNECT_TIMEOUT_MS, PULSELOCO_IO_TIMEOUT_MS
//   PULSELOCO_TCP_MAX_UNEXPECTED, PULSELOCO_TCP_CHECKSUMS, PULSELOCO_TCP_IO_THREADS
//   PULSELOCO_SECRET, PULSELOCO_SECRET_FILE (the secret is the file's first line)
//   PULSELOCO_TEST_CORRUPT_FRAME   N or N:header (test hook)
//   PULSELOCO_MPI_PART_BYTES
//   PULSELOCO_CUDA_DEVICE, PULSELOCO_LOCAL_RANK, LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK
//   PULSELOCO_NCCL_BOOTSTRAP       auto | mpi | tcp
// Sizes take an optional binary suffix: 64K, 4M, 1G (also KiB, MiB, GiB). Booleans: 1/0,
// true/false, yes/no, on/off.
[[nodiscard]] TransportOptions from_environment(TransportOptions defaults = {});

// Checks every field; throws InvalidArgument naming the field and the value.
void validate(const TransportOptions& options);

// Creates and connects a transport. Throws InvalidArgument (bad options, backend not built in),
// TimeoutError (a rank did not join in time, naming it), ProtocolError (authentication failed,
// naming the peer) or IoError.
[[nodiscard]] std::unique_ptr<Transport> make_transport(const TransportOptions& options);

// True when this process was started by mpirun/mpiexec (OpenMPI, MPICH/PMI or PMIx variables).
[[nodiscard]] bool launched_by_mpi() noexcept;

// Which backends this build contains.
[[nodiscard]] bool backend_available(Backend backend) noexcept;

[[nodiscard]] std::string_view backend_name(Backend backend) noexcept;
[[nodiscard]] std::optional<Backend> parse_backend(std::string_view name) noexcept;
[[nodiscard]] std::string_view rendezvous_name(RendezvousMethod method) noexcept;

}  // namespace pulseloco::transport
