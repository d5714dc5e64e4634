// One pulse window on a CUDA device, phase by phase, against the device's own copy bandwidth
// measured in the same run (pulseloco_bench_kernels_cuda --window; docs/benchmarks.md, "GPU").
//
// The state (θ_g, m, e on the device; θ_l fp32 or bf16) is generated as bench_inputs_cuda.h
// describes, and every timed window starts from the same snapshot of it. Device phases, each
// timed with CUDA events on the stream: gate (with compaction), aggregate (R ranks' messages
// already on the device), residual commit + outer step + reset (one fused kernel), digests of
// θ_g and m. Each phase's bytes are what it must read and write per parameter (L = bytes of θ_l,
// d = fired fraction, R = ranks):
//   gate 8 + L + 8d;  aggregate 12 + 16dR;  commit + outer step + reset 32 + 2L;  digests 8.
// "of copy" is the phase's bytes/s over the device-to-device copy's (bytes read + written);
// "x bound" is its time over the time its bytes take at the copy bandwidth. "window" is the four
// phases; "window_without_digests" leaves out the digests, which are hashed on the device
// (xxh3-64 of every 4 MiB piece in parallel, kernels/cuda/digest_cuda.cu; only the pieces'
// digests cross to the host).
// Host mode: the same window with the state in host memory, as the host-staging engine runs it:
// θ_l copied to pinned host memory, the CPU kernels over chunks on all cores, θ_l copied back.
// Both modes end with the same θ_g and m (their digests are compared).
#include "bench_window_cuda.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <pulseloco/base/thread_pool.h>
#include <pulseloco/kernels/cuda/window_kernels_cuda.h>
#include <pulseloco/kernels/gpu_runtime.h>
#include <pulseloco/kernels/window_kernels.h>
#include "bench_cuda_util.h"
#include "bench_inputs_cuda.h"

namespace pulseloco::bench {
namespace {

using nlohmann::json;

constexpr int kRanks = 4;                       // R: messages the aggregate adds
constexpr std::uint64_t kHostChunk = 1u << 22;  // host mode: elements per chunk (and per tensor)
constexpr double kGateTarget = 0.70;            // gate bytes/s >= 70% of the copy's
constexpr double kWindowTarget = 1.5;           // device phases <= 1.5x their byte bound

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

struct Phase {
  std::string name;
  double bytes_per_element = 0;  // 0: not counted against the copy bandwidth
  std::vector<double> seconds;   // one per repetition
};

// The device state of one local dtype, and the snapshot every window starts from.
struct DeviceState {
  std::uint64_t n;
  DType dtype;
  DeviceBuffer global, momentum, residual, local, g, offsets, values;
  DeviceBuffer saved_global, saved_momentum, saved_residual, saved_local;

  DeviceState(std::uint64_t count, DType local_dtype)
      : n(count),
        dtype(local_dtype),
        global(4 * n),
        momentum(4 * n),
        residual(4 * n),
        local(dtype_size(dtype) * n),
        g(4 * n),
        offsets(4 * n),
        values(4 * n),
        saved_global(4 * n),
        saved_momentum(4 * n),
        saved_residual(4 * n),
        saved_local(dtype_size(dtype) * n) {}

  std::size_t local_bytes() const { return dtype_size(dtype) * n; }
  kernels::GateChunk gate_chunk() const {
    return {.global = global.as<float>(),
            .local = local.data,
            .local_dtype = dtype,
            .residual = residual.as<float>(),
            .count = n};
  }
  void copy_all(bool save, cudaStream_t stream) {
    const std::pair<DeviceBuffer*, DeviceBuffer*> pairs[] = {{&global, &saved_global},
                                                             {&momentum, &saved_momentum},
                                                             {&residual, &saved_residual},
                                                             {&local, &saved_local}};
    for (const auto& [live, saved] : pairs) {
      const std::size_t bytes = live == &local ? local_bytes() : 4 * n;
      check(cudaMemcpyAsync(save ? saved->data : live->data, save ? live->data : saved->data, bytes,
                            cudaMemcpyDeviceToDevice, stream),
            "cudaMemcpyAsync (snapshot)");
    }
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }
};

// θ_g, θ_l, m from bench_inputs_cuda.h, and e as an earlier window (other θ_l) left it.
void generate_state(DeviceState& s, cudaStream_t stream) {
  DeviceBuffer local_f32(4 * s.n), local_bf16(2 * s.n);
  check(cudaMemsetAsync(s.residual.data, 0, 4 * s.n, stream), "cudaMemsetAsync");
  const auto fill = [&](std::uint64_t seed) {
    fill_window_inputs(s.global.as<float>(), local_f32.as<float>(), local_bf16.as<std::uint16_t>(),
                       s.momentum.as<float>(), s.n, seed, stream);
    check(
        cudaMemcpyAsync(s.local.data, s.dtype == DType::float32 ? local_f32.data : local_bf16.data,
                        s.local_bytes(), cudaMemcpyDeviceToDevice, stream),
        "cudaMemcpyAsync");
  };
  fill(1);
  kernels::cuda::commit_residual(s.gate_chunk(), s.residual.as<float>(), stream);
  fill(2);
  s.copy_all(/*save=*/true, stream);
}

// The median bytes/s of device-to-device copies of `bytes`, counting bytes read + written.
double copy_bandwidth(std::size_t bytes, int repetitions, cudaStream_t stream) {
  DeviceBuffer source(bytes), destination(bytes);
  check(cudaMemsetAsync(source.data, 1, bytes, stream), "cudaMemsetAsync");
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<double> rates;
  for (int r = 0; r < repetitions + 1; ++r) {  // the first one warms up
    check(cudaEventRecord(start, stream), "cudaEventRecord");
    check(cudaMemcpyAsync(destination.data, source.data, bytes, cudaMemcpyDeviceToDevice, stream),
          "cudaMemcpyAsync");
    check(cudaEventRecord(stop, stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    if (r > 0) rates.push_back(2.0 * static_cast<double>(bytes) / (ms / 1e3));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(rates);
}

// Times the device window's phases on `stream`; returns the fired fraction and the digest.
std::pair<double, Digest> device_windows(DeviceState& s, kernels::cuda::DeviceWorkspace& workspace,
                                         std::vector<Phase>& phases, int repetitions,
                                         cudaStream_t stream) {
  std::vector<cudaEvent_t> events(phases.size() + 1);
  for (cudaEvent_t& event : events)
    check(cudaEventCreate(&event), "cudaEventCreate");
  double density = 0;
  Digest digest = 0;
  for (int r = 0; r < repetitions + 1; ++r) {  // the first one warms up
    s.copy_all(/*save=*/false, stream);
    check(cudaEventRecord(events[0], stream), "cudaEventRecord");
    const std::uint64_t fired = kernels::cuda::gate(s.gate_chunk(), s.offsets.as<std::uint32_t>(),
                                                    s.values.as<float>(), workspace, stream)
                                    .fired;
    check(cudaEventRecord(events[1], stream), "cudaEventRecord");
    const std::vector<kernels::SparseEntries> ranks(
        kRanks, kernels::SparseEntries{{s.offsets.as<std::uint32_t>(), fired},
                                       {s.values.as<float>(), fired}});
    kernels::cuda::aggregate(ranks, s.g.as<float>(), s.n, workspace, stream);
    check(cudaEventRecord(events[2], stream), "cudaEventRecord");
    kernels::cuda::commit_and_outer_step(kernels::WindowChunk{.global = s.global.as<float>(),
                                                              .momentum = s.momentum.as<float>(),
                                                              .residual = s.residual.as<float>(),
                                                              .local = s.local.data,
                                                              .local_dtype = s.dtype,
                                                              .count = s.n},
                                         s.g.as<float>(), kernels::OuterStepParams{}, stream);
    check(cudaEventRecord(events[3], stream), "cudaEventRecord");
    digest = kernels::cuda::state_digest({s.global.as<float>(), s.n}, {s.momentum.as<float>(), s.n},
                                         workspace, stream);
    check(cudaEventRecord(events[4], stream), "cudaEventRecord");
    check(cudaEventSynchronize(events[4]), "cudaEventSynchronize");
    density = static_cast<double>(fired) / static_cast<double>(s.n);
    for (std::size_t p = 0; r > 0 && p < phases.size(); ++p) {
      float ms = 0;
      check(cudaEventElapsedTime(&ms, events[p], events[p + 1]), "cudaEventElapsedTime");
      phases[p].seconds.push_back(static_cast<double>(ms) / 1e3);
    }
  }
  for (cudaEvent_t event : events)
    cudaEventDestroy(event);
  return {density, digest};
}

// The host-staging window: the device snapshot copied once to host memory, then per window θ_l
// to the host, the CPU kernels over chunks, θ_l back to the device.
Digest host_windows(DeviceState& s, std::vector<Phase>& phases, int repetitions, int threads,
                    cudaStream_t stream) {
  const std::uint64_t n = s.n;
  const std::uint64_t chunks = (n + kHostChunk - 1) / kHostChunk;
  std::vector<float> global(n), momentum(n), residual(n), g(n), values(n);
  std::vector<std::uint32_t> offsets(n);
  std::vector<std::uint64_t> fired(chunks);
  std::vector<Digest> digests(chunks);
  DeviceBuffer local(s.local_bytes(), /*pinned_host=*/true);
  ThreadPool pool(static_cast<std::size_t>(threads));
  const auto begin = [&](std::size_t c) { return c * kHostChunk; };
  const auto count = [&](std::size_t c) { return std::min(kHostChunk, n - begin(c)); };
  const auto local_at = [&](std::size_t c) {
    return static_cast<std::byte*>(local.data) + begin(c) * dtype_size(s.dtype);
  };
  const auto timed = [&](bool keep, std::size_t p, const std::function<void()>& work) {
    const auto start = std::chrono::steady_clock::now();
    work();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (keep) phases[p].seconds.push_back(seconds);
  };
  Digest digest = 0;
  for (int r = 0; r < repetitions + 1; ++r) {  // the first one warms up
    const bool keep = r > 0;
    for (const auto& [host, device] :
         {std::pair{global.data(), &s.saved_global}, std::pair{momentum.data(), &s.saved_momentum},
          std::pair{residual.data(), &s.saved_residual}}) {
      check(cudaMemcpy(host, device->data, 4 * n, cudaMemcpyDeviceToHost), "cudaMemcpy");
    }
    check(cudaMemcpy(s.local.data, s.saved_local.data, s.local_bytes(), cudaMemcpyDeviceToDevice),
          "cudaMemcpy");
    timed(keep, 0, [&] {
      check(cudaMemcpyAsync(local.data, s.local.data, s.local_bytes(), cudaMemcpyDeviceToHost,
                            stream),
            "cudaMemcpyAsync (θ_l to host)");
      check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    });
    const auto chunk = [&](std::size_t c) {
      return kernels::GateChunk{.global = global.data() + begin(c),
                                .local = local_at(c),
                                .local_dtype = s.dtype,
                                .residual = residual.data() + begin(c),
                                .count = count(c)};
    };
    timed(keep, 1, [&] {
      pool.parallel_for(chunks, [&](std::size_t c) {
        fired[c] =
            kernels::gate(chunk(c), offsets.data() + begin(c), values.data() + begin(c)).fired;
      });
    });
    timed(keep, 2, [&] {
      pool.parallel_for(chunks, [&](std::size_t c) {
        const kernels::SparseEntries entries{{offsets.data() + begin(c), fired[c]},
                                             {values.data() + begin(c), fired[c]}};
        const std::vector<kernels::SparseEntries> ranks(kRanks, entries);
        kernels::aggregate(ranks, g.data() + begin(c), count(c));
      });
    });
    timed(keep, 3, [&] {
      pool.parallel_for(chunks, [&](std::size_t c) {
        kernels::commit_and_outer_step(kernels::WindowChunk{.global = global.data() + begin(c),
                                                            .momentum = momentum.data() + begin(c),
                                                            .residual = residual.data() + begin(c),
                                                            .local = local_at(c),
                                                            .local_dtype = s.dtype,
                                                            .count = count(c)},
                                       g.data() + begin(c), kernels::OuterStepParams{});
      });
    });
    timed(keep, 4, [&] {  // one digest per chunk, as the engine digests tensors in parallel
      pool.parallel_for(chunks, [&](std::size_t c) {
        digests[c] = kernels::state_digest({global.data() + begin(c), count(c)},
                                           {momentum.data() + begin(c), count(c)});
      });
    });
    timed(keep, 5, [&] {
      check(cudaMemcpyAsync(s.local.data, local.data, s.local_bytes(), cudaMemcpyHostToDevice,
                            stream),
            "cudaMemcpyAsync (θ_l to device)");
      check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    });
    digest = kernels::state_digest(global, momentum);  // whole-model, to compare with the device
  }
  return digest;
}

json phase_record(const Phase& phase, const std::string& mode, DType dtype, std::uint64_t n,
                  double copy_rate) {
  const double seconds = median(phase.seconds);
  json record = {{"record", "phase"},
                 {"mode", mode},
                 {"local_dtype", dtype == DType::float32 ? "fp32" : "bf16"},
                 {"phase", phase.name},
                 {"seconds", seconds},
                 {"seconds_per_gparam", seconds / (static_cast<double>(n) / 1e9)}};
  if (phase.bytes_per_element > 0) {
    const double bytes = phase.bytes_per_element * static_cast<double>(n);
    record["bytes"] = bytes;
    record["gbps"] = bytes / seconds / 1e9;
    record["of_copy"] = bytes / seconds / copy_rate;
    record["bound_seconds"] = bytes / copy_rate;
    record["x_bound"] = seconds / (bytes / copy_rate);
  }
  return record;
}

// Adds the sum of phases [first, last) as `name` (each repetition's sum).
Phase sum_of(const std::vector<Phase>& phases, std::size_t first, std::size_t last,
             std::string name) {
  Phase sum{std::move(name), 0, std::vector<double>(phases[first].seconds.size(), 0.0)};
  for (std::size_t p = first; p < last; ++p) {
    sum.bytes_per_element += phases[p].bytes_per_element;
    for (std::size_t r = 0; r < sum.seconds.size(); ++r)
      sum.seconds[r] += phases[p].seconds[r];
  }
  return sum;
}

void print(const json& record, bool as_json) {
  if (as_json) {
    fmt::print("{}\n", record.dump());
    return;
  }
  const std::string kind = record["record"];
  if (kind == "phase") {
    fmt::print(
        "{:<7} {:<5} {:<26} {:>9.3f} ms {:>9.1f} GB/s {:>7} {:>8}\n",
        record["mode"].get<std::string>(), record["local_dtype"].get<std::string>(),
        record["phase"].get<std::string>(), 1e3 * record["seconds"].get<double>(),
        record.value("gbps", 0.0),
        record.contains("of_copy") ? fmt::format("{:.0f}%", 100 * record["of_copy"].get<double>())
                                   : "-",
        record.contains("x_bound") ? fmt::format("{:.2f}x", record["x_bound"].get<double>()) : "-");
  } else if (kind == "check") {
    fmt::print("check {} {}: {:.2f} (target {}): {}\n", record["local_dtype"].get<std::string>(),
               record["name"].get<std::string>(), record["value"].get<double>(),
               record["target"].get<std::string>(), record["pass"].get<bool>() ? "met" : "NOT MET");
  } else if (kind == "compare") {
    fmt::print("{}: host window / device window {:.1f}x; digests {}\n",
               record["local_dtype"].get<std::string>(),
               record["host_over_device_window"].get<double>(),
               record["identical"].get<bool>() ? "identical" : "DIFFER");
  } else if (kind == "copy") {
    fmt::print("device-to-device copy (bytes read + written): {:.1f} GB/s\n",
               record["gbps"].get<double>());
  } else if (kind == "skipped") {
    fmt::print("nothing measured: {}\n", record["reason"].get<std::string>());
  } else {
    fmt::print("{}\n", record.dump());
  }
}

int run(const WindowBenchOptions& options) {
  const std::uint64_t n = options.elements;
  if (n == 0 || n > kernels::kMaxChunkElements)
    throw std::runtime_error("--elements must be in [1, 2^31]");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const double copy_rate = copy_bandwidth(static_cast<std::size_t>(n) * 8, 10, stream);
  print({{"record", "device"},
         {"device", kernels::cuda_device_description(0)},
         {"cuda_runtime", kernels::cuda_runtime_version()},
         {"elements", n},
         {"ranks", kRanks},
         {"repetitions", options.repetitions}},
        options.json);
  print({{"record", "copy"}, {"bytes", 16.0 * static_cast<double>(n)}, {"gbps", copy_rate / 1e9}},
        options.json);
  int status = 0;
  for (DType dtype : {DType::float32, DType::bfloat16}) {
    const double local = static_cast<double>(dtype_size(dtype));
    DeviceState state(n, dtype);
    kernels::cuda::DeviceWorkspace workspace(n);
    generate_state(state, stream);
    std::vector<Phase> device = {{"gate", 0, {}},
                                 {"aggregate", 0, {}},
                                 {"commit_outer_step_reset", 32 + 2 * local, {}},
                                 {"digests", 8, {}}};
    const auto [density, device_digest] =
        device_windows(state, workspace, device, options.repetitions, stream);
    device[0].bytes_per_element = 8 + local + 8 * density;
    device[1].bytes_per_element = 12 + 16 * density * kRanks;
    device.push_back(sum_of(device, 1, 3, "apply"));
    device.push_back(sum_of(device, 0, 4, "window"));
    device.push_back(sum_of(device, 0, 3, "window_without_digests"));
    for (const Phase& phase : device)
      print(phase_record(phase, "device", dtype, n, copy_rate), options.json);
    const std::string dtype_name = dtype == DType::float32 ? "fp32" : "bf16";
    const double gate_of_copy = device[0].bytes_per_element * static_cast<double>(n) /
                                median(device[0].seconds) / copy_rate;
    const double window_x_bound = median(device[5].seconds) / (device[5].bytes_per_element *
                                                               static_cast<double>(n) / copy_rate);
    print({{"record", "check"},
           {"local_dtype", dtype_name},
           {"name", "gate_of_copy"},
           {"value", gate_of_copy},
           {"target", fmt::format(">= {:.2f}", kGateTarget)},
           {"pass", gate_of_copy >= kGateTarget},
           {"fired_fraction", density}},
          options.json);
    print({{"record", "check"},
           {"local_dtype", dtype_name},
           {"name", "window_x_bound"},
           {"value", window_x_bound},
           {"target", fmt::format("<= {:.1f}", kWindowTarget)},
           {"pass", window_x_bound <= kWindowTarget}},
          options.json);
    if (!options.host_staging) continue;
    std::vector<Phase> host = {{"theta_l_to_host", 0, {}}, {"gate", 0, {}},
                               {"aggregate", 0, {}},       {"commit_outer_step_reset", 0, {}},
                               {"digests", 0, {}},         {"theta_l_to_device", 0, {}}};
    const Digest host_digest =
        host_windows(state, host, options.repetitions, options.host_threads, stream);
    host.push_back(sum_of(host, 0, host.size(), "window"));
    for (const Phase& phase : host)
      print(phase_record(phase, "host", dtype, n, copy_rate), options.json);
    print({{"record", "compare"},
           {"local_dtype", dtype_name},
           {"host_over_device_window", median(host.back().seconds) / median(device[5].seconds)},
           {"device_digest", fmt::format("{:016x}", device_digest)},
           {"host_digest", fmt::format("{:016x}", host_digest)},
           {"identical", device_digest == host_digest}},
          options.json);
    if (device_digest != host_digest) status = 1;  // the kernels' contract is broken
  }
  cudaStreamDestroy(stream);
  return status;
}

}  // namespace

int run_window_bench(const WindowBenchOptions& options) {
  if (kernels::cuda_device_count() == 0) {
    print({{"record", "skipped"}, {"reason", "no CUDA device"}}, options.json);
    return 0;
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    print({{"record", "error"}, {"error", e.what()}}, options.json);
    return 1;
  }
}

}  // namespace pulseloco::bench
