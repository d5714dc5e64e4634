// Window-kernel throughput on the CPU, next to a streaming copy of the same bytes and the
// libtorch-ops reference, in one run:
//   build/bin/pulseloco_bench_kernels [--elements=N] [google-benchmark flags]
//
// Rows:
//   <kernel>/<local dtype>/<isa>        pulseloco's kernel, one thread, chunks of 2^20 elements
//   copy/<kernel>/<local dtype>         memcpy moving the same bytes as the kernel (read+write)
//   torch/<kernel>/<local dtype>        the same step written with libtorch tensor operations
//                                       (as the authors' Python does it), one libtorch thread
//   <kernel>/<local dtype>/<isa>/threads:T   the kernel over chunks on a base::ThreadPool
//   gate/<local dtype>/avx2/no_prefetch the AVX2 gate without its software prefetching
//   gate/<local dtype>/reads_only       the gate's reads alone: the ceiling of a one-pass gate
// bytes_per_second counts every byte a kernel reads or writes (a copy of B bytes moves 2B), so
// "of copy" in the summary is the kernel's share of the memory bandwidth a streaming copy
// reaches. After the table, a summary prints those ratios and the speed-up over libtorch.
//
// Inputs are realistic: θ_g on the bf16 grid with std 0.02, θ_l = θ_g moved by 8 AdamW-like
// steps at lr 3e-6 (about 1-3% of elements fire), e from an earlier window.
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <fmt/format.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <pulseloco/base/cpu_features.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/kernels/cpu/window_kernels_internal.h>
#include <pulseloco/kernels/window_kernels.h>
#include "summary_reporter.h"
#include "tests/kernels/window_test_inputs.h"

namespace pulseloco::bench {
namespace {

using kernels::GateChunk;
using kernels::SparseEntries;
using testing::LocalWeights;

constexpr std::uint64_t kChunk = std::uint64_t{1} << 20;
constexpr int kAggregateRanks = 4;
constexpr float kInnerLr = 3e-6f;
// Adam's |m̂/√v̂| for noisy RL gradients is well below 1; this scale gives the 1-3% density
// the PULSE paper measures at lr 3e-6 over 8 steps.
constexpr float kDirectionScale = 0.08f;

struct Workload {
  std::size_t n = 0;
  std::vector<float> global, residual, momentum, g;
  LocalWeights local_f32{DType::float32, 0}, local_bf16{DType::bfloat16, 0};
  // Sparse messages of kAggregateRanks ranks, per chunk: offsets and values.
  std::vector<std::vector<std::vector<std::uint32_t>>> offsets;
  std::vector<std::vector<std::vector<float>>> values;
  std::uint64_t message_entries = 0;
  double density_f32 = 0, density_bf16 = 0;  // fired fraction of the gate on these inputs
  // Copy buffers large enough for the widest kernel.
  std::vector<std::byte> copy_src, copy_dst;

  const LocalWeights& local(DType dtype) const {
    return dtype == DType::float32 ? local_f32 : local_bf16;
  }
  double density(DType dtype) const { return dtype == DType::float32 ? density_f32 : density_bf16; }
};

std::size_t g_elements = std::size_t{1} << 24;

Workload& workload() {
  static std::unique_ptr<Workload> w = [] {
    auto out = std::make_unique<Workload>();
    Workload& wl = *out;
    const std::size_t n = g_elements;
    wl.n = n;
    wl.global = testing::make_global_weights(n, 1, /*on_bf16_grid=*/true);
    wl.local_f32 = LocalWeights(DType::float32, n);
    wl.local_bf16 = LocalWeights(DType::bfloat16, n);
    // e: what an earlier window left behind (its unsent part).
    {
      LocalWeights earlier(DType::float32, n);
      testing::cast_global_into(wl.global, earlier);
      testing::apply_inner_steps(earlier, kInnerLr, 8, 2, kDirectionScale);
      wl.residual.assign(n, 0.0f);
      kernels::commit_residual(GateChunk{.global = wl.global.data(),
                                         .local = earlier.data(),
                                         .local_dtype = DType::float32,
                                         .residual = wl.residual.data(),
                                         .count = n},
                               wl.residual.data());
    }
    testing::cast_global_into(wl.global, wl.local_f32);
    testing::apply_inner_steps(wl.local_f32, kInnerLr, 8, 3, kDirectionScale);
    for (std::size_t i = 0; i < n; ++i)
      wl.local_bf16.set(i, wl.local_f32.get(i));
    testing::FastRandom random(4);
    wl.momentum.resize(n);
    for (float& m : wl.momentum)
      m = 1e-5f * random.normal();
    wl.g.assign(n, 0.0f);
    // Messages: each rank's own gate output on its own θ_l.
    const std::size_t chunks = (n + kChunk - 1) / kChunk;
    wl.offsets.resize(kAggregateRanks);
    wl.values.resize(kAggregateRanks);
    for (int r = 0; r < kAggregateRanks; ++r) {
      LocalWeights rank_local(DType::float32, n);
      testing::cast_global_into(wl.global, rank_local);
      testing::apply_inner_steps(rank_local, kInnerLr, 8, 10 + static_cast<std::uint64_t>(r),
                                 kDirectionScale);
      for (std::size_t c = 0; c < chunks; ++c) {
        const std::uint64_t begin = c * kChunk, count = std::min<std::uint64_t>(kChunk, n - begin);
        std::vector<std::uint32_t> off(count);
        std::vector<float> val(count);
        const auto result =
            kernels::gate(GateChunk{.global = wl.global.data() + begin,
                                    .local = static_cast<const float*>(rank_local.data()) + begin,
                                    .local_dtype = DType::float32,
                                    .residual = wl.residual.data() + begin,
                                    .count = count},
                          off.data(), val.data());
        off.resize(result.fired);
        val.resize(result.fired);
        wl.message_entries += result.fired;
        wl.offsets[r].push_back(std::move(off));
        wl.values[r].push_back(std::move(val));
      }
    }
    for (DType dtype : {DType::float32, DType::bfloat16}) {
      std::vector<std::uint32_t> off(n);
      std::vector<float> val(n);
      const auto result = kernels::gate(GateChunk{.global = wl.global.data(),
                                                  .local = wl.local(dtype).data(),
                                                  .local_dtype = dtype,
                                                  .residual = wl.residual.data(),
                                                  .count = n},
                                        off.data(), val.data());
      (dtype == DType::float32 ? wl.density_f32 : wl.density_bf16) =
          static_cast<double>(result.fired) / static_cast<double>(n);
    }
    wl.copy_src.assign(n * 20, std::byte{1});
    wl.copy_dst.assign(n * 20, std::byte{0});
    return out;
  }();
  return *w;
}

void set_rates(benchmark::State& state, std::size_t elements, double bytes) {
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) *
                          static_cast<std::int64_t>(elements));
  state.SetBytesProcessed(
      static_cast<std::int64_t>(static_cast<double>(state.iterations()) * bytes));
}

// Bytes each kernel reads + writes per element (fp32 state; local weights of `local_bytes`).
double gate_bytes(std::size_t local_bytes) {
  return 8.0 + static_cast<double>(local_bytes);
}
double commit_bytes(std::size_t local_bytes) {
  return 12.0 + static_cast<double>(local_bytes);
}
double outer_bytes(std::size_t local_bytes) {
  return 20.0 + static_cast<double>(local_bytes);
}
double fused_bytes(std::size_t local_bytes) {
  return 32.0 + 2.0 * static_cast<double>(local_bytes);
}

// ---- pulseloco kernels ----------------------------------------------------------------------

// `prefetch` false: the AVX2 gate without its software prefetching (what it gives).
void run_gate(benchmark::State& state, DType dtype, CpuIsa isa, bool prefetch = true) {
  Workload& w = workload();
  const LocalWeights& local = w.local(dtype);
  std::vector<std::uint32_t> offsets(kChunk);
  std::vector<float> values(kChunk);
  std::uint64_t fired = 0;
  for (auto _ : state) {
    fired = 0;
    for (std::uint64_t begin = 0; begin < w.n; begin += kChunk) {
      const std::uint64_t count = std::min<std::uint64_t>(kChunk, w.n - begin);
      const GateChunk chunk{
          .global = w.global.data() + begin,
          .local = static_cast<const char*>(local.data()) + begin * dtype_size(dtype),
          .local_dtype = dtype,
          .residual = w.residual.data() + begin,
          .count = count};
      const auto result = prefetch ? kernels::gate(chunk, offsets.data(), values.data(), isa)
                                   : kernels::detail::gate_avx2_without_prefetch(
                                         chunk, offsets.data(), values.data());
      fired += result.fired;
      benchmark::DoNotOptimize(values.data());
    }
  }
  const double density = static_cast<double>(fired) / static_cast<double>(w.n);
  set_rates(state, w.n, static_cast<double>(w.n) * (gate_bytes(dtype_size(dtype)) + 8.0 * density));
  state.counters["fired_fraction"] = density;
}

void run_gate_threads(benchmark::State& state, DType dtype, CpuIsa isa, std::size_t threads) {
  Workload& w = workload();
  const LocalWeights& local = w.local(dtype);
  ThreadPool pool(threads);
  const std::size_t chunks = (w.n + kChunk - 1) / kChunk;
  std::vector<std::uint32_t> offsets(w.n);
  std::vector<float> values(w.n);
  std::vector<std::uint64_t> fired(chunks);
  for (auto _ : state) {
    pool.parallel_for(chunks, [&](std::size_t c) {
      const std::uint64_t begin = c * kChunk, count = std::min<std::uint64_t>(kChunk, w.n - begin);
      fired[c] = kernels::gate(GateChunk{.global = w.global.data() + begin,
                                         .local = static_cast<const char*>(local.data()) +
                                                  begin * dtype_size(dtype),
                                         .local_dtype = dtype,
                                         .residual = w.residual.data() + begin,
                                         .count = count},
                               offsets.data() + begin, values.data() + begin, isa)
                     .fired;
    });
    benchmark::DoNotOptimize(values.data());
  }
  std::uint64_t total = 0;
  for (auto f : fired)
    total += f;
  const double density = static_cast<double>(total) / static_cast<double>(w.n);
  set_rates(state, w.n, static_cast<double>(w.n) * (gate_bytes(dtype_size(dtype)) + 8.0 * density));
}

void run_commit(benchmark::State& state, DType dtype, CpuIsa isa) {
  Workload& w = workload();
  const LocalWeights& local = w.local(dtype);
  std::vector<float> residual_out(w.n);
  for (auto _ : state) {
    for (std::uint64_t begin = 0; begin < w.n; begin += kChunk) {
      const std::uint64_t count = std::min<std::uint64_t>(kChunk, w.n - begin);
      kernels::commit_residual(
          GateChunk{.global = w.global.data() + begin,
                    .local = static_cast<const char*>(local.data()) + begin * dtype_size(dtype),
                    .local_dtype = dtype,
                    .residual = w.residual.data() + begin,
                    .count = count},
          residual_out.data() + begin, isa);
    }
    benchmark::DoNotOptimize(residual_out.data());
  }
  set_rates(state, w.n, static_cast<double>(w.n) * commit_bytes(dtype_size(dtype)));
}

// Dense traffic of the aggregate: g = 0 (4 B), g /= R (8 B); per entry: read 8 B of message,
// read and write g (8 B).
double aggregate_bytes(const Workload& w) {
  return 12.0 * static_cast<double>(w.n) + 16.0 * static_cast<double>(w.message_entries);
}

void run_aggregate(benchmark::State& state, CpuIsa isa) {
  Workload& w = workload();
  for (auto _ : state) {
    std::size_t c = 0;
    for (std::uint64_t begin = 0; begin < w.n; begin += kChunk, ++c) {
      const std::uint64_t count = std::min<std::uint64_t>(kChunk, w.n - begin);
      SparseEntries entries[kAggregateRanks];
      for (int r = 0; r < kAggregateRanks; ++r)
        entries[r] = SparseEntries{w.offsets[r][c], w.values[r][c]};
      kernels::aggregate(entries, w.g.data() + begin, count, isa);
    }
    benchmark::DoNotOptimize(w.g.data());
  }
  set_rates(state, w.n, aggregate_bytes(w));
  state.counters["entries_per_rank"] =
      static_cast<double>(w.message_entries) / kAggregateRanks / static_cast<double>(w.n);
}

void run_outer(benchmark::State& state, DType dtype, CpuIsa isa) {
  Workload& w = workload();
  // Runs on copies so that repeated steps do not drift the shared workload.
  std::vector<float> global = w.global, momentum = w.momentum;
  LocalWeights local(dtype, w.n);
  for (auto _ : state) {
    for (std::uint64_t begin = 0; begin < w.n; begin += kChunk) {
      const std::uint64_t count = std::min<std::uint64_t>(kChunk, w.n - begin);
      kernels::outer_step(global.data() + begin, momentum.data() + begin, w.g.data() + begin,
                          static_cast<char*>(local.data()) + begin * dtype_size(dtype), dtype,
                          count, kernels::OuterStepParams{}, isa);
    }
    benchmark::DoNotOptimize(global.data());
  }
  set_rates(state, w.n, static_cast<double>(w.n) * outer_bytes(dtype_size(dtype)));
}

void run_fused(benchmark::State& state, DType dtype, CpuIsa isa) {
  Workload& w = workload();
  std::vector<float> global = w.global, momentum = w.momentum, residual = w.residual;
  LocalWeights local = w.local(dtype);
  for (auto _ : state) {
    for (std::uint64_t begin = 0; begin < w.n; begin += kChunk) {
      const std::uint64_t count = std::min<std::uint64_t>(kChunk, w.n - begin);
      kernels::commit_and_outer_step(
          kernels::WindowChunk{
              .global = global.data() + begin,
              .momentum = momentum.data() + begin,
              .residual = residual.data() + begin,
              .local = static_cast<char*>(local.data()) + begin * dtype_size(dtype),
              .local_dtype = dtype,
              .count = count},
          w.g.data() + begin, kernels::OuterStepParams{}, isa);
    }
    benchmark::DoNotOptimize(global.data());
  }
  set_rates(state, w.n, static_cast<double>(w.n) * fused_bytes(dtype_size(dtype)));
}

// A streaming copy moving `bytes_per_element` (read + write) per element: memcpy of half of it.
void run_copy(benchmark::State& state, double bytes_per_element) {
  Workload& w = workload();
  const auto bytes = static_cast<std::size_t>(static_cast<double>(w.n) * bytes_per_element / 2.0);
  for (auto _ : state) {
    std::memcpy(w.copy_dst.data(), w.copy_src.data(), bytes);
    benchmark::DoNotOptimize(w.copy_dst.data());
  }
  set_rates(state, w.n, static_cast<double>(bytes) * 2.0);
}

// The gate's reads alone: θ_g, θ_l and e read side by side as the gate reads them, 8
// elements at a time, and folded by XOR; nothing computed or written. The ceiling of any
// one-pass gate on this machine: its "x libtorch" is the largest speed-up over the libtorch
// reference that a gate reading these bytes once could reach.
template <DType kLocal>
std::uint32_t xor_gate_inputs_portable(const float* global, const void* local,
                                       const float* residual, std::uint64_t count) {
  std::uint32_t x = 0;
  for (std::uint64_t i = 0; i < count; ++i) {
    x ^= std::bit_cast<std::uint32_t>(global[i]) ^ std::bit_cast<std::uint32_t>(residual[i]);
    if constexpr (kLocal == DType::float32) {
      x ^= std::bit_cast<std::uint32_t>(static_cast<const float*>(local)[i]);
    } else {
      x ^= static_cast<const std::uint16_t*>(local)[i];
    }
  }
  return x;
}
#if defined(__x86_64__)
template <DType kLocal>
__attribute__((target("avx2"))) std::uint32_t xor_gate_inputs_avx2(const float* global,
                                                                   const void* local,
                                                                   const float* residual,
                                                                   std::uint64_t count) {
  __m256i x = _mm256_setzero_si256();
  std::uint64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i l =
        kLocal == DType::float32
            ? _mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(static_cast<const float*>(local) + i))
            : _mm256_cvtepu16_epi32(_mm_loadu_si128(
                  reinterpret_cast<const __m128i*>(static_cast<const std::uint16_t*>(local) + i)));
    x = _mm256_xor_si256(
        x, _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(global + i)),
                            _mm256_xor_si256(l, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                                    residual + i)))));
  }
  alignas(32) std::uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x);
  std::uint32_t folded = 0;
  for (std::uint32_t lane : lanes)
    folded ^= lane;
  const auto* local_tail = static_cast<const std::byte*>(local) + i * dtype_size(kLocal);
  return folded ^ xor_gate_inputs_portable<kLocal>(global + i, local_tail, residual + i, count - i);
}
#endif

template <DType kLocal>
std::uint32_t xor_gate_inputs(const float* global, const void* local, const float* residual,
                              std::uint64_t count) {
#if defined(__x86_64__)
  if (cpu_has_avx2()) return xor_gate_inputs_avx2<kLocal>(global, local, residual, count);
#endif
  return xor_gate_inputs_portable<kLocal>(global, local, residual, count);
}

void run_gate_reads_only(benchmark::State& state, DType dtype) {
  Workload& w = workload();
  const LocalWeights& local = w.local(dtype);
  const std::size_t local_bytes = dtype_size(dtype);
  for (auto _ : state) {
    std::uint32_t x = 0;
    for (std::uint64_t begin = 0; begin < w.n; begin += kChunk) {
      const std::uint64_t count = std::min<std::uint64_t>(kChunk, w.n - begin);
      const float* global = w.global.data() + begin;
      const void* local_chunk = static_cast<const char*>(local.data()) + begin * local_bytes;
      const float* residual = w.residual.data() + begin;
      x ^= dtype == DType::float32
               ? xor_gate_inputs<DType::float32>(global, local_chunk, residual, count)
               : xor_gate_inputs<DType::bfloat16>(global, local_chunk, residual, count);
    }
    benchmark::DoNotOptimize(x);
  }
  set_rates(state, w.n, static_cast<double>(w.n) * gate_bytes(local_bytes));
}

// ---- libtorch-ops reference (one libtorch thread) --------------------------------------------

torch::Tensor tensor_of(const std::vector<float>& values) {
  return torch::from_blob(const_cast<float*>(values.data()),
                          {static_cast<std::int64_t>(values.size())}, torch::kFloat32);
}

torch::Tensor tensor_of(const LocalWeights& local) {
  return torch::from_blob(const_cast<void*>(local.data()),
                          {static_cast<std::int64_t>(local.size())},
                          local.dtype() == DType::float32 ? torch::kFloat32 : torch::kBFloat16);
}

// Steps 1-5 as the authors' Python writes them (the sent list only, as our gate).
void torch_gate(benchmark::State& state, DType dtype) {
  at::set_num_threads(1);
  torch::NoGradGuard no_grad;
  Workload& w = workload();
  const torch::Tensor global = tensor_of(w.global), residual = tensor_of(w.residual);
  const torch::Tensor local = tensor_of(w.local(dtype));
  for (auto _ : state) {
    const torch::Tensor delta =
        dtype == DType::float32
            ? global - local
            : global.to(torch::kBFloat16).to(torch::kFloat32) - local.to(torch::kFloat32);
    const torch::Tensor s = residual + delta;
    if (!torch::isfinite(s).all().item<bool>()) state.SkipWithError("non-finite s");
    const torch::Tensor fire = (global - s).to(torch::kBFloat16) != global.to(torch::kBFloat16);
    const torch::Tensor indices = fire.nonzero().squeeze(1);
    const torch::Tensor values = s.masked_select(fire);
    benchmark::DoNotOptimize(indices.data_ptr());
    benchmark::DoNotOptimize(values.data_ptr());
  }
  set_rates(state, w.n, static_cast<double>(w.n) * gate_bytes(dtype_size(dtype)));
}

void torch_commit(benchmark::State& state, DType dtype) {
  at::set_num_threads(1);
  torch::NoGradGuard no_grad;
  Workload& w = workload();
  const torch::Tensor global = tensor_of(w.global), residual = tensor_of(w.residual);
  const torch::Tensor local = tensor_of(w.local(dtype));
  for (auto _ : state) {
    const torch::Tensor delta =
        dtype == DType::float32
            ? global - local
            : global.to(torch::kBFloat16).to(torch::kFloat32) - local.to(torch::kFloat32);
    const torch::Tensor s = residual + delta;
    const torch::Tensor fire = (global - s).to(torch::kBFloat16) != global.to(torch::kBFloat16);
    const torch::Tensor e = torch::where(fire, torch::zeros_like(s), s);
    benchmark::DoNotOptimize(e.data_ptr());
  }
  set_rates(state, w.n, static_cast<double>(w.n) * commit_bytes(dtype_size(dtype)));
}

void torch_aggregate(benchmark::State& state) {
  at::set_num_threads(1);
  torch::NoGradGuard no_grad;
  Workload& w = workload();
  // Each rank's message as one (int64 index, value) pair of tensors over the whole tensor.
  std::vector<torch::Tensor> indices, values;
  for (int r = 0; r < kAggregateRanks; ++r) {
    std::vector<std::int64_t> idx;
    std::vector<float> val;
    for (std::size_t c = 0; c < w.offsets[r].size(); ++c) {
      for (std::size_t k = 0; k < w.offsets[r][c].size(); ++k) {
        idx.push_back(static_cast<std::int64_t>(c * kChunk + w.offsets[r][c][k]));
        val.push_back(w.values[r][c][k]);
      }
    }
    indices.push_back(torch::tensor(idx, torch::kInt64));
    values.push_back(torch::tensor(val, torch::kFloat32));
  }
  for (auto _ : state) {
    torch::Tensor g = torch::zeros({static_cast<std::int64_t>(w.n)}, torch::kFloat32);
    for (int r = 0; r < kAggregateRanks; ++r)
      g.index_add_(0, indices[static_cast<std::size_t>(r)], values[static_cast<std::size_t>(r)]);
    g.div_(kAggregateRanks);
    benchmark::DoNotOptimize(g.data_ptr());
  }
  set_rates(state, w.n, aggregate_bytes(w));
}

void torch_outer(benchmark::State& state, DType dtype) {
  at::set_num_threads(1);
  Workload& w = workload();
  torch::Tensor param = tensor_of(w.global).clone().set_requires_grad(true);
  torch::optim::SGD optimizer({param}, torch::optim::SGDOptions(0.7).momentum(0.9).nesterov(true));
  param.mutable_grad() = tensor_of(w.g).clone();
  optimizer.step();  // the first step only creates the momentum buffer
  for (auto _ : state) {
    optimizer.step();
    torch::NoGradGuard no_grad;
    const torch::Tensor local =
        dtype == DType::float32 ? param.detach().clone() : param.detach().to(torch::kBFloat16);
    benchmark::DoNotOptimize(local.data_ptr());
  }
  set_rates(state, w.n, static_cast<double>(w.n) * outer_bytes(dtype_size(dtype)));
}

// ---- registration and the summary ------------------------------------------------------------

void register_all() {
  std::vector<CpuIsa> isas{CpuIsa::portable};
  if (cpu_has_avx2()) isas.push_back(CpuIsa::avx2);
  const auto name = [](const char* kernel, DType dtype, const char* suffix = "") {
    return fmt::format("{}/{}{}", kernel, dtype == DType::float32 ? "fp32" : "bf16", suffix);
  };
  for (DType dtype : {DType::float32, DType::bfloat16}) {
    const std::size_t local_bytes = dtype_size(dtype);
    for (CpuIsa isa : isas) {
      const std::string suffix = fmt::format("/{}", cpu_isa_name(isa));
      benchmark::RegisterBenchmark(name("gate", dtype, suffix.c_str()).c_str(),
                                   [=](benchmark::State& s) { run_gate(s, dtype, isa); });
      benchmark::RegisterBenchmark(name("commit", dtype, suffix.c_str()).c_str(),
                                   [=](benchmark::State& s) { run_commit(s, dtype, isa); });
      benchmark::RegisterBenchmark(name("outer_step", dtype, suffix.c_str()).c_str(),
                                   [=](benchmark::State& s) { run_outer(s, dtype, isa); });
      benchmark::RegisterBenchmark(name("commit_and_outer_step", dtype, suffix.c_str()).c_str(),
                                   [=](benchmark::State& s) { run_fused(s, dtype, isa); });
    }
    const CpuIsa best = isas.back();
    benchmark::RegisterBenchmark(name("gate", dtype, "/reads_only").c_str(),
                                 [=](benchmark::State& s) { run_gate_reads_only(s, dtype); });
    if (best == CpuIsa::avx2) {
      benchmark::RegisterBenchmark(name("gate", dtype, "/avx2/no_prefetch").c_str(),
                                   [=](benchmark::State& s) { run_gate(s, dtype, best, false); });
    }
    benchmark::RegisterBenchmark(
        name("gate", dtype, fmt::format("/{}/threads:2", cpu_isa_name(best)).c_str()).c_str(),
        [=](benchmark::State& s) { run_gate_threads(s, dtype, best, 2); })
        ->UseRealTime();
    // The gate's bytes include its output: 8 B per fired element.
    benchmark::RegisterBenchmark(name("copy/gate", dtype).c_str(), [=](benchmark::State& s) {
      run_copy(s, gate_bytes(local_bytes) + 8.0 * workload().density(dtype));
    });
    benchmark::RegisterBenchmark(name("copy/commit", dtype).c_str(), [=](benchmark::State& s) {
      run_copy(s, commit_bytes(local_bytes));
    });
    benchmark::RegisterBenchmark(name("copy/outer_step", dtype).c_str(), [=](benchmark::State& s) {
      run_copy(s, outer_bytes(local_bytes));
    });
    benchmark::RegisterBenchmark(
        name("copy/commit_and_outer_step", dtype).c_str(),
        [=](benchmark::State& s) { run_copy(s, fused_bytes(local_bytes)); });
    benchmark::RegisterBenchmark(name("torch/gate", dtype).c_str(),
                                 [=](benchmark::State& s) { torch_gate(s, dtype); });
    benchmark::RegisterBenchmark(name("torch/commit", dtype).c_str(),
                                 [=](benchmark::State& s) { torch_commit(s, dtype); });
    benchmark::RegisterBenchmark(name("torch/outer_step", dtype).c_str(),
                                 [=](benchmark::State& s) { torch_outer(s, dtype); });
  }
  for (CpuIsa isa : isas) {
    benchmark::RegisterBenchmark(
        fmt::format("aggregate/r{}/{}", kAggregateRanks, cpu_isa_name(isa)).c_str(),
        [=](benchmark::State& s) { run_aggregate(s, isa); });
  }
  benchmark::RegisterBenchmark(fmt::format("copy/aggregate/r{}", kAggregateRanks).c_str(),
                               [](benchmark::State& s) {
                                 const Workload& w = workload();
                                 run_copy(s, aggregate_bytes(w) / static_cast<double>(w.n));
                               });
  benchmark::RegisterBenchmark(fmt::format("torch/aggregate/r{}", kAggregateRanks).c_str(),
                               [](benchmark::State& s) { torch_aggregate(s); });
}

}  // namespace
}  // namespace pulseloco::bench

int main(int argc, char** argv) {
  // --elements=N (default 2^24) before Google Benchmark sees the flags.
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.starts_with("--elements=")) {
      pulseloco::bench::g_elements = std::stoull(arg.substr(11));
    } else {
      args.push_back(argv[i]);
    }
  }
  int count = static_cast<int>(args.size());
  benchmark::Initialize(&count, args.data());
  if (benchmark::ReportUnrecognizedArguments(count, args.data())) return 1;
  pulseloco::bench::register_all();
  pulseloco::bench::SummaryReporter reporter(
      "one thread unless noted; 'of copy' = kernel bytes/s / copy bytes/s");
  benchmark::RunSpecifiedBenchmarks(&reporter);
  benchmark::Shutdown();
  return 0;
}
