// Point-to-point throughput of a transport between two ranks.
//
//   build/bin/pulseloco_bench_transport                       two TCP ranks in this process
//   mpirun -np 2 build/bin/pulseloco_bench_transport --backend mpi
//   mpirun -np 2 --mca btl tcp,self build/bin/pulseloco_bench_transport --backend mpi
//   mpirun -np 2 build/bin/pulseloco_bench_transport --backend tcp   (MPI rendezvous)
//   RANK=.. WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. build/bin/pulseloco_bench_transport
//
// Patterns: "exchange" (both ranks send a message to each other at once, as in one step of a
// ring) and "stream" (rank 0 sends, rank 1 receives). Each record reports the mean seconds of
// one operation and the bytes per second in one direction. --json prints one JSON object per
// line.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/group/rendezvous_server.h>
#include <pulseloco/transport/tcp/tcp_transport.h>

namespace {

using namespace pulseloco;
using namespace pulseloco::transport;
using namespace pulseloco::group;

struct Config {
  std::string backend = "tcp";
  std::vector<std::string> patterns = {"exchange", "stream"};
  std::size_t min_bytes = 1024;
  std::size_t max_bytes = std::size_t{256} << 20;
  double seconds_per_size = 0.5;
  int connections = -1;
  bool json = false;
};

struct Result {
  std::string pattern;
  std::size_t bytes = 0;
  int iterations = 0;
  double seconds = 0;  // mean per operation
};

constexpr auto kTimeout = std::chrono::seconds(120);

// One operation of `pattern` on `rank` (0 or 1) of `transport`.
void run_once(Transport& transport, const std::string& pattern, std::span<const std::byte> out,
              std::span<std::byte> in, Tag tag) {
  const int rank = transport.rank();
  const int peer = 1 - rank;
  const auto deadline = deadline_after(kTimeout);
  if (pattern == "exchange") {
    auto recv = transport.irecv(peer, tag, in);
    auto send = transport.isend(peer, tag, out);
    send->wait(deadline);
    recv->wait(deadline);
  } else if (rank == 0) {
    std::byte ack{};
    auto recv = transport.irecv(peer, tag, std::span(&ack, 0));
    transport.send(peer, tag, out, deadline);
    recv->wait(deadline);
  } else {
    auto recv = transport.irecv(peer, tag, in);
    recv->wait(deadline);
    transport.send(peer, tag, {}, deadline);
  }
}

// Both ranks run this; rank 0's measurements are returned (they agree by construction).
std::vector<Result> measure(Transport& transport, const Config& config) {
  std::vector<Result> results;
  std::vector<std::byte> out(config.max_bytes, std::byte{0x5a});
  std::vector<std::byte> in(config.max_bytes);
  Tag tag = 1;
  for (const auto& pattern : config.patterns) {
    for (std::size_t bytes = config.min_bytes; bytes <= config.max_bytes; bytes *= 4) {
      const std::span<const std::byte> o(out.data(), bytes);
      const std::span<std::byte> i(in.data(), bytes);
      run_once(transport, pattern, o, i, tag);  // warm-up
      // Rank 0 decides how many iterations fit in the time budget and tells rank 1.
      const auto start = std::chrono::steady_clock::now();
      run_once(transport, pattern, o, i, tag);
      const double first =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::uint32_t iterations = static_cast<std::uint32_t>(
          std::clamp(config.seconds_per_size / std::max(first, 1e-6), 3.0, 10000.0));
      auto* raw = reinterpret_cast<std::byte*>(&iterations);
      if (transport.rank() == 0) {
        transport.send(1, tag + 1, std::span<const std::byte>(raw, sizeof iterations),
                       deadline_after(kTimeout));
      } else {
        transport.recv(0, tag + 1, std::span<std::byte>(raw, sizeof iterations),
                       deadline_after(kTimeout));
      }
      const auto begin = std::chrono::steady_clock::now();
      for (std::uint32_t k = 0; k < iterations; ++k)
        run_once(transport, pattern, o, i, tag);
      const double total =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      results.push_back({pattern, bytes, static_cast<int>(iterations), total / iterations});
      tag += 2;
    }
  }
  return results;
}

void print(const std::vector<Result>& results, const Config& config, std::string_view backend,
           std::string_view where) {
  for (const auto& r : results) {
    const double rate = static_cast<double>(r.bytes) / r.seconds;
    if (config.json) {
      nlohmann::json record = {
          {"benchmark", "transport_p2p"}, {"backend", backend},      {"ranks", where},
          {"pattern", r.pattern},         {"bytes", r.bytes},        {"iterations", r.iterations},
          {"seconds", r.seconds},         {"bytes_per_second", rate}};
      if (config.connections > 0) record["connections_per_peer"] = config.connections;
      std::printf("%s\n", record.dump().c_str());
    } else {
      std::printf("%-5s %-9s %12zu B  %10.3f ms  %8.3f GB/s  (%d iterations)\n",
                  std::string(backend).c_str(), r.pattern.c_str(), r.bytes, r.seconds * 1e3,
                  rate / 1e9, r.iterations);
    }
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Config config;
  CLI::App app{"Point-to-point throughput of a pulseloco transport between two ranks"};
  // Host buffers only: NCCL (device buffers) is measured by NCCL's own nccl-tests.
  app.add_option("--backend", config.backend, "tcp or mpi")->check(CLI::IsMember({"tcp", "mpi"}));
  app.add_option("--patterns", config.patterns, "exchange and/or stream")
      ->check(CLI::IsMember({"exchange", "stream"}));
  app.add_option("--min-bytes", config.min_bytes, "smallest message");
  app.add_option("--max-bytes", config.max_bytes, "largest message (sizes grow 4x)");
  app.add_option("--seconds", config.seconds_per_size, "time budget per size");
  app.add_option("--connections", config.connections, "TCP connections per peer");
  app.add_flag("--json", config.json, "one JSON object per line");
  CLI11_PARSE(app, argc, argv);

  try {
    TransportOptions options = from_environment();
    options.backend = *parse_backend(config.backend);
    if (config.connections > 0) options.tcp.connections_per_peer = config.connections;
    const bool separate_processes =
        launched_by_mpi() || !options.master_addr.empty() || !options.peers.empty();
    if (separate_processes) {
      auto transport = make_transport(options);
      if (transport->size() < 2) throw InvalidArgument("needs at least two ranks");
      if (transport->rank() < 2) {
        auto results = measure(*transport, config);
        if (transport->rank() == 0) print(results, config, transport->backend(), "processes");
      }
      return 0;
    }
    if (options.backend != Backend::tcp)
      throw InvalidArgument("without mpirun or a rendezvous only --backend tcp can run here");
    RendezvousServer server("127.0.0.1", 0, 2, options.tcp,
                            deadline_after(options.connect_timeout));
    std::vector<std::unique_ptr<TcpTransport>> group(2);
    std::vector<Result> results;
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(2);
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          TransportOptions mine = options;
          mine.rendezvous = RendezvousMethod::environment;
          mine.rank = rank;
          mine.world_size = 2;
          mine.master_addr = "127.0.0.1";
          mine.master_port = server.port();
          mine.external_rendezvous_server = true;
          auto transport = make_tcp_transport(mine);
          auto measured = measure(*transport, config);
          if (rank == 0) results = std::move(measured);
        } catch (...) {
          errors[static_cast<std::size_t>(rank)] = std::current_exception();
        }
      });
    }
    for (auto& thread : threads)
      thread.join();
    for (auto& error : errors)
      if (error) std::rethrow_exception(error);
    print(results, config, "tcp", "threads");
    return 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "pulseloco_bench_transport: %s\n", error.what());
    return 1;
  }
}
