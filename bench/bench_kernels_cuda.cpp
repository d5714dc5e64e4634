// Window-kernel throughput on a CUDA device, next to a device-to-device copy of the same bytes:
//   build/bin/pulseloco_bench_kernels_cuda [--elements=1000000000] [google-benchmark flags]
// One pulse window phase by phase against the device's copy bandwidth, and the same window with
// the state in host memory (bench_window_cuda.cpp; scripts/gpu_check runs it):
//   build/bin/pulseloco_bench_kernels_cuda --window [--elements=2.5e8] [--repetitions=5]
//       [--host-threads=0] [--no-host] [--json]
//
// Rows: <kernel>/<local dtype>/cuda and copy/<kernel>/<local dtype> (cudaMemcpyAsync
// device-to-device moving the same bytes, read + write). bytes_per_second counts every byte a
// kernel reads or writes, so "of copy" in the summary is the kernel's share of the bandwidth a
// device copy reaches (the gate at 1e9 elements should reach 70%). Inputs are
// generated on the device (bench_inputs_cuda.cu): θ_g on the bf16 grid with std 0.02, θ_l moved
// by 8 AdamW-like steps at lr 3e-6 (1-3% of elements fire), e left by an earlier window. The
// gate is timed end to end (it returns its count to the host); the others with CUDA events.
// Without a CUDA device every row reports an error (--window: says so) and the program exits
// normally.
#include <benchmark/benchmark.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <pulseloco/kernels/cuda/window_kernels_cuda.h>
#include <pulseloco/kernels/gpu_runtime.h>
#include "bench_cuda_util.h"
#include "bench_inputs_cuda.h"
#include "bench_window_cuda.h"
#include "summary_reporter.h"

namespace pulseloco::bench {
namespace {

using kernels::GateChunk;

std::uint64_t g_elements = 1'000'000'000;
constexpr int kAggregateRanks = 4;

struct DeviceWorkload {
  std::uint64_t n = 0;
  cudaStream_t stream = nullptr;
  std::unique_ptr<DeviceBuffer> global, local_f32, local_bf16, residual, momentum, g;
  std::unique_ptr<DeviceBuffer> offsets, values;  // gate output (capacity n)
  std::unique_ptr<DeviceBuffer> copy_src, copy_dst;
  std::unique_ptr<kernels::cuda::DeviceWorkspace> workspace;
  std::uint64_t fired_f32 = 0, fired_bf16 = 0;
  std::string error;  // why the workload could not be built

  const void* local(DType dtype) const {
    return dtype == DType::float32 ? local_f32->data : local_bf16->data;
  }
  GateChunk chunk(DType dtype) const {
    return GateChunk{.global = global->as<float>(),
                     .local = local(dtype),
                     .local_dtype = dtype,
                     .residual = residual->as<float>(),
                     .count = n};
  }
  double density(DType dtype) const {
    return static_cast<double>(dtype == DType::float32 ? fired_f32 : fired_bf16) /
           static_cast<double>(n);
  }
};

constexpr double kMaxCopyBytesPerElement = 36.0;  // the fused end of window, fp32

DeviceWorkload& workload() {
  static std::unique_ptr<DeviceWorkload> w = [] {
    auto out = std::make_unique<DeviceWorkload>();
    DeviceWorkload& wl = *out;
    if (kernels::cuda_device_count() == 0) {
      wl.error = "no CUDA device";
      return out;
    }
    try {
      const std::uint64_t n = g_elements;
      if (n > kernels::kMaxChunkElements) throw std::runtime_error("--elements exceeds 2^31");
      wl.n = n;
      check(cudaStreamCreateWithFlags(&wl.stream, cudaStreamNonBlocking), "cudaStreamCreate");
      wl.global = std::make_unique<DeviceBuffer>(n * 4);
      wl.local_f32 = std::make_unique<DeviceBuffer>(n * 4);
      wl.local_bf16 = std::make_unique<DeviceBuffer>(n * 2);
      wl.residual = std::make_unique<DeviceBuffer>(n * 4);
      wl.momentum = std::make_unique<DeviceBuffer>(n * 4);
      wl.g = std::make_unique<DeviceBuffer>(n * 4);
      wl.offsets = std::make_unique<DeviceBuffer>(n * 4);
      wl.values = std::make_unique<DeviceBuffer>(n * 4);
      const auto copy_bytes =
          static_cast<std::size_t>(static_cast<double>(n) * kMaxCopyBytesPerElement / 2);
      wl.copy_src = std::make_unique<DeviceBuffer>(copy_bytes);
      wl.copy_dst = std::make_unique<DeviceBuffer>(copy_bytes);
      check(cudaMemsetAsync(wl.copy_src->data, 1, copy_bytes, wl.stream), "cudaMemset");
      wl.workspace = std::make_unique<kernels::cuda::DeviceWorkspace>(n);
      // e: what an earlier window (other θ_l) left unsent.
      check(cudaMemsetAsync(wl.residual->data, 0, n * 4, wl.stream), "cudaMemset");
      fill_window_inputs(wl.global->as<float>(), wl.local_f32->as<float>(),
                         wl.local_bf16->as<std::uint16_t>(), wl.momentum->as<float>(), n, 1,
                         wl.stream);
      kernels::cuda::commit_residual(wl.chunk(DType::float32), wl.residual->as<float>(), wl.stream);
      fill_window_inputs(wl.global->as<float>(), wl.local_f32->as<float>(),
                         wl.local_bf16->as<std::uint16_t>(), wl.momentum->as<float>(), n, 2,
                         wl.stream);
      wl.fired_bf16 =
          kernels::cuda::gate(wl.chunk(DType::bfloat16), wl.offsets->as<std::uint32_t>(),
                              wl.values->as<float>(), *wl.workspace, wl.stream)
              .fired;
      // Last, so that offsets/values hold the fp32 gate's entries for the aggregate.
      wl.fired_f32 = kernels::cuda::gate(wl.chunk(DType::float32), wl.offsets->as<std::uint32_t>(),
                                         wl.values->as<float>(), *wl.workspace, wl.stream)
                         .fired;
    } catch (const std::exception& e) {
      wl.error = e.what();
    }
    return out;
  }();
  return *w;
}

bool usable(benchmark::State& state) {
  const DeviceWorkload& w = workload();
  if (!w.error.empty()) {
    state.SkipWithError(w.error.c_str());
    return false;
  }
  return true;
}

void set_rates(benchmark::State& state, std::uint64_t elements, double bytes) {
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(elements));
  state.SetBytesProcessed(
      static_cast<std::int64_t>(static_cast<double>(state.iterations()) * bytes));
}

// Times `enqueue` (work on w.stream) with CUDA events.
template <typename Enqueue>
void timed_on_stream(benchmark::State& state, DeviceWorkload& w, Enqueue enqueue) {
  cudaEvent_t start = nullptr, stop = nullptr;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  for (auto _ : state) {
    check(cudaEventRecord(start, w.stream), "cudaEventRecord");
    enqueue();
    check(cudaEventRecord(stop, w.stream), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    state.SetIterationTime(static_cast<double>(ms) / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

double gate_bytes(DType dtype, double density) {
  return 8.0 + static_cast<double>(dtype_size(dtype)) + 8.0 * density;
}

void run_gate(benchmark::State& state, DType dtype) {
  if (!usable(state)) return;
  DeviceWorkload& w = workload();
  std::uint64_t fired = 0;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    fired = kernels::cuda::gate(w.chunk(dtype), w.offsets->as<std::uint32_t>(),
                                w.values->as<float>(), *w.workspace, w.stream)
                .fired;
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  const double density = static_cast<double>(fired) / static_cast<double>(w.n);
  set_rates(state, w.n, static_cast<double>(w.n) * gate_bytes(dtype, density));
  state.counters["fired_fraction"] = density;
}

void run_commit(benchmark::State& state, DType dtype) {
  if (!usable(state)) return;
  DeviceWorkload& w = workload();
  float* out = w.g->as<float>();  // scratch: the aggregate buffer
  timed_on_stream(state, w, [&] { kernels::cuda::commit_residual(w.chunk(dtype), out, w.stream); });
  set_rates(state, w.n, static_cast<double>(w.n) * (12.0 + static_cast<double>(dtype_size(dtype))));
}

void run_outer(benchmark::State& state, DType dtype) {
  if (!usable(state)) return;
  DeviceWorkload& w = workload();
  void* local = dtype == DType::float32 ? w.local_f32->data : w.local_bf16->data;
  timed_on_stream(state, w, [&] {
    kernels::cuda::outer_step(w.global->as<float>(), w.momentum->as<float>(), w.g->as<float>(),
                              local, dtype, w.n, kernels::OuterStepParams{}, w.stream);
  });
  set_rates(state, w.n, static_cast<double>(w.n) * (20.0 + static_cast<double>(dtype_size(dtype))));
}

void run_fused(benchmark::State& state, DType dtype) {
  if (!usable(state)) return;
  DeviceWorkload& w = workload();
  void* local = dtype == DType::float32 ? w.local_f32->data : w.local_bf16->data;
  timed_on_stream(state, w, [&] {
    kernels::cuda::commit_and_outer_step(kernels::WindowChunk{.global = w.global->as<float>(),
                                                              .momentum = w.momentum->as<float>(),
                                                              .residual = w.residual->as<float>(),
                                                              .local = local,
                                                              .local_dtype = dtype,
                                                              .count = w.n},
                                         w.g->as<float>(), kernels::OuterStepParams{}, w.stream);
  });
  set_rates(state, w.n,
            static_cast<double>(w.n) * (32.0 + 2.0 * static_cast<double>(dtype_size(dtype))));
}

// g = 0 (4 B) and g /= R (8 B) per element; per entry 8 B of message and 8 B of g.
double aggregate_bytes(const DeviceWorkload& w) {
  return 12.0 * static_cast<double>(w.n) +
         16.0 * static_cast<double>(w.fired_f32) * kAggregateRanks;
}

void run_aggregate(benchmark::State& state) {
  if (!usable(state)) return;
  DeviceWorkload& w = workload();
  // kAggregateRanks ranks sending the fp32 gate's entries (same positions: the traffic of R
  // messages of the realistic size).
  std::vector<kernels::SparseEntries> ranks(
      kAggregateRanks, kernels::SparseEntries{{w.offsets->as<std::uint32_t>(), w.fired_f32},
                                              {w.values->as<float>(), w.fired_f32}});
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    kernels::cuda::aggregate(ranks, w.g->as<float>(), w.n, *w.workspace, w.stream);
    check(cudaStreamSynchronize(w.stream), "cudaStreamSynchronize");
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  set_rates(state, w.n, aggregate_bytes(w));
}

// cudaMemcpyAsync device to device moving `bytes_per_element` (read + write) per element.
void run_copy(benchmark::State& state, double bytes_per_element) {
  if (!usable(state)) return;
  DeviceWorkload& w = workload();
  const auto bytes = static_cast<std::size_t>(static_cast<double>(w.n) * bytes_per_element / 2.0);
  timed_on_stream(state, w, [&] {
    check(cudaMemcpyAsync(w.copy_dst->data, w.copy_src->data, bytes, cudaMemcpyDeviceToDevice,
                          w.stream),
          "cudaMemcpyAsync");
  });
  set_rates(state, w.n, static_cast<double>(bytes) * 2.0);
}

// Registration order is run order: the gates first (they leave the fp32 gate's entries in
// offsets/values for the aggregate and change no state), then the aggregate, then the kernels
// that update the state.
void register_all() {
  const auto name = [](const char* kernel, DType dtype, const char* suffix) {
    return fmt::format("{}/{}{}", kernel, dtype == DType::float32 ? "fp32" : "bf16", suffix);
  };
  for (DType dtype : {DType::bfloat16, DType::float32}) {
    benchmark::RegisterBenchmark(name("gate", dtype, "/cuda").c_str(), [=](benchmark::State& s) {
      run_gate(s, dtype);
    })->UseManualTime();
    benchmark::RegisterBenchmark(name("copy/gate", dtype, "").c_str(), [=](benchmark::State& s) {
      run_copy(s, workload().error.empty() ? gate_bytes(dtype, workload().density(dtype)) : 0);
    })->UseManualTime();
  }
  const std::string r = fmt::format("r{}", kAggregateRanks);
  benchmark::RegisterBenchmark(("aggregate/" + r + "/cuda").c_str(), [](benchmark::State& s) {
    run_aggregate(s);
  })->UseManualTime();
  benchmark::RegisterBenchmark(("copy/aggregate/" + r).c_str(), [](benchmark::State& s) {
    const DeviceWorkload& w = workload();
    run_copy(s, w.error.empty() ? aggregate_bytes(w) / static_cast<double>(w.n) : 0);
  })->UseManualTime();
  for (DType dtype : {DType::float32, DType::bfloat16}) {
    const double local = static_cast<double>(dtype_size(dtype));
    benchmark::RegisterBenchmark(name("commit", dtype, "/cuda").c_str(), [=](benchmark::State& s) {
      run_commit(s, dtype);
    })->UseManualTime();
    benchmark::RegisterBenchmark(name("copy/commit", dtype, "").c_str(), [=](benchmark::State& s) {
      run_copy(s, 12.0 + local);
    })->UseManualTime();
    benchmark::RegisterBenchmark(name("outer_step", dtype, "/cuda").c_str(),
                                 [=](benchmark::State& s) { run_outer(s, dtype); })
        ->UseManualTime();
    benchmark::RegisterBenchmark(name("copy/outer_step", dtype, "").c_str(),
                                 [=](benchmark::State& s) { run_copy(s, 20.0 + local); })
        ->UseManualTime();
    benchmark::RegisterBenchmark(name("commit_and_outer_step", dtype, "/cuda").c_str(),
                                 [=](benchmark::State& s) { run_fused(s, dtype); })
        ->UseManualTime();
    benchmark::RegisterBenchmark(name("copy/commit_and_outer_step", dtype, "").c_str(),
                                 [=](benchmark::State& s) { run_copy(s, 32.0 + 2.0 * local); })
        ->UseManualTime();
  }
}

}  // namespace
}  // namespace pulseloco::bench

int main(int argc, char** argv) {
  std::vector<char*> args;
  bool window = false, elements_given = false;
  pulseloco::bench::WindowBenchOptions window_options;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.starts_with("--elements=")) {
      pulseloco::bench::g_elements = static_cast<std::uint64_t>(std::stod(arg.substr(11)));
      elements_given = true;
    } else if (arg == "--window") {
      window = true;
    } else if (arg == "--json") {
      window_options.json = true;
    } else if (arg == "--no-host") {
      window_options.host_staging = false;
    } else if (arg.starts_with("--repetitions=")) {
      window_options.repetitions = std::stoi(arg.substr(14));
    } else if (arg.starts_with("--host-threads=")) {
      window_options.host_threads = std::stoi(arg.substr(15));
    } else {
      args.push_back(argv[i]);
    }
  }
  if (window) {
    if (elements_given) window_options.elements = pulseloco::bench::g_elements;
    return pulseloco::bench::run_window_bench(window_options);
  }
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  if (benchmark::ReportUnrecognizedArguments(count, args.data())) return 1;
  fmt::print("device: {}\n", pulseloco::kernels::cuda_device_count() > 0
                                 ? pulseloco::kernels::cuda_device_description(0)
                                 : std::string("none"));
  pulseloco::bench::register_all();
  pulseloco::bench::SummaryReporter reporter(
      "CUDA device; 'of copy' = kernel bytes/s / device-to-device copy bytes/s");
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
