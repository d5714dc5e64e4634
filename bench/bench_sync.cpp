// pulseloco_bench_sync: one synchronisation window of each mode (pulse, diloco, ddp) with the
// real engine (src/engine) on the same synthetic state, end to end over the real TCP transport:
// wall time per window, the engine's phase times, bytes on the wire (the transport's counters),
// goodput against the link rate and the bandwidth bound (the bytes each rank must receive /
// the link rate). docs/benchmarks.md, "End-to-end sync"; scripts/bench_sync_netns runs it with
// 4 ranks in network namespaces on tbf-shaped links.
//
// Every rank is a plain process joined by the environment rendezvous (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT; each window forms a new group on MASTER_PORT + k). For every
// (rate, mode) the engine is built (rank 0's weights are broadcast) with the links unshaped,
// each rank prepares its local model, then rank 0 runs `--shape-hook RATE` (e.g. a script that
// sets tbf on every veth), all ranks pass a barrier, and the window runs and is timed; the hook
// is then run with "off". Without a hook the links are what they are (loopback).
//
// The synthetic state: P fp32 parameters in tensors of --tensor-elements, weights N(0, 0.02^2)
// on the bf16 grid (a bf16 checkpoint), identical on every rank. Each rank moves its local
// weights as H inner steps would: a fraction (each of --densities) of the elements (chosen
// independently per rank) by 0.6 to 2 bf16 steps, so that their bf16 value changes and the gate
// fires, and every other element by less than 0.2 of a step, which the gate keeps in the residual.
// --shared makes that fraction of each rank's moved elements the same on every rank (drawn from a
// rank-independent stream), the rest independent per rank: the ranks' sets then overlap as much
// as the bf16 gate makes real workers' sets overlap (docs/algorithm.md, "Exchange kinds"), and
// --exchanges runs pulse once per exchange kind.
//
// Nodes (docs/operations.md, "Nodes"): a rank's node is PULSELOCO_NODE, else its host name, as the
// engine names it. --topologies flat,nodes runs pulse once with flat exchanges and once
// node-aware (EngineOptions::node_aware). Every record says how many nodes the group spans and,
// from a transport decorator (node_inbound_transport.h) that counts the bytes each rank receives
// from other nodes during the timed window, the busiest node's inbound bytes beside what the
// all-gather must bring into that node: each remote rank's message once. (The flat all-gather
// brings each remote message into a node once per rank there with the direct algorithm; the
// ring over nodes of consecutive ranks already brings it in about once: --allgather picks.) The
// bench exits 1 when a window's replicas differ or two pulse runs of one density end in different
// states. ddp's window is --ddp-steps all-reduces of a dense fp32 gradient of the same size (what
// DDP moves per inner step), followed by the engine's window bookkeeping (digest check).
//
// State on a GPU (--state-location device, in builds with CUDA): each rank's weights (and ddp's
// gradients) are copied to the GPU before the engine is built and again once moved, so the
// engine keeps θ_g, m and e there and runs the window's steps on the device; the phase times
// then include the fired entries' and the received entries' crossings of PCIe.
//
// Overlapped windows (--compute-ratios, --overlaps; docs/benchmarks.md, "Overlapped windows"):
// mode pulse with a stand-in for the inner steps, several windows in a row per run
// (run_sequence): the inner steps spin on the calling thread for a set time, and the window's
// time is compute plus the boundary. At each rate a blocking run without compute measures the
// exchange time first; the compute time of the runs is then each ratio times it.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/cli/flag_checks.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/node_layout.h>
#include <pulseloco/engine/report.h>
#include <pulseloco/group/make_transport.h>
#include "bench_random.h"
#include "node_inbound_transport.h"
#if PULSELOCO_BENCH_SYNC_CUDA
#include "bench_cuda_util.h"
#endif

namespace {

using namespace pulseloco;
using Clock = std::chrono::steady_clock;

struct Settings {
  double parameters = 1e8;
  std::uint64_t tensor_elements = std::uint64_t{1} << 24;
  std::vector<double> densities = {0.05};  // pulse runs once per density
  double shared = 0;  // fraction of each rank's moved elements every rank moves
  std::vector<std::string> exchanges = {"allgather"};  // pulse runs once per kind
  std::vector<std::string> topologies = {"nodes"};     // pulse runs once per topology
  std::string allgather = "auto";                      // EngineOptions::allgather
  std::vector<std::string> modes = {"pulse", "diloco", "ddp"};
  std::vector<std::string> rates = {"none"};
  std::uint32_t ddp_steps = 2;
  std::string shape_hook;
  unsigned threads = 1;
  std::uint64_t pipeline_chunk_bytes = EngineOptions{}.pipeline_chunk_bytes;
  int timeout_s = 1800;
  std::uint64_t seed = 1;
  bool json = false;
  std::string label;
  std::string state_location = "host";  // or "device": the weights on CUDA device 0
  // Overlapped windows (run_overlap_measurements): on when compute_ratios is not empty.
  std::vector<double> compute_ratios;
  std::vector<std::string> overlaps = {"blocking", "delayed", "eager"};
  std::uint32_t steps_per_window = 8;
  std::uint32_t windows = 4;
  int repeats = 1;
};

// "100mbit" -> 100, "1gbit" -> 1000, "none" -> 0 (no shaping, no bound).
double rate_mbit(const std::string& rate) {
  if (rate == "none") return 0;
  std::size_t end = 0;
  const double value = std::stod(rate, &end);
  const std::string unit = rate.substr(end);
  if (unit == "kbit") return value / 1000;
  if (unit == "mbit") return value;
  if (unit == "gbit") return value * 1000;
  throw InvalidArgument("rate '" + rate + "': use a number with kbit, mbit or gbit, or none");
}

struct Model {
  std::vector<std::vector<float>> local;
  std::vector<std::vector<float>> gradients;  // ddp only
  std::uint64_t parameters = 0;

  std::vector<NamedTensor> named() {
    std::vector<NamedTensor> tensors;
    for (std::size_t t = 0; t < local.size(); ++t) {
      tensors.push_back({fmt::format("block.{}.weight", t),
                         TensorView{local[t].data(), local[t].size(), DType::float32, Device{}},
                         {}});
    }
    return tensors;
  }
};

// With --state-location device: the model's tensors copied to CUDA device 0, where the engine
// then keeps its state. Without CUDA in the build, uploading says so.
class DeviceCopies {
 public:
  // Device views of `host`, each tensor copied there.
  std::vector<TensorView> upload(const std::vector<std::vector<float>>& host) {
#if PULSELOCO_BENCH_SYNC_CUDA
    std::vector<TensorView> views;
    for (const std::vector<float>& tensor : host) {
      buffers_.push_back(std::make_unique<bench::DeviceBuffer>(tensor.size() * sizeof(float)));
      views.push_back(
          {buffers_.back()->data, tensor.size(), DType::float32, Device{DeviceKind::cuda, 0}});
    }
    copy(host, views);
    return views;
#else
    (void)host;
    throw InvalidArgument("--state-location device: this build of pulseloco has no CUDA");
#endif
  }

  // The host tensors' content into their device copies.
  static void copy(const std::vector<std::vector<float>>& host,
                   const std::vector<TensorView>& device) {
#if PULSELOCO_BENCH_SYNC_CUDA
    for (std::size_t t = 0; t < host.size(); ++t) {
      bench::check(cudaMemcpy(device[t].data, host[t].data(), host[t].size() * sizeof(float),
                              cudaMemcpyHostToDevice),
                   "cudaMemcpy (weights to the device)");
    }
#else
    (void)host;
    (void)device;
#endif
  }

 private:
#if PULSELOCO_BENCH_SYNC_CUDA
  std::vector<std::unique_ptr<bench::DeviceBuffer>> buffers_;
#endif
};

// Rank-independent initial weights: N(0, 0.02^2) rounded to bf16 (never exactly zero).
Model make_model(const Settings& s, ThreadPool& pool) {
  Model model;
  const auto total = static_cast<std::uint64_t>(s.parameters);
  for (std::uint64_t begin = 0; begin < total; begin += s.tensor_elements) {
    model.local.emplace_back(std::min(s.tensor_elements, total - begin));
  }
  model.parameters = total;
  pool.parallel_for(model.local.size(), [&](std::size_t t) {
    const bench::StreamKeys keys = bench::stream_keys(s.seed, t, 1);
    std::vector<float>& w = model.local[t];
    for (std::size_t i = 0; i < w.size(); ++i) {
      const float value =
          round_to_bf16(0.02f * bench::stream_normal(keys, static_cast<std::uint32_t>(i)));
      w[i] = value != 0.0f ? value : 0.005f;
    }
  });
  return model;
}

// The spacing of bf16 values at |x| (x finite, non-zero, normal).
float bf16_step(float x) {
  // 2^(e - 7) for x = 1.m * 2^e: the exponent field less 7 (frexp/ldexp below 2^-119).
  const std::uint32_t exponent_bits = std::bit_cast<std::uint32_t>(x) & 0x7f800000U;
  if (exponent_bits > (8U << 23)) return std::bit_cast<float>(exponent_bits - (7U << 23));
  int exponent = 0;
  (void)std::frexp(std::fabs(x), &exponent);  // |x| = f * 2^exponent, f in [0.5, 1)
  return std::ldexp(1.0f, exponent - 8);
}

// Element i's move in bf16 steps of its value, signed (see the file comment): 0.6 to 2 steps for
// the fraction of elements below `threshold` (of 2^32), less than 0.2 otherwise.
// The element moves far when its rank-independent draw is below `shared_threshold` (every rank
// moves it) or its own draw is below `own_threshold`.
struct MoveThresholds {
  std::uint32_t own = 0;
  std::uint32_t shared = 0;
};

float move_in_steps(const bench::StreamKeys& keys, const bench::StreamKeys& shared_keys,
                    std::uint32_t i, MoveThresholds threshold) {
  const std::uint32_t bits = bench::stream_bits(keys, i);
  const std::uint32_t more = bench::mix32(bits ^ 0x5bd1e995U);
  const float u = static_cast<float>(more >> 8) / 16777216.0f;  // [0, 1)
  const float sign = (more & 1U) != 0 ? 1.0f : -1.0f;
  const bool far = bits < threshold.own ||
                   (threshold.shared > 0 && bench::stream_bits(shared_keys, i) < threshold.shared);
  return sign * (far ? 0.6f + 1.4f * u : 0.2f * u);
}

// A fraction `shared` of the density drawn once for every rank, the rest per rank.
MoveThresholds density_thresholds(double density, double shared) {
  return {static_cast<std::uint32_t>(density * (1 - shared) * 4294967295.0),
          static_cast<std::uint32_t>(density * shared * 4294967295.0)};
}

// This rank's local weights after "H inner steps" (see the file comment).
void move_locally(Model& model, const Settings& s, double density, int rank, ThreadPool& pool) {
  pool.parallel_for(model.local.size(), [&](std::size_t t) {
    const bench::StreamKeys keys =
        bench::stream_keys(s.seed, t, 2, 0, static_cast<std::uint64_t>(rank) + 1);
    const bench::StreamKeys shared_keys = bench::stream_keys(s.seed, t, 4);
    const MoveThresholds thresholds = density_thresholds(density, s.shared);
    std::vector<float>& w = model.local[t];
    for (std::size_t i = 0; i < w.size(); ++i) {
      const float steps =
          move_in_steps(keys, shared_keys, static_cast<std::uint32_t>(i), thresholds);
      w[i] = w[i] - steps * bf16_step(w[i]);
    }
  });
}

// run_sequence's moves: this rank's move_in_steps of every element, drawn once, so that a
// window's moves cost the inner steps' stand-in one pass over the weights.
std::vector<std::vector<float>> draw_moves(const Model& model, const Settings& s, double density,
                                           int rank, ThreadPool& pool) {
  std::vector<std::vector<float>> moves(model.local.size());
  pool.parallel_for(model.local.size(), [&](std::size_t t) {
    const bench::StreamKeys keys =
        bench::stream_keys(s.seed, t, 2, 0, static_cast<std::uint64_t>(rank) + 1);
    const bench::StreamKeys shared_keys = bench::stream_keys(s.seed, t, 4);
    const MoveThresholds thresholds = density_thresholds(density, s.shared);
    moves[t].resize(model.local[t].size());
    for (std::size_t i = 0; i < moves[t].size(); ++i)
      moves[t][i] = move_in_steps(keys, shared_keys, static_cast<std::uint32_t>(i), thresholds);
  });
  return moves;
}

// Window `window`'s moves: the drawn ones rotated by an offset that depends on the window, so that
// other elements fire in each window (at the same density) and the small moves of the others
// add up in the residual as a random walk, as they would over many inner steps.
void apply_moves(Model& model, const std::vector<std::vector<float>>& moves, std::uint64_t window,
                 ThreadPool& pool) {
  pool.parallel_for(model.local.size(), [&](std::size_t t) {
    std::vector<float>& w = model.local[t];
    const std::size_t n = w.size();
    const std::size_t offset = (window * 0x9E3779B97F4A7C15ULL >> 17) % n;
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t j = i + offset < n ? i + offset : i + offset - n;
      w[i] = w[i] - moves[t][j] * bf16_step(w[i]);
    }
  });
}

void fill_gradients(Model& model, const Settings& s, int rank, ThreadPool& pool) {
  model.gradients.resize(model.local.size());
  pool.parallel_for(model.local.size(), [&](std::size_t t) {
    const bench::StreamKeys keys =
        bench::stream_keys(s.seed, t, 3, 0, static_cast<std::uint64_t>(rank) + 1);
    std::vector<float>& g = model.gradients[t];
    g.resize(model.local[t].size());
    for (std::size_t i = 0; i < g.size(); ++i)
      g[i] = 1e-3f * bench::stream_normal(keys, static_cast<std::uint32_t>(i));
  });
}

collectives::CollectiveOptions control_options(const Settings& s) {
  collectives::CollectiveOptions options;
  options.timeout = std::chrono::seconds(s.timeout_s);
  options.tag = 101;  // the engine uses its own base tag
  return options;
}

void run_hook(const Settings& s, const std::string& argument) {
  if (s.shape_hook.empty()) return;
  const std::string command = s.shape_hook + " " + argument;
  const int status = std::system(command.c_str());
  if (status != 0) throw IoError(fmt::format("shape hook failed ({}): {}", status, command));
}

double ns_to_s(std::uint64_t ns) {
  return static_cast<double>(ns) / 1e9;
}

std::uint64_t s_to_ns(double seconds) {
  return static_cast<std::uint64_t>(std::llround(seconds * 1e9));
}

// The group of one run (on `port`), its links unshaped: the state is built over them.
std::unique_ptr<transport::Transport> connect_unshaped(const Settings& s, std::uint16_t port) {
  group::TransportOptions topt = group::from_environment();
  topt.master_port = port;
  topt.connect_timeout = std::chrono::seconds(s.timeout_s);
  auto transport = group::make_transport(topt);
  if (transport->rank() == 0) run_hook(s, "off");
  collectives::barrier(*transport, control_options(s));
  return transport;
}

// Every rank's node, as the engine names it (engine_detail::node_name: PULSELOCO_NODE, else the
// host name), agreed with one all-gather of the names' digests: node_of_rank[r] is the lowest
// rank on rank r's node.
std::vector<int> agree_on_node_ids(transport::Transport& transport, const Settings& s) {
  const std::string name = engine_detail::node_name("");
  const Digest mine = digest_bytes(std::as_bytes(std::span(name.data(), name.size())));
  const std::vector<std::uint64_t> all =
      collectives::allgather_u64(transport, mine, control_options(s));
  std::map<std::uint64_t, int> first_rank;
  std::vector<int> node_of_rank;
  for (std::size_t r = 0; r < all.size(); ++r)
    node_of_rank.push_back(first_rank.try_emplace(all[r], static_cast<int>(r)).first->second);
  return node_of_rank;
}

// One window of `mode` at `rate` (node-aware exchanges or not); rank 0 returns the record.
nlohmann::json run_one(const Settings& s, const std::string& rate, const std::string& mode,
                       double density, const std::string& exchange, bool node_aware,
                       std::uint16_t port, ThreadPool& pool) {
  auto unshaped = connect_unshaped(s, port);
  const int rank = unshaped->rank();
  const int world = unshaped->size();
  const std::vector<int> node_of_rank = agree_on_node_ids(*unshaped, s);
  auto transport = std::make_unique<bench::NodeInboundTransport>(std::move(unshaped), node_of_rank);
  bench::NodeInboundTransport& counted = *transport;  // owned by the engine below

  Model model = make_model(s, pool);
  EngineOptions options;
  options.mode = parse_mode(mode);
  options.steps_per_window = mode == "ddp" ? s.ddp_steps : 1;
  options.threads = s.threads;
  options.pipeline_chunk_bytes = s.pipeline_chunk_bytes;
  options.timeout = std::chrono::seconds(s.timeout_s);
  options.exchange = parse_exchange(exchange);
  options.node_aware = node_aware;
  options.allgather = parse_allgather(s.allgather);
  std::vector<NamedTensor> tensors = model.named();
  DeviceCopies device;
  std::vector<TensorView> device_locals;
  const bool on_device = s.state_location == "device";
  if (on_device) {
    options.state_location = StateLocation::device;
    device_locals = device.upload(model.local);
    for (std::size_t t = 0; t < tensors.size(); ++t)
      tensors[t].view = device_locals[t];
  }
  Engine engine(std::move(tensors), options, std::move(transport));
  if (mode == "ddp") {
    fill_gradients(model, s, rank, pool);
  } else {
    move_locally(model, s, density, rank, pool);
    if (on_device) DeviceCopies::copy(model.local, device_locals);
  }
  std::vector<TensorView> gradient_views;
  for (auto& g : model.gradients)
    gradient_views.push_back({g.data(), g.size(), DType::float32, Device{}});
  if (on_device && !model.gradients.empty()) gradient_views = device.upload(model.gradients);

  collectives::barrier(engine.transport(), control_options(s));
  if (rank == 0) run_hook(s, rate);
  collectives::barrier(engine.transport(), control_options(s));
  counted.reset();

  const auto start = Clock::now();
  WindowReport report;
  if (mode == "ddp") {
    std::optional<WindowReport> last;
    for (std::uint32_t h = 0; h < s.ddp_steps; ++h) {
      engine.average_gradients(gradient_views);
      last = engine.after_optimizer_step();
    }
    report = *last;
  } else {
    report = engine.run_window();
  }
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  const std::uint64_t inbound = counted.inbound_bytes();  // before the gathers below

  // Every rank's numbers, gathered on every rank (rank 0 prints them).
  const std::vector<std::uint64_t> mine = {s_to_ns(wall),
                                           s_to_ns(report.seconds.gate),
                                           s_to_ns(report.seconds.exchange),
                                           s_to_ns(report.seconds.apply),
                                           s_to_ns(report.seconds.verify),
                                           report.entries_sent,
                                           report.payload_bytes,
                                           report.received_bytes,
                                           report.wire_bytes_sent,
                                           report.wire_bytes_received,
                                           inbound,
                                           report.digest,
                                           report.replicas_identical ? 1U : 0U};
  std::vector<std::vector<std::uint64_t>> all(mine.size());
  for (std::size_t f = 0; f < mine.size(); ++f)
    all[f] = collectives::allgather_u64(engine.transport(), mine[f], control_options(s));
  if (rank == 0) run_hook(s, "off");
  if (rank != 0) return {};

  const auto max_of = [](const std::vector<std::uint64_t>& v) {
    return *std::max_element(v.begin(), v.end());
  };
  const auto min_of = [](const std::vector<std::uint64_t>& v) {
    return *std::min_element(v.begin(), v.end());
  };
  const auto sum_of = [](const std::vector<std::uint64_t>& v) {
    std::uint64_t total = 0;
    for (std::uint64_t x : v)
      total += x;
    return total;
  };
  const double mbit = rate_mbit(rate);
  const double p = static_cast<double>(model.parameters);
  const double ring_bytes = 2.0 * (world - 1) / world * 4.0 * p;  // ring all-reduce, per rank
  double bound_bytes = 0;
  if (mode == "pulse") {
    bound_bytes = static_cast<double>(max_of(all[7]));  // the largest sum of others' messages
  } else if (mode == "diloco") {
    bound_bytes = ring_bytes;
  } else {
    bound_bytes = s.ddp_steps * ring_bytes;
  }
  // Per node (in order of their lowest rank): the bytes its ranks received from other nodes,
  // and what the all-gather must bring in, each remote rank's message once.
  std::map<int, std::pair<std::uint64_t, std::uint64_t>> per_node;  // inbound, expected
  for (int r = 0; r < world; ++r) {
    const auto i = static_cast<std::size_t>(r);
    per_node[node_of_rank[i]].first += all[10][i];
  }
  for (auto& [node, bytes] : per_node) {
    for (std::size_t q = 0; q < node_of_rank.size(); ++q) {
      if (node_of_rank[q] != node) bytes.second += all[6][q];
    }
  }
  std::vector<std::uint64_t> node_inbound, node_expected;
  for (const auto& [node, bytes] : per_node) {
    node_inbound.push_back(bytes.first);
    node_expected.push_back(bytes.second);
  }
  const auto busiest = static_cast<std::size_t>(
      std::max_element(node_inbound.begin(), node_inbound.end()) - node_inbound.begin());
  bool replicas_identical = true;
  for (int r = 0; r < world; ++r) {
    const auto i = static_cast<std::size_t>(r);
    replicas_identical = replicas_identical && all[12][i] == 1 && all[11][i] == all[11][0];
  }
  const double window_s = ns_to_s(max_of(all[0]));
  // A rank's exchange phase starts when its own gate is done, so it includes waiting for slower
  // ranks (4 ranks share 2 cores here, and their compute phases drift apart). The rank that
  // entered last waited for nobody: its exchange time is the collective's own duration.
  const double exchange_s = ns_to_s(min_of(all[2]));
  nlohmann::json j = {
      {"benchmark", "sync"},
      {"mode", mode},
      {"rate", rate},
      {"link_mbit", mbit},
      {"ranks", world},
      {"parameters", model.parameters},
      {"H", options.steps_per_window},
      {"target_density", density},
      {"shared", s.shared},
      {"exchange", report.exchange},
      {"topology", node_aware ? "nodes" : "flat"},
      {"node_aware", node_aware},
      {"allgather_algorithm", s.allgather},
      {"nodes", per_node.size()},
      {"union_ratio", report.union_ratio},
      {"density", mode == "pulse" ? static_cast<double>(sum_of(all[5])) / world / p : 1.0},
      {"threads_per_rank", s.threads},
      {"state_location", report.state_location},
      {"pipeline_chunk_bytes", s.pipeline_chunk_bytes},
      {"window_seconds", window_s},
      {"phase_seconds_max",
       {{"gate", ns_to_s(max_of(all[1]))},
        {"exchange", ns_to_s(max_of(all[2]))},
        {"apply", ns_to_s(max_of(all[3]))},
        {"verify", ns_to_s(max_of(all[4]))}}},
      {"phase_seconds_min",
       {{"gate", ns_to_s(min_of(all[1]))},
        {"exchange", exchange_s},
        {"apply", ns_to_s(min_of(all[3]))},
        {"verify", ns_to_s(min_of(all[4]))}}},
      {"exchange_seconds", exchange_s},
      {"payload_bytes_max", max_of(all[6])},
      {"payload_bytes_mean", static_cast<double>(sum_of(all[6])) / world},
      {"received_bytes_max", max_of(all[7])},
      {"wire_bytes_sent_max", max_of(all[8])},
      {"wire_bytes_received_max", max_of(all[9])},
      {"bound_bytes", bound_bytes},
      {"node_inbound_bytes_max", node_inbound[busiest]},
      {"digest", digest_hex(all[11][0])},
      {"replicas_identical", replicas_identical},
      {"per_rank",
       {{"window_seconds", all[0]},
        {"exchange_ns", all[2]},
        {"payload_bytes", all[6]},
        {"wire_bytes_received", all[9]},
        {"node", node_of_rank},
        {"node_inbound_bytes", all[10]}}},
      {"per_node", {{"inbound_bytes", node_inbound}}},
  };
  if (mbit > 0) {
    const double bound_s = bound_bytes * 8 / (mbit * 1e6);
    j["bound_seconds"] = bound_s;
    j["ratio_window_to_bound"] = window_s / bound_s;
    j["ratio_exchange_to_bound"] = exchange_s / bound_s;
    // The bytes the busiest rank took off the wire, over the collective's duration.
    const double goodput = static_cast<double>(max_of(all[9])) * 8 / exchange_s / 1e6;
    j["goodput_mbit"] = goodput;
    j["goodput_of_link"] = goodput / mbit;
  }
  if (mode == "pulse") {
    // What the all-gather must bring into each node (each remote message once; the reduction's
    // due is other), beside what came in.
    j["node_inbound_expected_allgather"] = node_expected[busiest];
    j["node_inbound_ratio"] = node_expected[busiest] > 0
                                  ? static_cast<double>(node_inbound[busiest]) /
                                        static_cast<double>(node_expected[busiest])
                                  : 0.0;
    j["per_node"]["expected_allgather"] = node_expected;
    // A node's ranks share its link: that due into the busiest node at the rate.
    if (mbit > 0)
      j["node_bound_seconds"] = static_cast<double>(node_expected[busiest]) * 8 / (mbit * 1e6);
  }
  if (!s.label.empty()) j["setup"] = s.label;
  return j;
}

// The stand-in for an inner step's accelerator work: the calling thread spins on the clock until
// `deadline` (it never sleeps, so it holds a core as a host thread polling its device does).
void busy_until(Clock::time_point deadline) {
  while (Clock::now() < deadline) {
  }
}

// Overlapped windows (--compute-ratios): windows 0..W of H inner steps each, run as a training
// loop runs them. Every inner step spins until its share of `compute_s` since the window began
// has passed (the first step also moves the local weights, apply_moves, inside that time), then
// calls after_optimizer_step(); the H-th call is the boundary. Window 0 is not timed (with
// overlap nothing is in flight at its boundary); window k's time runs from the end of boundary
// k-1 to the end of boundary k. The window left in flight is completed (untimed) at the end.
struct SequenceResult {
  nlohmann::json record;  // the same on every rank (built from the all-gathered figures)
  int rank = 0;
};

SequenceResult run_sequence(const Settings& s, const std::string& rate, Overlap overlap,
                            double compute_s, double density, std::uint16_t port,
                            ThreadPool& pool) {
  auto transport = connect_unshaped(s, port);
  const int rank = transport->rank();
  const int world = transport->size();

  Model model = make_model(s, pool);
  EngineOptions options;
  options.mode = Mode::pulse;
  options.overlap = overlap;
  options.steps_per_window = s.steps_per_window;
  options.threads = s.threads;
  options.pipeline_chunk_bytes = s.pipeline_chunk_bytes;
  options.timeout = std::chrono::seconds(s.timeout_s);
  Engine engine(model.named(), options, std::move(transport));
  const std::vector<std::vector<float>> moves = draw_moves(model, s, density, rank, pool);
  collectives::barrier(engine.transport(), control_options(s));
  if (rank == 0) run_hook(s, rate);
  collectives::barrier(engine.transport(), control_options(s));

  const auto per_step = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(compute_s / s.steps_per_window));
  // Sums over the timed windows: wall, compute, the boundary's phases, entries.
  std::uint64_t wall_ns = 0, compute_ns = 0, entries = 0;
  PhaseSeconds phases;
  auto window_start = Clock::now();
  for (std::uint32_t w = 0; w <= s.windows; ++w) {
    apply_moves(model, moves, w, pool);
    std::optional<WindowReport> report;
    Clock::time_point compute_end;
    for (std::uint32_t h = 0; h < s.steps_per_window; ++h) {
      busy_until(window_start + per_step * (h + 1));
      compute_end = Clock::now();
      report = engine.after_optimizer_step();
    }
    const auto end = Clock::now();
    if (!report) throw InvalidArgument("internal: no window after H steps");
    if (w > 0) {
      wall_ns += static_cast<std::uint64_t>((end - window_start).count());
      compute_ns += static_cast<std::uint64_t>((compute_end - window_start).count());
      entries += report->entries_sent;
      phases.gate += report->seconds.gate;
      phases.exchange += report->seconds.exchange;
      phases.exchange_in_flight += report->seconds.exchange_in_flight;
      phases.apply += report->seconds.apply;
      phases.verify += report->seconds.verify;
    }
    window_start = end;
  }
  (void)engine.complete_in_flight();

  const std::vector<std::uint64_t> mine = {wall_ns,
                                           compute_ns,
                                           s_to_ns(phases.gate),
                                           s_to_ns(phases.exchange),
                                           s_to_ns(phases.exchange_in_flight),
                                           s_to_ns(phases.apply),
                                           s_to_ns(phases.verify),
                                           entries};
  std::vector<std::vector<std::uint64_t>> all(mine.size());
  for (std::size_t f = 0; f < mine.size(); ++f)
    all[f] = collectives::allgather_u64(engine.transport(), mine[f], control_options(s));
  if (rank == 0) run_hook(s, "off");

  // Means per window: the slowest rank's (the group's pace), and for the exchange also the
  // fastest rank's wait (the rank that came last waited for nobody; see run_one).
  const double windows = s.windows;
  const auto mean_max = [&](std::size_t f) {
    return ns_to_s(*std::max_element(all[f].begin(), all[f].end())) / windows;
  };
  const auto mean_min = [&](std::size_t f) {
    return ns_to_s(*std::min_element(all[f].begin(), all[f].end())) / windows;
  };
  std::uint64_t all_entries = 0;
  for (std::uint64_t e : all[7])
    all_entries += e;
  nlohmann::json j = {
      {"benchmark", "sync-overlap"},
      {"overlap", overlap_name(overlap)},
      {"rate", rate},
      {"link_mbit", rate_mbit(rate)},
      {"ranks", world},
      {"parameters", engine.parameter_count()},
      {"H", s.steps_per_window},
      {"windows", s.windows},
      {"target_density", density},
      {"shared", s.shared},
      {"density", static_cast<double>(all_entries) / world / windows /
                      static_cast<double>(engine.parameter_count())},
      {"threads_per_rank", s.threads},
      {"compute_set_seconds", compute_s},
      {"compute_seconds", mean_max(1)},
      {"window_seconds", mean_max(0)},
      {"phase_seconds_max",
       {{"gate", mean_max(2)},
        {"exchange", mean_max(3)},
        {"exchange_in_flight", mean_max(4)},
        {"apply", mean_max(5)},
        {"verify", mean_max(6)}}},
      {"exchange_seconds", mean_min(3)},
      {"per_rank", {{"window_ns", all[0]}, {"compute_ns", all[1]}, {"exchange_ns", all[3]}}},
  };
  if (!s.label.empty()) j["setup"] = s.label;
  return {j, rank};
}

// --compute-ratios: at each rate a blocking calibration run without compute measures the
// exchange; then, `repeats` times, for each ratio, every overlap in turn (interleaved) runs with
// the inner steps set to ratio x that exchange.
void run_overlap_measurements(const Settings& s, int base_port, ThreadPool& pool) {
  int k = 0;
  const double density = s.densities.front();
  const auto emit = [&](SequenceResult result, const char* role, double ratio, int repeat) {
    if (result.rank != 0) return;
    nlohmann::json& j = result.record;
    j["role"] = role;
    j["compute_ratio"] = ratio;
    j["repeat"] = repeat;
    if (s.json) {
      fmt::print("{}\n", j.dump());
    } else {
      fmt::print(
          "{:<8} {:<11} {:<8} ratio {:<4g} window {:.3f} s = compute {:.3f} + boundary "
          "{:.3f} (waited {:.3f}, in flight {:.3f})\n",
          j["rate"].get<std::string>(), role, j["overlap"].get<std::string>(), ratio,
          j["window_seconds"].get<double>(), j["compute_seconds"].get<double>(),
          j["window_seconds"].get<double>() - j["compute_seconds"].get<double>(),
          j["phase_seconds_max"]["exchange"].get<double>(),
          j["phase_seconds_max"]["exchange_in_flight"].get<double>());
    }
    std::fflush(stdout);
  };
  for (const std::string& rate : s.rates) {
    const auto next_port = [&] { return static_cast<std::uint16_t>(base_port + k++); };
    const SequenceResult calibration =
        run_sequence(s, rate, Overlap::blocking, 0.0, density, next_port(), pool);
    const double exchange = calibration.record["exchange_seconds"].get<double>();
    emit(calibration, "calibration", 0.0, 0);
    for (int repeat = 0; repeat < s.repeats; ++repeat) {
      for (double ratio : s.compute_ratios) {
        for (const std::string& name : s.overlaps) {
          emit(run_sequence(s, rate, parse_overlap(name), ratio * exchange, density, next_port(),
                            pool),
               "measurement", ratio, repeat);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"One synchronisation window of pulse, diloco and ddp with the real engine"};
  app.add_option("--parameters", s.parameters, "model parameters (fp32)")->capture_default_str();
  app.add_option("--tensor-elements", s.tensor_elements, "elements per tensor")
      ->capture_default_str();
  app.add_option("--densities", s.densities,
                 "fractions of elements each rank's gate fires (pulse runs once per density)")
      ->delimiter(',')
      ->check(flags::between(0.0, 1.0));
  app.add_option("--shared", s.shared,
                 "fraction of each rank's fired elements that every rank fires (pulse)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  app.add_option("--exchanges", s.exchanges, "pulse: allgather,reduction (one run each)")
      ->delimiter(',')
      ->check(flags::one_of({"allgather", "reduction"}))
      ->capture_default_str();
  app.add_option("--topologies", s.topologies,
                 "pulse: flat,nodes: exchanges flat or node-aware (EngineOptions::node_aware; "
                 "one run each; dense modes run once, with the first)")
      ->delimiter(',')
      ->check(flags::one_of({"flat", "nodes"}))
      ->capture_default_str();
  app.add_option("--allgather", s.allgather,
                 "the all-gather's algorithm (EngineOptions::allgather): auto, ring or direct")
      ->check(flags::one_of({"auto", "ring", "direct"}))
      ->capture_default_str();
  app.add_option("--modes", s.modes, "pulse,diloco,ddp")
      ->delimiter(',')
      ->check(CLI::IsMember({"pulse", "diloco", "ddp"}));
  app.add_option("--rates", s.rates, "link rates for the hook (100mbit,1gbit) or none")
      ->delimiter(',');
  app.add_option("--ddp-steps", s.ddp_steps, "H of the ddp window (dense all-reduces)")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--shape-hook", s.shape_hook, "rank 0 runs '<hook> RATE' / '<hook> off'");
  app.add_option("--threads", s.threads, "engine threads per rank")->capture_default_str();
  app.add_option("--pipeline-chunk-bytes", s.pipeline_chunk_bytes,
                 "pipelining granularity of the collectives")
      ->capture_default_str();
  app.add_option("--timeout-s", s.timeout_s, "deadline of every collective")->capture_default_str();
  app.add_option("--seed", s.seed, "state seed")->capture_default_str();
  app.add_option("--label", s.label, "a 'setup' field for every record");
  app.add_option("--state-location", s.state_location,
                 "host, or device: the weights on CUDA device 0 and the engine's state beside "
                 "them (builds with CUDA)")
      ->check(flags::one_of({"host", "device"}))
      ->capture_default_str();
  app.add_flag("--json", s.json, "one JSON record per line");
  app.add_option("--compute-ratios", s.compute_ratios,
                 "overlapped windows: runs of windows with inner steps that spin for these "
                 "multiples of the blocking exchange time (measured first at each rate); mode "
                 "pulse, the first density")
      ->delimiter(',')
      ->check(flags::at_least(0.0));
  app.add_option("--overlaps", s.overlaps, "with --compute-ratios: the overlaps, interleaved")
      ->delimiter(',')
      ->check(flags::one_of({"blocking", "delayed", "eager"}))
      ->capture_default_str();
  app.add_option("-H,--steps-per-window", s.steps_per_window,
                 "with --compute-ratios: inner steps per window")
      ->check(flags::at_least(std::uint32_t{1}))
      ->capture_default_str();
  app.add_option("--windows", s.windows, "with --compute-ratios: timed windows per run")
      ->check(flags::at_least(std::uint32_t{1}))
      ->capture_default_str();
  app.add_option("--repeats", s.repeats, "with --compute-ratios: rounds of all runs")
      ->check(flags::at_least(1))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    if (s.densities.empty()) throw InvalidArgument("--densities needs at least one value");
    if (s.topologies.empty()) throw InvalidArgument("--topologies needs at least one value");
    if (s.parameters < 1 || s.tensor_elements < 1024 || s.tensor_elements > (1ull << 31)) {
      throw InvalidArgument("--parameters must be >= 1 and --tensor-elements in [1024, 2^31]");
    }
    for (const std::string& rate : s.rates)
      (void)rate_mbit(rate);
    const char* port_text = std::getenv("MASTER_PORT");
    if (port_text == nullptr) throw InvalidArgument("MASTER_PORT is not set (env rendezvous)");
    const int base_port = std::stoi(port_text);
    ThreadPool pool(s.threads);
    if (!s.compute_ratios.empty()) {
      if (s.modes != std::vector<std::string>{"pulse"}) {
        throw InvalidArgument("--compute-ratios measures mode pulse: pass --modes pulse");
      }
      if (s.state_location != "host") {
        throw InvalidArgument("--compute-ratios runs with the state in host memory only");
      }
      run_overlap_measurements(s, base_port, pool);
      return 0;
    }
    int k = 0;
    bool printed_header = false;
    // Every pulse run of one density ends in the same state, whatever the rate, exchange kind
    // or topology: rank 0 checks that their digests agree.
    std::map<double, std::string> pulse_digest;
    bool all_agree = true;
    for (const std::string& rate : s.rates) {
      std::vector<std::tuple<std::string, double, std::string, std::string>> runs;
      for (const std::string& mode : s.modes) {
        if (mode == "pulse") {
          for (double density : s.densities) {
            for (const std::string& exchange : s.exchanges) {
              for (const std::string& topology : s.topologies)
                runs.emplace_back(mode, density, exchange, topology);
            }
          }
        } else {
          // Dense: the density, the exchange and the topology change nothing.
          runs.emplace_back(mode, s.densities.front(), "allgather", s.topologies.front());
        }
      }
      for (const auto& [mode, density, exchange, topology] : runs) {
        const nlohmann::json j = run_one(s, rate, mode, density, exchange, topology == "nodes",
                                         static_cast<std::uint16_t>(base_port + k++), pool);
        if (j.is_null()) continue;
        if (!j["replicas_identical"].get<bool>()) {
          std::fprintf(stderr, "pulseloco_bench_sync: %s %s %s: REPLICAS DIFFER\n", rate.c_str(),
                       mode.c_str(), topology.c_str());
          all_agree = false;
        }
        if (mode == "pulse") {
          const std::string digest = j["digest"].get<std::string>();
          const auto [first, inserted] = pulse_digest.try_emplace(density, digest);
          if (!inserted && first->second != digest) {
            std::fprintf(stderr,
                         "pulseloco_bench_sync: %s %s %s: digest %s differs from %s (the first "
                         "pulse run at density %g)\n",
                         rate.c_str(), exchange.c_str(), topology.c_str(), digest.c_str(),
                         first->second.c_str(), density);
            all_agree = false;
          }
        }
        if (s.json) {
          fmt::print("{}\n", j.dump());
        } else {
          if (!printed_header) {
            fmt::print(
                "{:<8} {:<7} {:<9} {:<5} {:>9} {:>9} {:>9} {:>9} {:>12} {:>9} {:>9} {:>9} {:>12} "
                "{:>9}\n",
                "rate", "mode", "exchange", "topo", "window s", "exch. s", "compute s", "bound s",
                "wire recv", "Mbit/s", "x bound", "density", "node in", "x once");
            printed_header = true;
          }
          const double window = j["window_seconds"].get<double>();
          const double exchange_s = j["exchange_seconds"].get<double>();
          fmt::print(
              "{:<8} {:<7} {:<9} {:<5} {:>9.3f} {:>9.3f} {:>9.3f} {:>9.3f} {:>12} {:>9.1f} "
              "{:>9.2f} {:>8.3f}% {:>12} {:>9}\n",
              rate, mode, j["exchange"].get<std::string>(), topology, window, exchange_s,
              window - exchange_s, j.value("bound_seconds", 0.0),
              human_bytes(static_cast<double>(j["wire_bytes_received_max"].get<std::uint64_t>())),
              j.value("goodput_mbit", 0.0), j.value("ratio_window_to_bound", 0.0),
              100.0 * j["density"].get<double>(),
              human_bytes(static_cast<double>(j["node_inbound_bytes_max"].get<std::uint64_t>())),
              j.contains("node_inbound_ratio")
                  ? fmt::format("{:.2f}", j["node_inbound_ratio"].get<double>())
                  : std::string("-"));
        }
        std::fflush(stdout);
      }
    }
    if (!all_agree) return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pulseloco_bench_sync: %s\n", e.what());
    return 1;
  }
  return 0;
}
