// pulseloco_bench_collectives: our sparse all-gather and dense all-reduce over our TCP
// transport, against OpenMPI's MPI_Allgatherv and MPI_Allreduce on the same data.
//
// Under mpirun (--bootstrap mpi, the default when launched by mpirun) every rank runs both and
// times both; OpenMPI's transport is whatever mpirun was told (`--mca btl tcp,self` puts it on
// the same loopback sockets as ours; the default uses shared memory). With --bootstrap env the
// ranks are plain processes joined by the environment rendezvous (MASTER_ADDR, ...) and only
// ours runs: scripts/bench_collectives_netns uses that for shaped links.
//
// Method: for every (operation, size) one warm-up call of each library, then --iterations
// rounds, or more for short calls: as many as fill --min-seconds (judged by the warm-up calls,
// at most 1000; every rank computes the same number from the slowest rank's times), so that a
// millisecond point is not the median of a few milliseconds of a shared machine. Each round
// times one call of ours and one of OpenMPI's, alternating which goes first,
// so that a slow phase of a shared machine falls on both alike. Each call starts after a
// barrier; a call's time is the slowest rank's; the record holds the median and the minimum,
// and ours also the median over the rounds of (our time / OpenMPI's time in the same round).
// cpu_seconds is the median per call of the CPU time (user + system, every thread) all ranks'
// processes spent in it together: the work a call costs, steadier than wall time on a shared
// machine. OpenMPI's waiting ranks poll, so its figure counts waiting as well as work.
// payload_copied_bytes_per_call (ours, TCP transport only) is the mean per rank and timed call of
// the payload bytes the transport copied (TcpTransport::payload_bytes_copied(): frame edges read
// with a header, and messages that arrived before their receive) instead of having the kernel
// write them straight into the receive buffers.
// Buffers are allocated and touched once, before timing, for both libraries (our all-gather writes
// into a preallocated arena through sparse_allgather_into, as MPI_Allgatherv writes into its
// preallocated receive buffer). After timing, the results of the two libraries are compared byte
// for byte.
//
// --idle-ms N lets every rank sit idle for N ms between the barrier and each timed call, as a
// training loop computes between its collectives. Longer than the TCP transport's linger (5 ms,
// tcp/progress.h), it makes each of our calls start by taking the io_context back from the
// transport's I/O thread, the way a call after a window of compute starts.
//
// --json prints one JSON record per line and per (operation, transport, size).
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/cli/flag_checks.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/group/rendezvous_server.h>
#include <pulseloco/transport/tcp/tcp_transport.h>

#if PULSELOCO_BENCH_MPI
#include <mpi.h>
#endif

namespace {

using namespace pulseloco;
using Clock = std::chrono::steady_clock;

struct Settings {
  std::string bootstrap = "auto";
  std::vector<std::string> operations = {"sparse_allgather", "allreduce_sum"};
  std::vector<std::string> sizes = {"1M", "4M", "16M", "64M", "256M"};
  int iterations = 5;
  double min_seconds = 1.0;  // rounds of a point fill at least this long (warm-up estimate)
  std::string algorithm = "automatic";
  std::size_t chunk = collectives::CollectiveOptions{}.pipeline_chunk_bytes;
  int connections = 0;  // 0: the transport's default
  bool run_mpi = true;
  bool json = false;
  double link_mbit = 0;  // > 0: also report the bound (bytes each rank receives / link rate)
  // Idle time between the barrier and every timed call, as a training loop computes between
  // collectives (not timed).
  double idle_ms = 0;
  std::string label;  // extra "setup" field of every record
  // "none", "hmac" or "tls" (with a fixed secret unless PULSELOCO_SECRET sets one); "": as the
  // environment says.
  std::string link_security;
  int timeout_ms = 300'000;
};

std::size_t parse_size(const std::string& text) {
  std::size_t end = 0;
  const unsigned long long value = std::stoull(text, &end);
  const std::string suffix = text.substr(end);
  if (suffix.empty()) return value;
  if (suffix == "K" || suffix == "KiB") return value << 10;
  if (suffix == "M" || suffix == "MiB") return value << 20;
  if (suffix == "G" || suffix == "GiB") return value << 30;
  throw std::invalid_argument("size " + text + ": use a number with K, M or G");
}

// The --link-security switch: encryption on (tls) or off (hmac: the same secret, plaintext).
void apply_link_security(const Settings& settings, group::TransportOptions& options) {
  if (settings.link_security.empty()) return;
  if (settings.link_security == "none") {
    options.tcp.secret.clear();
    options.tcp.link_security = transport::LinkSecurity::automatic;
    return;
  }
  if (options.tcp.secret.empty()) options.tcp.secret = "pulseloco benchmark secret";
  options.tcp.link_security = settings.link_security == "tls" ? transport::LinkSecurity::tls
                                                              : transport::LinkSecurity::hmac;
}

collectives::CollectiveAlgorithm parse_algorithm(const std::string& name) {
  if (name == "ring") return collectives::CollectiveAlgorithm::ring;
  if (name == "direct") return collectives::CollectiveAlgorithm::direct;
  return collectives::CollectiveAlgorithm::automatic;
}

struct Timing {
  double median = 0;
  double min = 0;
  double cpu_median = 0;  // CPU seconds of all ranks' processes together, per call
  int calls = 0;          // timed calls behind the figures
  // Our TCP transport only: payload bytes a rank copied out of its staging buffer or its
  // early-message memory per timed call (mean over ranks and calls); the rest the kernel wrote
  // straight into the receive buffers.
  std::optional<double> copied_bytes_per_call;
};

double median_of(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

Timing summarize(const std::vector<double>& seconds, const std::vector<double>& cpu = {}) {
  return {median_of(seconds), *std::min_element(seconds.begin(), seconds.end()),
          cpu.empty() ? 0.0 : median_of(cpu), static_cast<int>(seconds.size())};
}

// Rounds for a point whose warm-up calls took `round_seconds` together (the same on every
// rank: they are the slowest rank's times).
int rounds_for(const Settings& settings, double round_seconds) {
  constexpr int kMaxRounds = 1000;
  if (round_seconds <= 0) return settings.iterations;
  const double wanted = std::ceil(settings.min_seconds / round_seconds);
  return std::max(settings.iterations, static_cast<int>(std::min<double>(wanted, kMaxRounds)));
}

// User and system CPU time of this process so far (every thread: the transport's I/O threads
// included). Wall time on this shared 2-core machine drifts; the CPU a call costs is steadier.
double process_cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto seconds = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6;
  };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

// The pieces every benchmark call needs: the group, how to synchronise and how to combine
// the ranks' times.
class Harness {
 public:
  explicit Harness(const Settings& settings) : settings_(settings) {
    bool use_mpi =
        settings.bootstrap == "mpi" || (settings.bootstrap == "auto" && group::launched_by_mpi());
#if PULSELOCO_BENCH_MPI
    if (use_mpi) {
      MPI_Init(nullptr, nullptr);
      mpi_ = true;
      transport_ = connect_through_mpi();
    }
#else
    if (use_mpi) throw std::runtime_error("this build has no MPI");
#endif
    if (!transport_) {
      group::TransportOptions options = group::from_environment();
      if (settings.connections > 0) options.tcp.connections_per_peer = settings.connections;
      apply_link_security(settings, options);
      transport_ = group::make_transport(options);
    }
    options_.timeout = std::chrono::milliseconds(settings.timeout_ms);
    options_.algorithm = parse_algorithm(settings.algorithm);
    options_.pipeline_chunk_bytes = settings.chunk;
    options_.tag = 1;
  }
  ~Harness() {
    transport_.reset();
#if PULSELOCO_BENCH_MPI
    if (mpi_) MPI_Finalize();
#endif
  }
  Harness(const Harness&) = delete;
  Harness& operator=(const Harness&) = delete;

  [[nodiscard]] transport::Transport& transport() {
    return *transport_;
  }
  [[nodiscard]] const collectives::CollectiveOptions& options() const {
    return options_;
  }
  [[nodiscard]] bool mpi() const {
    return mpi_;
  }
  [[nodiscard]] int rank() const {
    return transport_->rank();
  }
  [[nodiscard]] int size() const {
    return transport_->size();
  }

  // One library's call, how to synchronise the ranks before it, how to turn this rank's time
  // into the slowest rank's, and how to add up every rank's value.
  struct Contender {
    std::function<void()> call;
    std::function<void()> sync;
    std::function<double(double)> slowest;
    std::function<double(double)> total;
    // This rank's TcpTransport::payload_bytes_copied() so far (empty: not reported).
    std::function<std::uint64_t()> copied_bytes;
  };
  struct Timings {
    Timing ours;
    std::optional<Timing> theirs;
    std::optional<double> ratio;  // median over the rounds of ours / theirs
  };

  // One warm-up call of each, then rounds_for() rounds of one timed call of each, the order
  // alternating from round to round.
  Timings time(const Contender& ours, const Contender* theirs) {
    struct Sample {
      double seconds = 0;  // the slowest rank's
      double cpu = 0;      // every rank's together
    };
    const auto idle = std::chrono::duration<double, std::milli>(settings_.idle_ms);
    std::uint64_t our_copied = 0;  // by this rank in the timed calls (not the warm-up)
    bool warmed_up = false;
    const auto timed = [&](const Contender& contender) {
      contender.sync();
      if (idle.count() > 0) std::this_thread::sleep_for(idle);
      const std::uint64_t copied_start = contender.copied_bytes ? contender.copied_bytes() : 0;
      const double cpu_start = process_cpu_seconds();
      const auto start = Clock::now();
      contender.call();
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      const double cpu = process_cpu_seconds() - cpu_start;
      if (contender.copied_bytes && warmed_up)
        our_copied += contender.copied_bytes() - copied_start;
      return Sample{contender.slowest(seconds), contender.total(cpu)};
    };
    double warm_up = timed(ours).seconds;
    if (theirs != nullptr) warm_up += timed(*theirs).seconds;
    warmed_up = true;
    const int rounds = rounds_for(settings_, warm_up);
    std::vector<double> our_seconds, their_seconds, our_cpu, their_cpu, ratios;
    for (int i = 0; i < rounds; ++i) {
      const bool ours_first = i % 2 == 0;
      const Sample first = timed(ours_first || theirs == nullptr ? ours : *theirs);
      our_seconds.push_back(first.seconds);
      our_cpu.push_back(first.cpu);
      if (theirs == nullptr) continue;
      const Sample second = timed(ours_first ? *theirs : ours);
      their_seconds.push_back(second.seconds);
      their_cpu.push_back(second.cpu);
      if (!ours_first) {
        std::swap(our_seconds.back(), their_seconds.back());
        std::swap(our_cpu.back(), their_cpu.back());
      }
      ratios.push_back(our_seconds.back() / their_seconds.back());
    }
    Timings out{.ours = summarize(our_seconds, our_cpu)};
    if (ours.copied_bytes) {
      std::uint64_t total = 0;
      for (const std::uint64_t bytes :
           collectives::allgather_u64(*transport_, our_copied, barrier_options()))
        total += bytes;
      out.ours.copied_bytes_per_call =
          static_cast<double>(total) / (static_cast<double>(rounds) * size());
    }
    if (theirs != nullptr) {
      out.theirs = summarize(their_seconds, their_cpu);
      out.ratio = median_of(ratios);
    }
    return out;
  }

  // This rank's copied payload bytes so far, where the transport is our TCP transport.
  [[nodiscard]] std::function<std::uint64_t()> copied_bytes_counter() const {
    const auto* tcp = dynamic_cast<const transport::TcpTransport*>(transport_.get());
    if (tcp == nullptr) return {};
    return [tcp] { return tcp->payload_bytes_copied(); };
  }

  void our_barrier() {
    collectives::barrier(*transport_, barrier_options());
  }
  double our_slowest(double mine) {
    const auto all = gather_nanoseconds(mine);
    return static_cast<double>(*std::max_element(all.begin(), all.end())) / 1e9;
  }
  double our_total(double mine) {
    double sum = 0;
    for (const std::uint64_t ns : gather_nanoseconds(mine))
      sum += static_cast<double>(ns) / 1e9;
    return sum;
  }

 private:
  std::vector<std::uint64_t> gather_nanoseconds(double seconds) {
    return collectives::allgather_u64(*transport_, static_cast<std::uint64_t>(seconds * 1e9),
                                      barrier_options());
  }
  [[nodiscard]] collectives::CollectiveOptions barrier_options() const {
    collectives::CollectiveOptions options = options_;
    options.tag = 2;
    return options;
  }

#if PULSELOCO_BENCH_MPI
  std::unique_ptr<transport::Transport> connect_through_mpi() {
    int rank = 0;
    int size = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    group::TransportOptions options = group::from_environment();
    options.backend = transport::Backend::tcp;
    options.rendezvous = group::RendezvousMethod::environment;
    options.rank = rank;
    options.world_size = size;
    options.master_addr = "127.0.0.1";
    options.tcp.listen_addr = "127.0.0.1";
    options.external_rendezvous_server = true;
    if (settings_.connections > 0) options.tcp.connections_per_peer = settings_.connections;
    apply_link_security(settings_, options);
    std::unique_ptr<group::RendezvousServer> server;
    int port = 0;
    if (rank == 0) {
      server = std::make_unique<group::RendezvousServer>(
          "127.0.0.1", 0, size, options.tcp,
          transport::deadline_after(options.connect_timeout));
      port = server->port();
    }
    MPI_Bcast(&port, 1, MPI_INT, 0, MPI_COMM_WORLD);
    options.master_port = static_cast<std::uint16_t>(port);
    auto t = group::make_transport(options);
    if (server) server->wait();
    return t;
  }
#endif

  const Settings& settings_;
  std::unique_ptr<transport::Transport> transport_;
  collectives::CollectiveOptions options_;
  bool mpi_ = false;
};

std::string mpi_label() {
  const char* btl = std::getenv("OMPI_MCA_btl");
  if (btl != nullptr && std::string(btl).find("tcp") != std::string::npos &&
      std::string(btl).find("vader") == std::string::npos &&
      std::string(btl).find("sm") == std::string::npos) {
    return "openmpi-tcp";
  }
  return "openmpi-default";
}

class Reporter {
 public:
  Reporter(const Settings& settings, const Harness& harness)
      : settings_(settings), harness_(harness) {
    if (harness.rank() == 0 && !settings.json) {
      fmt::print("{:<18} {:<16} {:<10} {:>12} {:>12} {:>12} {:>10} {:>8}\n", "operation",
                 "transport", "algorithm", "bytes/rank", "median s", "min s", "Gbit/s", "cpu s");
    }
  }

  void record(const std::string& operation, const std::string& transport,
              const std::string& algorithm, std::size_t bytes, const Timing& timing,
              std::optional<double> ratio_to_openmpi = std::nullopt) const {
    if (harness_.rank() != 0) return;
    const int n = harness_.size();
    // Bytes every rank receives: (n-1) messages for the all-gather; 2 (n-1)/n of the vector
    // for the ring all-reduce (the classic algorithm-bandwidth accounting).
    const double received = operation == "sparse_allgather"
                                ? static_cast<double>(n - 1) * static_cast<double>(bytes)
                                : 2.0 * (n - 1) / n * static_cast<double>(bytes);
    const double gbit = received * 8 / timing.median / 1e9;
    if (settings_.json) {
      nlohmann::json j = {{"benchmark", "collectives"},
                          {"operation", operation},
                          {"transport", transport},
                          {"algorithm", algorithm},
                          {"ranks", n},
                          {"bytes_per_rank", bytes},
                          {"seconds", timing.median},
                          {"seconds_min", timing.min},
                          {"cpu_seconds", timing.cpu_median},
                          {"iterations", timing.calls},
                          {"received_gbit_per_s", gbit}};
      if (settings_.link_mbit > 0) {
        const double bound = received * 8 / (settings_.link_mbit * 1e6);
        j["link_mbit"] = settings_.link_mbit;
        j["bound_seconds"] = bound;
        j["ratio_to_bound"] = timing.median / bound;
      }
      if (ratio_to_openmpi) j["ratio_to_openmpi"] = *ratio_to_openmpi;
      if (timing.copied_bytes_per_call)
        j["payload_copied_bytes_per_call"] = *timing.copied_bytes_per_call;
      if (settings_.idle_ms > 0) j["idle_ms"] = settings_.idle_ms;
      if (!settings_.label.empty()) j["setup"] = settings_.label;
      if (!settings_.link_security.empty()) j["link_security"] = settings_.link_security;
      fmt::print("{}\n", j.dump());
    } else {
      fmt::print("{:<18} {:<16} {:<10} {:>12} {:>12.6f} {:>12.6f} {:>10.2f} {:>8.3f}", operation,
                 transport, algorithm, bytes, timing.median, timing.min, gbit, timing.cpu_median);
      if (settings_.link_mbit > 0) {
        fmt::print("  ({:.2f}x the link bound)",
                   timing.median / (received * 8 / (settings_.link_mbit * 1e6)));
      }
      if (ratio_to_openmpi) fmt::print("  ({:.2f}x OpenMPI, median of rounds)", *ratio_to_openmpi);
      fmt::print("\n");
    }
    std::fflush(stdout);
  }

 private:
  const Settings& settings_;
  const Harness& harness_;
};

// How OpenMPI's calls synchronise and combine their ranks' times.
#if PULSELOCO_BENCH_MPI
Harness::Contender openmpi_contender(std::function<void()> call) {
  return {.call = std::move(call),
          .sync = [] { MPI_Barrier(MPI_COMM_WORLD); },
          .slowest =
              [](double s) {
                double slowest = 0;
                MPI_Allreduce(&s, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                return slowest;
              },
          .total =
              [](double s) {
                double sum = 0;
                MPI_Allreduce(&s, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
                return sum;
              }};
}
#endif

Harness::Contender our_contender(Harness& h, std::function<void()> call) {
  return {.call = std::move(call),
          .sync = [&h] { h.our_barrier(); },
          .slowest = [&h](double s) { return h.our_slowest(s); },
          .total = [&h](double s) { return h.our_total(s); },
          .copied_bytes = h.copied_bytes_counter()};
}

// Times one (operation, size) point for ours and, when `theirs` is given, OpenMPI's, and
// records both.
void time_point(Harness& h, const Reporter& reporter, const std::string& operation,
                const std::string& our_algorithm, const std::string& their_algorithm,
                std::size_t bytes, const Harness::Contender& ours,
                const Harness::Contender* theirs) {
  const Harness::Timings timings = h.time(ours, theirs);
  reporter.record(operation, "pulseloco-tcp", our_algorithm, bytes, timings.ours, timings.ratio);
  if (timings.theirs) {
    reporter.record(operation, mpi_label(), their_algorithm, bytes, *timings.theirs);
  }
}

void bench_allgather(Harness& h, const Reporter& reporter, const Settings& settings,
                     std::size_t bytes) {
  const int n = h.size();
  std::vector<std::byte> mine(bytes);
  const auto seed = static_cast<std::size_t>(h.rank()) * 7;
  for (std::size_t i = 0; i < bytes; ++i)
    mine[i] = static_cast<std::byte>((i * 131 + seed) & 0xFF);
  std::vector<std::byte> ours(bytes * static_cast<std::size_t>(n), std::byte{1});
  const auto buffer_for = [&](int rank, std::size_t size) {
    return std::span(ours).subspan(static_cast<std::size_t>(rank) * bytes, size);
  };
  const Harness::Contender our_call = our_contender(
      h, [&] { collectives::sparse_allgather_into(h.transport(), mine, buffer_for, h.options()); });
  std::vector<std::uint64_t> sizes(static_cast<std::size_t>(n), bytes);
  const auto algorithm = h.options().algorithm == collectives::CollectiveAlgorithm::automatic
                             ? collectives::choose_allgather_algorithm(sizes)
                             : h.options().algorithm;
  const std::string our_algorithm(collectives::algorithm_name(algorithm));
#if PULSELOCO_BENCH_MPI
  if (h.mpi() && settings.run_mpi) {
    std::vector<std::byte> theirs(bytes * static_cast<std::size_t>(n), std::byte{2});
    std::vector<int> counts(static_cast<std::size_t>(n), static_cast<int>(bytes));
    std::vector<int> displacements(static_cast<std::size_t>(n));
    for (int rank = 0; rank < n; ++rank) {
      displacements[static_cast<std::size_t>(rank)] = static_cast<int>(bytes) * rank;
    }
    const Harness::Contender their_call = openmpi_contender([&] {
      MPI_Allgatherv(mine.data(), static_cast<int>(bytes), MPI_BYTE, theirs.data(), counts.data(),
                     displacements.data(), MPI_BYTE, MPI_COMM_WORLD);
    });
    time_point(h, reporter, "sparse_allgather", our_algorithm, "MPI_Allgatherv", bytes, our_call,
               &their_call);
    if (ours != theirs) throw std::runtime_error("our all-gather and MPI_Allgatherv differ");
    return;
  }
#else
  (void)settings;
#endif
  time_point(h, reporter, "sparse_allgather", our_algorithm, "", bytes, our_call, nullptr);
}

void bench_allreduce(Harness& h, const Reporter& reporter, const Settings& settings,
                     std::size_t bytes) {
  const std::size_t count = bytes / sizeof(float);
  std::vector<float> input(count);
  const auto offset = static_cast<std::size_t>(h.rank());
  for (std::size_t i = 0; i < count; ++i) {
    // Exactly representable sums: ours and MPI's must agree bit for bit whatever the order.
    input[i] = static_cast<float>((i + offset) % 1024);
  }
  std::vector<float> ours(count, 0.0F);
  const Harness::Contender our_call = our_contender(
      h, [&] { collectives::allreduce_sum(h.transport(), input, ours, h.options()); });
  const auto algorithm = h.options().algorithm == collectives::CollectiveAlgorithm::automatic
                             ? collectives::choose_allreduce_algorithm(count, h.size())
                             : h.options().algorithm;
  const std::string our_algorithm(collectives::algorithm_name(algorithm));
#if PULSELOCO_BENCH_MPI
  if (h.mpi() && settings.run_mpi) {
    std::vector<float> theirs(count, 0.0F);
    const Harness::Contender their_call = openmpi_contender([&] {
      MPI_Allreduce(input.data(), theirs.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                    MPI_COMM_WORLD);
    });
    time_point(h, reporter, "allreduce_sum", our_algorithm, "MPI_Allreduce", bytes, our_call,
               &their_call);
    if (ours != theirs) throw std::runtime_error("our all-reduce and MPI_Allreduce differ");
    return;
  }
#else
  (void)settings;
#endif
  time_point(h, reporter, "allreduce_sum", our_algorithm, "", bytes, our_call, nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  CLI::App app{"Collectives benchmark: pulseloco over TCP against OpenMPI"};
  app.add_option("--bootstrap", settings.bootstrap, "mpi (under mpirun), env, or auto")
      ->check(CLI::IsMember({"auto", "mpi", "env"}));
  app.add_option("--ops", settings.operations, "sparse_allgather, allreduce_sum")
      ->delimiter(',')
      ->check(CLI::IsMember({"sparse_allgather", "allreduce_sum"}));
  app.add_option("--sizes", settings.sizes, "bytes per rank, e.g. 1M,4M,256M")->delimiter(',');
  app.add_option("--iterations", settings.iterations, "timed calls per point, at least")
      ->check(flags::at_least(1));
  app.add_option("--min-seconds", settings.min_seconds,
                 "more rounds for short calls, until a point's rounds take this long (0: off)")
      ->check(flags::at_least(0));
  app.add_option("--algorithm", settings.algorithm, "algorithm of both collectives")
      ->check(CLI::IsMember({"automatic", "ring", "direct"}));
  app.add_option("--chunk", settings.chunk, "pipeline_chunk_bytes")->check(flags::at_least(1));
  app.add_option("--connections", settings.connections, "TCP connections per peer (0: default)");
  app.add_flag("!--no-mpi", settings.run_mpi, "only our collectives");
  app.add_flag("--json", settings.json, "one JSON record per line");
  app.add_option("--link-mbit", settings.link_mbit, "shaped link rate, to report the bound");
  app.add_option("--idle-ms", settings.idle_ms,
                 "idle time after the barrier before every timed call (not timed)")
      ->check(flags::at_least(0));
  app.add_option("--label", settings.label, "a 'setup' field for every record");
  app.add_option("--link-security", settings.link_security,
                 "links: tls (encrypted), hmac (plaintext, authenticated) or none; default: "
                 "PULSELOCO_LINK_SECURITY and PULSELOCO_SECRET")
      ->check(CLI::IsMember({"none", "hmac", "tls"}));
  app.add_option("--timeout-ms", settings.timeout_ms, "collective timeout");
  CLI11_PARSE(app, argc, argv);
  try {
    Harness harness(settings);
    const Reporter reporter(settings, harness);
    for (const std::string& operation : settings.operations) {
      for (const std::string& size : settings.sizes) {
        const std::size_t bytes = parse_size(size);
        if (operation == "sparse_allgather") {
          bench_allgather(harness, reporter, settings, bytes);
        } else {
          bench_allreduce(harness, reporter, settings, bytes);
        }
      }
    }
  } catch (const std::exception& error) {
    fmt::print(stderr, "pulseloco_bench_collectives: {}\n", error.what());
    return 1;
  }
  return 0;
}
