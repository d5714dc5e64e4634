// xxh3-64 throughput: libxxhash's baseline build against the AVX2 build of the same header
// (src/base/digest_avx2.cpp), in cache (256 KiB, 1 MiB) and from memory (64 MiB).
//   build/bin/pulseloco_bench_digest
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include <pulseloco/base/cpu_features.h>
#include <pulseloco/base/digest_dispatch.h>

namespace {

std::vector<std::uint8_t> inputs(std::size_t n) {
  std::vector<std::uint8_t> bytes(n);
  for (std::size_t i = 0; i < n; ++i)
    bytes[i] = static_cast<std::uint8_t>(i * 131 + 7);
  return bytes;
}

template <typename Hash>
void run(benchmark::State& state, Hash hash) {
  const auto bytes = inputs(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state)
    benchmark::DoNotOptimize(hash(bytes.data(), bytes.size()));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes.size()));
}

void BM_Xxh3Libxxhash(benchmark::State& state) {
  run(state, pulseloco::detail::xxh3_baseline);
}

void BM_Xxh3Avx2(benchmark::State& state) {
#if PULSELOCO_DIGEST_HAS_AVX2
  if (!pulseloco::cpu_has_avx2()) {
    state.SkipWithError("this CPU has no AVX2");
    return;
  }
  run(state, pulseloco::detail::xxh3_avx2);
#else
  state.SkipWithError("built without the AVX2 xxh3");
#endif
}

BENCHMARK(BM_Xxh3Libxxhash)->Arg(256 << 10)->Arg(1 << 20)->Arg(64 << 20);
BENCHMARK(BM_Xxh3Avx2)->Arg(256 << 10)->Arg(1 << 20)->Arg(64 << 20);

}  // namespace
