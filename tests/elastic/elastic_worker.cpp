// A worker of an elastic run for the membership tests (tests/elastic/elastic_test.py): a small
// model whose "inner optimizer" is a deterministic pseudo-random walk (different per worker,
// window and step), synchronised by ElasticEngine through a `pulseloco coordinator`. No libtorch,
// so that many of them start fast.
//
//   pulseloco_elastic_worker --coordinator 127.0.0.1:PORT --worker w0 --windows 8 --json w0.jsonl
//       [--trace-dir DIR] [-H 2] [--timeout-ms 3000] [--overlap delayed]
//       [--ranks-per-worker 2 --local-rank J [--worker-link 127.0.0.1:PORT]]
//
// A worker of several ranks is one process per local rank: local rank 0 (without --worker-link)
// hosts the rendezvous of the worker's link on a free port and writes {"event": "link", "port"}
// first; the harness then starts the other local ranks with --worker-link 127.0.0.1:PORT. Each
// local rank's share of the model is its own tensors (seeded by the local rank).
//
// Writes one JSON line per event to --json (flushed at once): {"event": "attached", ...} when
// admitted, {"event": "window", ...report...} per committed window, {"event": "done", ...} at the
// end. Exit status: 0 done, 3 the run could not continue for this worker (MembershipError), 1 any
// other error. PULSELOCO_FAULT (engine/fault_injection.h) makes it fail on purpose.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/elastic/elastic_engine.h>
#include <pulseloco/engine/report.h>
#include <pulseloco/group/rendezvous_server.h>

namespace {

using namespace pulseloco;

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) from 64 bits.
float uniform(std::uint64_t bits) {
  return static_cast<float>(bits >> 40) / static_cast<float>(1u << 23) - 1.0f;
}

struct Model {
  std::vector<float> dense;         // fp32 tensor
  std::vector<std::uint16_t> half;  // bf16 tensor
  std::vector<float> tiny;          // fp32, odd size

  explicit Model(std::uint64_t seed) : dense(20'000), half(7'001), tiny(33) {
    std::uint64_t state = seed;
    auto weight = [&] { return round_to_bf16(0.05f * uniform(state = splitmix64(state))); };
    for (float& w : dense)
      w = weight();
    for (std::uint16_t& w : half)
      w = float_to_bf16_bits(weight());
    for (float& w : tiny)
      w = weight();
  }

  std::vector<NamedTensor> views() {
    return {
        {"dense", TensorView{dense.data(), dense.size(), DType::float32, Device{}}, {100, 200}},
        {"half", TensorView{half.data(), half.size(), DType::bfloat16, Device{}}, {}},
        {"tiny", TensorView{tiny.data(), tiny.size(), DType::float32, Device{}}, {}},
    };
  }

  // One inner step: every weight moves by lr * u, u ~ U(-1, 1) + a small drift, drawn from
  // (worker, window, step, index), so retrying a window sees the same local weights.
  void step(std::uint64_t worker_seed, std::uint64_t window, std::uint64_t step, float lr) {
    const std::uint64_t stream = splitmix64(worker_seed ^ splitmix64(window * 1000 + step));
    auto delta = [&](std::uint64_t i) { return lr * (uniform(splitmix64(stream ^ i)) + 0.2f); };
    std::uint64_t i = 0;
    for (float& w : dense)
      w += delta(i++);
    for (std::uint16_t& w : half)
      w = float_to_bf16_bits(bf16_bits_to_float(w) + 40.0f * delta(i++));
    for (float& w : tiny)
      w += delta(i++);
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pulseloco elastic-membership test worker"};
  std::string coordinator;
  std::string worker;
  std::string json_path;
  std::string trace_dir;
  std::uint64_t windows = 8;
  std::uint32_t steps = 2;
  int timeout_ms = 3000;
  int connect_timeout_ms = 15000;
  float lr = 2e-4f;
  std::string mode = "pulse";
  std::string overlap = "blocking";
  std::uint64_t hold_at_window = 0;
  std::string hold_file;
  int ranks_per_worker = 1;
  int local_rank = 0;
  std::string worker_link;
  app.add_option("--coordinator", coordinator, "host:port of the coordinator")->required();
  app.add_option("--worker", worker, "this worker's id")->required();
  app.add_option("--json", json_path, "JSON lines of events")->required();
  app.add_option("--windows", windows, "run until this many windows have committed");
  app.add_option("-H", steps, "inner steps per window");
  app.add_option("--timeout-ms", timeout_ms, "every collective's timeout");
  app.add_option("--connect-timeout-ms", connect_timeout_ms,
                 "forming a generation's mesh, and each request to the coordinator");
  app.add_option("--trace-dir", trace_dir, "write window traces here");
  app.add_option("--lr", lr, "inner step size");
  app.add_option("--mode", mode, "pulse or diloco");
  app.add_option("--overlap", overlap, "blocking, delayed or eager (mode pulse)");
  app.add_option("--hold-at-window", hold_at_window,
                 "before window N's inner steps, wait until --hold-file exists (a test harness "
                 "event: e.g. another worker has registered)");
  app.add_option("--hold-file", hold_file, "see --hold-at-window");
  app.add_option("--ranks-per-worker", ranks_per_worker, "ranks of this worker (processes)");
  app.add_option("--local-rank", local_rank, "this process's local rank in its worker");
  app.add_option("--worker-link", worker_link,
                 "host:port of the worker's link rendezvous (local ranks 1..; local rank 0 "
                 "hosts it and writes the port)");
  CLI11_PARSE(app, argc, argv);

  std::ofstream json(json_path, std::ios::app);
  auto emit = [&](nlohmann::json record) {
    record["worker"] = worker;
    if (ranks_per_worker > 1) record["local_rank"] = local_rank;
    json << record.dump() << '\n';
    json.flush();
  };
  try {
    EngineOptions options;
    options.mode = parse_mode(mode);
    options.overlap = parse_overlap(overlap);
    options.steps_per_window = steps;
    options.chunk_elements = 4096;
    options.bucket_elements = 8192;
    options.threads = 1;
    options.timeout = std::chrono::milliseconds(timeout_ms);
    options.trace_dir = trace_dir;

    ElasticOptions elastic;
    elastic.coordinator = coordinator;
    elastic.worker_id = worker;
    elastic.transport.tcp.listen_addr = "127.0.0.1";
    elastic.transport.tcp.connections_per_peer = 1;
    elastic.transport.connect_timeout = std::chrono::milliseconds(connect_timeout_ms);
    elastic.transport = group::from_environment(elastic.transport);  // PULSELOCO_SECRET
    elastic.on_registered = [&] { emit({{"event", "registered"}}); };
    elastic.ranks_per_worker = ranks_per_worker;
    elastic.local_rank = local_rank;
    std::unique_ptr<group::RendezvousServer> link_server;
    if (ranks_per_worker > 1) {
      elastic.transport.external_rendezvous_server = true;
      if (worker_link.empty()) {
        link_server = std::make_unique<group::RendezvousServer>(
            "127.0.0.1", 0, ranks_per_worker, elastic.transport.tcp,
            transport::deadline_after(elastic.transport.connect_timeout * 4),
            elastic.transport.run_id);
        worker_link = fmt::format("127.0.0.1:{}", link_server->port());
        emit({{"event", "link"}, {"port", link_server->port()}});
      }
      elastic.worker_link = worker_link;
    }

    // Every worker starts alike (rank 0's weights win anyway); each local rank has its share.
    Model model(42 + static_cast<std::uint64_t>(local_rank));
    ElasticEngine sync(model.views(), options, elastic);
    emit({{"event", "attached"},
          {"generation", sync.group().generation},
          {"rank", sync.group().rank},
          {"world_size", sync.group().size()},
          {"window", sync.engine().committed_windows()}});
    const std::uint64_t worker_seed =
        std::hash<std::string>{}(worker) ^ static_cast<std::uint64_t>(local_rank);
    std::uint64_t step_in_window = 0;
    bool held = false;
    while (sync.engine().committed_windows() < windows) {
      if (!hold_file.empty() && !held && sync.engine().committed_windows() == hold_at_window &&
          step_in_window == 0) {
        held = true;
        // Bounded: the harness creates the file within seconds, or has failed anyway.
        for (int i = 0; i < 1200 && !std::filesystem::exists(hold_file); ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        if (!std::filesystem::exists(hold_file))
          throw TimeoutError("--hold-file " + hold_file + " did not appear within 60 s");
      }
      model.step(worker_seed, sync.engine().committed_windows(), step_in_window++, lr);
      if (auto report = sync.after_optimizer_step()) {
        nlohmann::json record = to_json(*report);
        record["event"] = "window";
        emit(record);
        step_in_window = 0;
      }
    }
    emit({{"event", "done"},
          {"window", sync.engine().committed_windows()},
          {"digest", digest_hex(sync.engine().state_digest())},
          {"groups_joined", sync.groups_joined()}});
    sync.leave();
    return 0;
  } catch (const MembershipError& e) {
    emit({{"event", "stopped"}, {"error", e.what()}});
    std::cerr << "pulseloco_elastic_worker " << worker << ": " << e.what() << '\n';
    return 3;
  } catch (const std::exception& e) {
    emit({{"event", "failed"}, {"error", e.what()}});
    std::cerr << "pulseloco_elastic_worker " << worker << ": " << e.what() << '\n';
    return 1;
  }
}
