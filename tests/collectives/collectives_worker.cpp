// One rank of a multi-process collectives test: joins a TCP group (environment rendezvous, or
// bootstrapped through MPI when run by mpirun), runs collectives and checks their results
// against independently computed expectations. Driven by collectives_process_test.cpp (plain
// processes, faults) and by ctest through mpirun (see CMakeLists.txt).
//
//   pulseloco_collectives_worker --bootstrap env|mpi [--transport tcp|mpi]
//       --op suite|compare-mpi|allgather|allreduce
//       [--bytes N] [--algorithm ring|direct|automatic] [--chunk N] [--timeout-ms N]
//       [--victim R --event-fd FD [--block-fd FD]]
//
// Output (stdout, one line): "ok rank=R" and exit 0, or
// "error rank=R kind=K peer=P time_ns=T what=..." and exit 3 for a pulseloco::Error (T is the
// steady clock when it was caught), exit 4 for another exception, exit 5 for wrong results.
// Single operations start with a barrier (every rank's transport is up after it). With
// --victim, rank R writes "progress\n" to --event-fd once its collective has received a
// peer's message, then (with --block-fd) blocks reading that fd until killed or released.
#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/rendezvous_server.h>
#include "collective_reference.h"
#include "rank_harness.h"

#if PULSELOCO_WORKER_MPI
#include <mpi.h>
#endif

namespace {

using namespace pulseloco;
using collectives::CollectiveAlgorithm;
using collectives::CollectiveOptions;
using pulseloco::testing::pattern_bytes;

struct WrongResult : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Settings {
  std::string bootstrap = "env";
  std::string transport = "tcp";  // with --bootstrap mpi: tcp, or the MPI backend itself
  std::string op = "suite";
  std::size_t bytes = 1000;
  std::string algorithm = "automatic";
  std::size_t chunk = std::size_t{4} << 20;
  int timeout_ms = 30'000;
  int victim = -1;
  int event_fd = -1;
  int block_fd = -1;
};

CollectiveAlgorithm parse_algorithm(const std::string& name) {
  if (name == "ring") return CollectiveAlgorithm::ring;
  if (name == "direct") return CollectiveAlgorithm::direct;
  if (name == "automatic") return CollectiveAlgorithm::automatic;
  throw std::invalid_argument("unknown algorithm " + name);
}

std::string_view kind_word(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::invalid_argument:
      return "invalid_argument";
    case ErrorKind::io:
      return "io";
    case ErrorKind::timeout:
      return "timeout";
    case ErrorKind::peer_lost:
      return "peer_lost";
    case ErrorKind::protocol:
      return "protocol";
    case ErrorKind::divergence:
      return "divergence";
    case ErrorKind::non_finite:
      return "non_finite";
    case ErrorKind::membership:
      return "membership";
    case ErrorKind::aborted:
      return "aborted";
  }
  return "unknown";
}

// Message sizes of one all-gather case: odd, different on every rank, some empty.
using SizeRule = std::size_t (*)(int rank);
std::size_t all_empty(int) {
  return 0;
}
std::size_t one_byte(int) {
  return 1;
}
std::size_t odd_different(int r) {
  const auto u = static_cast<std::size_t>(r);
  return 1 + 2 * (u * 1009 + u * u * 37);
}
std::size_t some_empty(int r) {
  const auto u = static_cast<std::size_t>(r);
  return r % 2 == 0 ? 0 : 777 * u + 3;
}
std::size_t large_64mib(int r) {
  return (std::size_t{64} << 20) + static_cast<std::size_t>(r);
}
std::size_t large_16mib(int r) {
  return (std::size_t{16} << 20) + 3 * static_cast<std::size_t>(r);
}

void check_allgather(transport::Transport& t, SizeRule sizes, const CollectiveOptions& options,
                     std::uint64_t seed) {
  const int n = t.size();
  const auto mine = pattern_bytes(sizes(t.rank()), t.rank(), seed);
  const auto all = collectives::sparse_allgather(t, mine, options);
  for (int rank = 0; rank < n; ++rank) {
    if (all[static_cast<std::size_t>(rank)] != pattern_bytes(sizes(rank), rank, seed)) {
      throw WrongResult(fmt::format("all-gather (seed {}): rank {}'s message differs", seed, rank));
    }
  }
}

void check_allreduce(transport::Transport& t, std::size_t count, const CollectiveOptions& options) {
  const int n = t.size();
  std::vector<std::vector<float>> inputs(static_cast<std::size_t>(n), std::vector<float>(count));
  for (int rank = 0; rank < n; ++rank) {
    for (std::size_t e = 0; e < count; ++e) {
      inputs[static_cast<std::size_t>(rank)][e] =
          pulseloco::testing::order_sensitive_value(rank, e);
    }
  }
  std::vector<float> output(count);
  collectives::allreduce_sum(t, inputs[static_cast<std::size_t>(t.rank())], output, options);
  const std::vector<float> expected = pulseloco::testing::reference_allreduce(inputs);
  if (std::memcmp(output.data(), expected.data(), count * sizeof(float)) != 0) {
    throw WrongResult("all-reduce differs from the documented summation order");
  }
}

// Every collective with several sizes and both algorithms.
void run_suite(transport::Transport& t, const Settings& settings) {
  CollectiveOptions options{.timeout = std::chrono::milliseconds(settings.timeout_ms)};
  std::uint64_t seed = 0;
  for (const auto algorithm :
       {CollectiveAlgorithm::ring, CollectiveAlgorithm::direct, CollectiveAlgorithm::automatic}) {
    options.algorithm = algorithm;
    options.pipeline_chunk_bytes = 100;
    for (const SizeRule sizes : {all_empty, one_byte, odd_different, some_empty}) {
      check_allgather(t, sizes, options, ++seed);
    }
  }
  options.pipeline_chunk_bytes = std::size_t{4} << 20;
  options.algorithm = CollectiveAlgorithm::ring;
  check_allgather(t, large_64mib, options, ++seed);
  options.algorithm = CollectiveAlgorithm::direct;
  check_allgather(t, large_16mib, options, ++seed);
  options.algorithm = CollectiveAlgorithm::automatic;
  check_allreduce(t, (std::size_t{1} << 20) + 3, options);
  options.pipeline_chunk_bytes = 64 << 10;
  auto data = t.rank() == t.size() - 1 ? pattern_bytes(300'001, t.size() - 1, 99)
                                       : std::vector<std::byte>(300'001);
  collectives::broadcast(t, t.size() - 1, data, options);
  if (data != pattern_bytes(300'001, t.size() - 1, 99)) throw WrongResult("broadcast differs");
  collectives::barrier(t, options);
  const auto values =
      collectives::allgather_u64(t, 1000 + static_cast<std::uint64_t>(t.rank()), options);
  for (int rank = 0; rank < t.size(); ++rank) {
    if (values[static_cast<std::size_t>(rank)] != 1000 + static_cast<std::uint64_t>(rank)) {
      throw WrongResult("allgather_u64 differs");
    }
  }
}

// One collective; the victim reports progress and may block inside the callback.
void run_single(transport::Transport& t, const Settings& settings) {
  CollectiveOptions options{.timeout = std::chrono::milliseconds(settings.timeout_ms),
                            .algorithm = parse_algorithm(settings.algorithm),
                            .pipeline_chunk_bytes = settings.chunk};
  // Once this returns on any rank, every rank's transport is up: a fault test acts on the
  // victim's report, and a fault while a peer was still connecting would end that peer's
  // make_transport (exit 4) instead of the collective under test.
  collectives::barrier(t, options);
  const bool victim = t.rank() == settings.victim;
  const auto report_progress = [&] {
    if (!victim || settings.event_fd < 0) return;
    const char line[] = "progress\n";
    if (::write(settings.event_fd, line, sizeof line - 1) < 0) std::perror("write event fd");
    if (settings.block_fd >= 0) {
      char byte = 0;
      (void)::read(settings.block_fd, &byte, 1);  // until killed, stopped or released
    }
  };
  if (settings.op == "allgather") {
    const auto mine = pattern_bytes(settings.bytes, t.rank());
    bool reported = false;
    const auto all = collectives::sparse_allgather(t, mine, options, [&](int rank, auto) {
      if (rank != t.rank() && !reported) {
        reported = true;
        report_progress();
      }
    });
    for (int rank = 0; rank < t.size(); ++rank) {
      if (all[static_cast<std::size_t>(rank)] != pattern_bytes(settings.bytes, rank)) {
        throw WrongResult("all-gather differs");
      }
    }
  } else if (settings.op == "allreduce") {
    report_progress();  // before: the others are already moving data
    check_allreduce(t, settings.bytes / sizeof(float), options);
  } else {
    throw std::invalid_argument("unknown --op " + settings.op);
  }
}

#if PULSELOCO_WORKER_MPI
// MPI_Allgatherv on the same inputs must deliver exactly the bytes our all-gather delivers.
void compare_with_mpi(transport::Transport& t, const Settings& settings) {
  const int n = t.size();
  std::uint64_t seed = 500;
  for (const auto algorithm :
       {CollectiveAlgorithm::ring, CollectiveAlgorithm::direct, CollectiveAlgorithm::automatic}) {
    for (const SizeRule sizes :
         {all_empty, one_byte, odd_different, some_empty, large_16mib, large_64mib}) {
      if (sizes == large_64mib && algorithm != CollectiveAlgorithm::automatic) continue;
      const CollectiveOptions options{.timeout = std::chrono::milliseconds(settings.timeout_ms),
                                      .algorithm = algorithm,
                                      .pipeline_chunk_bytes = sizes(1) < 4096 ? 100U : 1U << 20};
      const auto mine = pattern_bytes(sizes(t.rank()), t.rank(), ++seed);
      const auto ours = collectives::sparse_allgather(t, mine, options);

      const int count = static_cast<int>(mine.size());
      std::vector<int> counts(static_cast<std::size_t>(n));
      MPI_Allgather(&count, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
      std::vector<int> displacements(static_cast<std::size_t>(n));
      std::size_t total = 0;
      for (int rank = 0; rank < n; ++rank) {
        displacements[static_cast<std::size_t>(rank)] = static_cast<int>(total);
        total += static_cast<std::size_t>(counts[static_cast<std::size_t>(rank)]);
      }
      std::vector<std::byte> theirs(total);
      MPI_Allgatherv(mine.data(), count, MPI_BYTE, theirs.data(), counts.data(),
                     displacements.data(), MPI_BYTE, MPI_COMM_WORLD);
      for (int rank = 0; rank < n; ++rank) {
        const auto index = static_cast<std::size_t>(rank);
        const auto expected =
            std::span(theirs).subspan(static_cast<std::size_t>(displacements[index]),
                                      static_cast<std::size_t>(counts[index]));
        if (!std::equal(ours[index].begin(), ours[index].end(), expected.begin(), expected.end())) {
          throw WrongResult(
              fmt::format("algorithm {}, seed {}: rank {}'s message differs from "
                          "what MPI_Allgatherv delivered",
                          collectives::algorithm_name(algorithm), seed, rank));
        }
      }
    }
  }
}

// The MPI backend, or a TCP group whose rendezvous server runs on rank 0 on an ephemeral port
// that the others learn through MPI.
std::unique_ptr<transport::Transport> connect_through_mpi(const std::string& backend) {
  if (backend == "mpi") {
    group::TransportOptions options;
    options.backend = transport::Backend::mpi;
    return group::make_transport(options);
  }
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  group::TransportOptions options;
  options.backend = transport::Backend::tcp;
  options.rendezvous = group::RendezvousMethod::environment;
  options.rank = rank;
  options.world_size = size;
  options.master_addr = "127.0.0.1";
  options.tcp.listen_addr = "127.0.0.1";
  options.external_rendezvous_server = true;
  std::unique_ptr<group::RendezvousServer> server;
  int port = 0;
  if (rank == 0) {
    server = std::make_unique<group::RendezvousServer>(
        "127.0.0.1", 0, size, transport::TcpOptions{}, transport::deadline_after(options.connect_timeout));
    port = server->port();
  }
  MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
  options.master_port = static_cast<std::uint16_t>(port);
  auto t = group::make_transport(options);
  if (server) server->wait();
  return t;
}
#endif

int run(const Settings& settings) {
  std::unique_ptr<transport::Transport> t;
#if PULSELOCO_WORKER_MPI
  if (settings.bootstrap == "mpi") t = connect_through_mpi(settings.transport);
#endif
  if (settings.bootstrap == "env") t = group::make_transport(group::from_environment());
  if (!t) throw std::invalid_argument("unknown or unavailable --bootstrap " + settings.bootstrap);
  const int rank = t->rank();
  try {
    if (settings.op == "suite") {
      run_suite(*t, settings);
#if PULSELOCO_WORKER_MPI
    } else if (settings.op == "compare-mpi") {
      compare_with_mpi(*t, settings);
#endif
    } else {
      run_single(*t, settings);
    }
  } catch (const Error& error) {
    const auto now = std::chrono::steady_clock::now().time_since_epoch();
    std::printf("error rank=%d kind=%s peer=%d time_ns=%lld what=%s\n", rank,
                std::string(kind_word(error.kind())).c_str(), error.context().peer.value_or(-1),
                static_cast<long long>(std::chrono::nanoseconds(now).count()), error.what());
    std::fflush(stdout);
    return 3;
  } catch (const WrongResult& error) {
    std::printf("wrong rank=%d what=%s\n", rank, error.what());
    std::fflush(stdout);
    return 5;
  }
  std::printf("ok rank=%d\n", rank);
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  CLI::App app{"One rank of a multi-process collectives test"};
  app.add_option("--bootstrap", settings.bootstrap)->check(CLI::IsMember({"env", "mpi"}));
  app.add_option("--transport", settings.transport)->check(CLI::IsMember({"tcp", "mpi"}));
  app.add_option("--op", settings.op);
  app.add_option("--bytes", settings.bytes);
  app.add_option("--algorithm", settings.algorithm)
      ->check(CLI::IsMember({"ring", "direct", "automatic"}));
  app.add_option("--chunk", settings.chunk);
  app.add_option("--timeout-ms", settings.timeout_ms);
  app.add_option("--victim", settings.victim);
  app.add_option("--event-fd", settings.event_fd);
  app.add_option("--block-fd", settings.block_fd);
  CLI11_PARSE(app, argc, argv);
#if PULSELOCO_WORKER_MPI
  if (settings.bootstrap == "mpi") {
    int provided = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  }
#endif
  int status = 4;
  try {
    status = run(settings);
  } catch (const std::exception& error) {
    std::printf("failed what=%s\n", error.what());
    std::fflush(stdout);
    status = 4;
  }
#if PULSELOCO_WORKER_MPI
  if (settings.bootstrap == "mpi") {
    if (status == 0) {
      MPI_Finalize();
    } else {
      MPI_Abort(MPI_COMM_WORLD, status);
    }
  }
#endif
  return status;
}
