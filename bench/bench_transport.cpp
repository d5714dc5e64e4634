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
//
// --link-security hmac,tls,... builds one TCP group per setting (the environment rendezvous uses
// MASTER_PORT, MASTER_PORT+1, ...) and measures them side by side: for every pattern and size,
// --repeats rounds, each measuring every group in turn (each round starting with the next
// group), so that what else the machine does weighs on all alike.
#include <sys/resource.h>

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
  std::vector<std::string> link_securities;  // empty: the environment's
  int repeats = 1;
  std::string label;
  bool json = false;
};

struct Result {
  std::string pattern;
  std::size_t bytes = 0;
  std::string link_security;  // empty: the environment's
  int repeat = 0;
  int iterations = 0;
  double seconds = 0;      // mean per operation
  double cpu_seconds = 0;  // this process's CPU time per operation (both ranks as threads)
};

// One group of two ranks; `link_security` names its setting (empty: the environment's).
struct Group {
  std::string link_security;
  std::unique_ptr<Transport> transport;  // this rank's
};

constexpr auto kTimeout = std::chrono::seconds(120);

// Encryption on (tls), off (hmac: the same secret, plaintext), or on except between ranks of
// one host (tls-same-host-plaintext: PULSELOCO_SAME_HOST_PLAINTEXT=1).
void apply_link_security(const std::string& name, TransportOptions& options) {
  if (name.empty()) return;
  if (options.tcp.secret.empty()) options.tcp.secret = "pulseloco benchmark secret";
  options.tcp.link_security = name == "hmac" ? LinkSecurity::hmac : LinkSecurity::tls;
  options.tcp.same_host_plaintext = name == "tls-same-host-plaintext";
}

double cpu_seconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const auto seconds = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6;
  };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

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

// The mean time of `pattern` with `bytes` on `transport` (both ranks call it).
Result measure_one(Transport& transport, const Config& config, const std::string& pattern,
                   std::span<const std::byte> out, std::span<std::byte> in, Tag tag) {
  run_once(transport, pattern, out, in, tag);  // warm-up
  // Rank 0 decides how many iterations fit in the time budget and tells rank 1.
  const auto start = std::chrono::steady_clock::now();
  run_once(transport, pattern, out, in, tag);
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
  const double cpu_before = cpu_seconds();
  const auto begin = std::chrono::steady_clock::now();
  for (std::uint32_t k = 0; k < iterations; ++k)
    run_once(transport, pattern, out, in, tag);
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  Result result;
  result.pattern = pattern;
  result.bytes = out.size();
  result.iterations = static_cast<int>(iterations);
  result.seconds = total / iterations;
  result.cpu_seconds = (cpu_seconds() - cpu_before) / iterations;
  return result;
}

// Both ranks run this over the same groups; rank 0's measurements are returned (they agree by
// construction).
std::vector<Result> measure(const std::vector<Group>& groups, const Config& config) {
  std::vector<Result> results;
  std::vector<std::byte> out(config.max_bytes, std::byte{0x5a});
  std::vector<std::byte> in(config.max_bytes);
  Tag tag = 1;
  for (const auto& pattern : config.patterns) {
    for (std::size_t bytes = config.min_bytes; bytes <= config.max_bytes; bytes *= 4) {
      for (int repeat = 1; repeat <= config.repeats; ++repeat) {
        // Each round starts with another group, so that none is always measured first.
        for (std::size_t k = 0; k < groups.size(); ++k) {
          const Group& group = groups[(k + static_cast<std::size_t>(repeat) - 1) % groups.size()];
          Result result = measure_one(*group.transport, config, pattern,
                                      std::span(out).first(bytes), std::span(in).first(bytes), tag);
          result.link_security = group.link_security;
          result.repeat = repeat;
          results.push_back(std::move(result));
          tag += 2;
        }
      }
    }
  }
  return results;
}

void print(const std::vector<Result>& results, const Config& config, std::string_view backend,
           std::string_view where) {
  for (const auto& r : results) {
    const double rate = static_cast<double>(r.bytes) / r.seconds;
    if (config.json) {
      nlohmann::json record = {{"benchmark", "transport_p2p"},
                               {"backend", backend},
                               {"ranks", where},
                               {"pattern", r.pattern},
                               {"bytes", r.bytes},
                               {"iterations", r.iterations},
                               {"seconds", r.seconds},
                               {"bytes_per_second", rate},
                               {"cpu_seconds", r.cpu_seconds}};
      if (config.connections > 0) record["connections_per_peer"] = config.connections;
      if (!r.link_security.empty()) record["link_security"] = r.link_security;
      if (config.repeats > 1) record["repeat"] = r.repeat;
      if (!config.label.empty()) record["setup"] = config.label;
      std::printf("%s\n", record.dump().c_str());
    } else {
      std::printf("%-5s %-4s %-9s %12zu B  %10.3f ms  %8.3f GB/s  cpu %8.3f ms  (%d iterations)\n",
                  std::string(backend).c_str(), r.link_security.c_str(), r.pattern.c_str(), r.bytes,
                  r.seconds * 1e3, rate / 1e9, r.cpu_seconds * 1e3, r.iterations);
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
  app.add_option("--link-security", config.link_securities,
                 "TCP links, one group each, measured side by side: tls (encrypted), hmac "
                 "(plaintext, authenticated), tls-same-host-plaintext (tls with "
                 "PULSELOCO_SAME_HOST_PLAINTEXT=1); default: PULSELOCO_LINK_SECURITY and "
                 "PULSELOCO_SECRET")
      ->delimiter(',')
      ->check(CLI::IsMember({"hmac", "tls", "tls-same-host-plaintext"}));
  app.add_option("--repeats", config.repeats, "rounds per pattern and size")
      ->check(CLI::Range(1, 1000));
  app.add_option("--label", config.label, "a 'setup' field for every record");
  app.add_flag("--json", config.json, "one JSON object per line");
  CLI11_PARSE(app, argc, argv);

  try {
    TransportOptions options = from_environment();
    options.backend = *parse_backend(config.backend);
    if (config.connections > 0) options.tcp.connections_per_peer = config.connections;
    if (!config.link_securities.empty() && options.backend != Backend::tcp)
      throw InvalidArgument("--link-security needs --backend tcp");
    std::vector<std::string> securities = config.link_securities;
    if (securities.empty()) securities.emplace_back();
    const bool separate_processes =
        launched_by_mpi() || !options.master_addr.empty() || !options.peers.empty();
    if (separate_processes) {
      std::vector<Group> groups;
      for (std::size_t g = 0; g < securities.size(); ++g) {
        TransportOptions mine = options;
        apply_link_security(securities[g], mine);
        if (mine.master_port != 0)
          mine.master_port = static_cast<std::uint16_t>(mine.master_port + g);
        groups.push_back({securities[g], make_transport(mine)});
        if (groups.back().transport->size() < 2) throw InvalidArgument("needs at least two ranks");
      }
      const Transport& first = *groups.front().transport;
      if (first.rank() < 2) {
        auto results = measure(groups, config);
        if (first.rank() == 0) print(results, config, first.backend(), "processes");
      }
      return 0;
    }
    if (options.backend != Backend::tcp)
      throw InvalidArgument("without mpirun or a rendezvous only --backend tcp can run here");
    // groups[rank][g]: every rank's transport of every group.
    std::vector<std::vector<Group>> groups(2);
    for (const std::string& security : securities) {
      TransportOptions group_options = options;
      apply_link_security(security, group_options);
      RendezvousServer server("127.0.0.1", 0, 2, group_options.tcp,
                              deadline_after(group_options.connect_timeout));
      std::vector<std::unique_ptr<TcpTransport>> made(2);
      std::vector<std::exception_ptr> errors(2);
      std::vector<std::thread> threads;
      for (int rank = 0; rank < 2; ++rank) {
        threads.emplace_back([&, rank] {
          try {
            TransportOptions mine = group_options;
            mine.rendezvous = RendezvousMethod::environment;
            mine.rank = rank;
            mine.world_size = 2;
            mine.master_addr = "127.0.0.1";
            mine.master_port = server.port();
            mine.external_rendezvous_server = true;
            made[static_cast<std::size_t>(rank)] = make_tcp_transport(mine);
          } catch (...) {
            errors[static_cast<std::size_t>(rank)] = std::current_exception();
          }
        });
      }
      for (auto& thread : threads)
        thread.join();
      for (auto& error : errors)
        if (error) std::rethrow_exception(error);
      for (int rank = 0; rank < 2; ++rank)
        groups[static_cast<std::size_t>(rank)].push_back(
            {security, std::move(made[static_cast<std::size_t>(rank)])});
    }
    std::vector<Result> results;
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(2);
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        try {
          auto measured = measure(groups[static_cast<std::size_t>(rank)], config);
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
