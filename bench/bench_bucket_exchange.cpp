// pulseloco_bench_bucket_exchange: the wall time of a pulse window through a bucket
// (engine/bucket_transport.h) against the same window over TCP on loopback, on the same machine
// in the same process: R ranks are threads, each with its own engine. Rounds alternate which
// transport runs first; each round forms a fresh group of each (a new job id for the bucket),
// runs one untimed window, then --windows timed windows, and reports the median window time of
// each and their ratio. Per rank and window it also reports the bucket's objects written and read
// and bytes moved (the transport's counters). One JSON line per round.
//
// The bucket client reads its settings from the environment (docs/operations.md, "Buckets");
// docs/benchmarks.md, "A group through a bucket", gives the command with a local Swift server.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <pulseloco/base/bf16.h>
#include <pulseloco/engine/bucket_transport.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/options.h>
#include "tests/engine/engine_test_util.h"

namespace {

using namespace pulseloco;
using Clock = std::chrono::steady_clock;

// Runs fn(rank) on one thread per rank; rethrows the lowest rank's exception.
void run_ranks(int world, const std::function<void(int)>& fn) {
  testing::rethrow_first(testing::run_ranks(world, fn));
}

struct Settings {
  std::string address;
  int ranks = 4;
  std::uint64_t parameters = 1'000'000;
  double density = 0.05;
  int windows = 5;
  int rounds = 5;
  int first_port = 29'600;
};

struct Result {
  double median_s = 0;
  double puts_per_rank_window = 0;
  double gets_per_rank_window = 0;
  double misses_per_rank_window = 0;
  double deletes_per_rank_window = 0;
  double bytes_out_per_rank_window = 0;
  double bytes_in_per_rank_window = 0;
};

// One group over `connect(rank)`: an untimed window, then s.windows timed ones.
Result run_group(const Settings& s,
                 const std::function<std::unique_ptr<transport::Transport>(int)>& connect) {
  const int world = s.ranks;
  std::vector<std::vector<float>> weights(static_cast<std::size_t>(world));
  std::vector<std::unique_ptr<Engine>> engines(static_cast<std::size_t>(world));
  EngineOptions options;
  options.exchange = Exchange::allgather;
  options.threads = 1;
  options.timeout = std::chrono::seconds(60);
  run_ranks(world, [&](int r) {
    auto& w = weights[static_cast<std::size_t>(r)];
    std::mt19937 rng(11);
    std::normal_distribution<float> normal(0.0f, 0.02f);
    w.resize(s.parameters);
    for (float& x : w)
      x = round_to_bf16(normal(rng));
    std::vector<NamedTensor> tensors{
        {"w", TensorView{w.data(), w.size(), DType::float32, Device{}}, {}}};
    engines[static_cast<std::size_t>(r)] = std::make_unique<Engine>(tensors, options, connect(r));
  });
  std::vector<double> times;
  std::vector<transport::TransportStats> before(static_cast<std::size_t>(world));
  std::vector<BucketRequests> requests_before(static_cast<std::size_t>(world));
  for (int window = 0; window <= s.windows; ++window) {
    if (window == 1) {
      for (int r = 0; r < world; ++r)
        before[static_cast<std::size_t>(r)] =
            engines[static_cast<std::size_t>(r)]->transport().stats();
      for (int r = 0; r < world; ++r) {
        requests_before[static_cast<std::size_t>(r)] =
            bucket_requests(engines[static_cast<std::size_t>(r)]->transport());
      }
    }
    // Local training: a fraction of the elements moves by about a bf16 step, so the gate fires.
    for (int r = 0; r < world; ++r) {
      std::mt19937 rng(static_cast<std::uint32_t>(1000 * window + r));
      std::bernoulli_distribution moved(s.density);
      for (float& x : weights[static_cast<std::size_t>(r)])
        if (moved(rng)) x = x * 1.02f + 1e-4f;
    }
    const auto start = Clock::now();
    run_ranks(world, [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); });
    if (window > 0) times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  Result result;
  std::sort(times.begin(), times.end());
  result.median_s = times[times.size() / 2];
  const double n = static_cast<double>(world) * s.windows;
  for (int r = 0; r < world; ++r) {
    const auto after = engines[static_cast<std::size_t>(r)]->transport().stats();
    const auto& b = before[static_cast<std::size_t>(r)];
    const BucketRequests requests =
        bucket_requests(engines[static_cast<std::size_t>(r)]->transport());
    const BucketRequests& rb = requests_before[static_cast<std::size_t>(r)];
    result.puts_per_rank_window += static_cast<double>(requests.puts - rb.puts) / n;
    result.gets_per_rank_window += static_cast<double>(requests.gets - rb.gets) / n;
    result.misses_per_rank_window += static_cast<double>(requests.misses - rb.misses) / n;
    result.deletes_per_rank_window += static_cast<double>(requests.deletes - rb.deletes) / n;
    result.bytes_out_per_rank_window +=
        static_cast<double>(after.wire_bytes_sent - b.wire_bytes_sent) / n;
    result.bytes_in_per_rank_window +=
        static_cast<double>(after.wire_bytes_received - b.wire_bytes_received) / n;
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"pulse windows through a bucket against TCP on loopback"};
  app.add_option("--address", s.address, "s3://bucket/prefix for the bucket's groups")->required();
  app.add_option("--ranks", s.ranks, "ranks (threads)")->capture_default_str();
  app.add_option("--parameters", s.parameters, "fp32 parameters")->capture_default_str();
  app.add_option("--density", s.density, "fraction of elements each rank moves")
      ->capture_default_str();
  app.add_option("--windows", s.windows, "timed windows per group")->capture_default_str();
  app.add_option("--rounds", s.rounds, "rounds (each runs both, order alternating)")
      ->capture_default_str();
  app.add_option("--first-port", s.first_port, "TCP rendezvous ports from here")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    for (int round = 0; round < s.rounds; ++round) {
      const auto tcp = [&](int rank) {
        group::TransportOptions options;
        options.rendezvous = group::RendezvousMethod::environment;
        options.rank = rank;
        options.world_size = s.ranks;
        options.master_addr = "127.0.0.1";
        options.master_port = static_cast<std::uint16_t>(s.first_port + round);
        options.run_id = "bench-tcp-" + std::to_string(::getpid()) + "-" + std::to_string(round);
        options.tcp.listen_addr = "127.0.0.1";
        return group::make_transport(options);
      };
      const auto bucket = [&](int rank) {
        BucketGroupOptions options;
        options.address = s.address;
        options.job_id = "bench-" + std::to_string(::getpid()) + "-" + std::to_string(round);
        options.secret = "bench-secret";
        options.rank = rank;
        options.world_size = s.ranks;
        return join_bucket_group(std::move(options));
      };
      Result t, b;
      if (round % 2 == 0) {
        t = run_group(s, tcp);
        b = run_group(s, bucket);
      } else {
        b = run_group(s, bucket);
        t = run_group(s, tcp);
      }
      const nlohmann::json record = {
          {"round", round},
          {"first", round % 2 == 0 ? "tcp" : "bucket"},
          {"ranks", s.ranks},
          {"parameters", s.parameters},
          {"density", s.density},
          {"windows", s.windows},
          {"tcp_window_s", t.median_s},
          {"bucket_window_s", b.median_s},
          {"ratio_bucket_to_tcp", b.median_s / t.median_s},
          {"bucket_puts_per_rank_window", b.puts_per_rank_window},
          {"bucket_gets_per_rank_window", b.gets_per_rank_window},
          {"bucket_polls_without_object_per_rank_window", b.misses_per_rank_window},
          {"bucket_deletes_per_rank_window", b.deletes_per_rank_window},
          {"bucket_bytes_out_per_rank_window", b.bytes_out_per_rank_window},
          {"bucket_bytes_in_per_rank_window", b.bytes_in_per_rank_window},
          {"tcp_bytes_out_per_rank_window", t.bytes_out_per_rank_window}};
      std::printf("%s\n", record.dump().c_str());
      std::fflush(stdout);
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "pulseloco_bench_bucket_exchange: %s\n", error.what());
    return 1;
  }
  return 0;
}
