// fp32 -> bf16 conversion throughput: portable loop, AVX2 and a streaming copy of the same bytes.
//   build/bin/pulseloco_bench_bf16
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/cpu_features.h>

namespace {

std::vector<float> inputs(std::size_t n) {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> values(n);
  for (auto& v : values)
    v = normal(rng);
  return values;
}

void report(benchmark::State& state, std::size_t n) {
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * 6));
}

void BM_Fp32ToBf16Portable(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto src = inputs(n);
  std::vector<std::uint16_t> dst(n);
  for (auto _ : state) {
    pulseloco::bf16_impl::float_to_bf16_portable(src.data(), dst.data(), n);
    benchmark::DoNotOptimize(dst.data());
  }
  report(state, n);
}

void BM_Fp32ToBf16Avx2(benchmark::State& state) {
  if (!pulseloco::cpu_has_avx2()) {
    state.SkipWithError("CPU lacks AVX2");
    return;
  }
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto src = inputs(n);
  std::vector<std::uint16_t> dst(n);
  for (auto _ : state) {
    pulseloco::bf16_impl::float_to_bf16_avx2(src.data(), dst.data(), n);
    benchmark::DoNotOptimize(dst.data());
  }
  report(state, n);
}

// Reads 4 bytes and writes 2 bytes per element, like the conversion: the bandwidth baseline.
void BM_StreamingCopySameBytes(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const auto src = inputs(n);
  std::vector<float> dst(n / 2 + 1);
  std::vector<float> sink(n);
  for (auto _ : state) {
    std::memcpy(sink.data(), src.data(), n * sizeof(float));
    benchmark::DoNotOptimize(sink.data());
    std::memcpy(dst.data(), src.data(), n / 2 * sizeof(float));
    benchmark::DoNotOptimize(dst.data());
  }
  report(state, n);
}

}  // namespace

BENCHMARK(BM_Fp32ToBf16Portable)->Arg(1 << 16)->Arg(1 << 24);
BENCHMARK(BM_Fp32ToBf16Avx2)->Arg(1 << 16)->Arg(1 << 24);
BENCHMARK(BM_StreamingCopySameBytes)->Arg(1 << 16)->Arg(1 << 24);
