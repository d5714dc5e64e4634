// Peak memory of one window: runs gate -> aggregate -> commit + outer
// step + reset -> digest over a whole model chunk by chunk with pulseloco's CPU kernels, and
// compares the process's peak resident set (VmHWM) with the bytes of the state and the message.
//
//   build/bin/pulseloco_bench_window_memory [--parameters=250000000] [--local=fp32|bf16]
//       [--chunk=1048576] [--ranks=1] [--threads=1] [--limit-mib=64]
//
// The state (θ_g, m, e fp32 and θ_l) is allocated and filled first; the message is what the gate
// sends (offset + value, 8 B per entry, kept per chunk as the encoder would see it) plus, with
// --ranks=R > 1, R - 1 received messages of the same size. Everything else the window needs is
// per-chunk scratch (gate output, aggregate), one set per thread. Exit status 1 when
// peak - state - message exceeds --limit-mib (the process's own baseline included).
#include <sys/resource.h>

#include <fmt/format.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/kernels/window_kernels.h>
#include "tests/kernels/window_test_inputs.h"

namespace {

using namespace pulseloco;

// kB value of a "Name:   123 kB" line of /proc/self/status, or 0.
std::uint64_t proc_status_kib(const std::string& name) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(name + ":", 0) == 0)
      return std::strtoull(line.c_str() + name.size() + 1, nullptr, 10);
  }
  return 0;
}

double mib(std::uint64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

struct Options {
  std::uint64_t parameters = 250'000'000;
  DType local_dtype = DType::float32;
  std::uint64_t chunk = std::uint64_t{1} << 20;
  int ranks = 1;
  std::size_t threads = 1;
  double limit_mib = 64.0;
};

Options parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&](const char* prefix) -> const char* {
      return arg.rfind(prefix, 0) == 0 ? arg.c_str() + std::string(prefix).size() : nullptr;
    };
    if (const char* v = value("--parameters=")) {
      options.parameters = static_cast<std::uint64_t>(std::strtod(v, nullptr));
      continue;
    }
    if (const char* v = value("--local=")) {
      const std::string dtype = v;
      if (dtype != "fp32" && dtype != "bf16")
        throw std::invalid_argument("--local must be fp32 or bf16");
      options.local_dtype = dtype == "fp32" ? DType::float32 : DType::bfloat16;
      continue;
    }
    if (const char* v = value("--chunk=")) {
      options.chunk = std::strtoull(v, nullptr, 10);
      continue;
    }
    if (const char* v = value("--ranks=")) {
      options.ranks = std::atoi(v);
      continue;
    }
    if (const char* v = value("--threads=")) {
      options.threads = std::strtoull(v, nullptr, 10);
      continue;
    }
    if (const char* v = value("--limit-mib=")) {
      options.limit_mib = std::strtod(v, nullptr);
      continue;
    }
    throw std::invalid_argument("unknown argument '" + arg +
                                "' (see the comment at the top of bench_window_memory.cpp)");
  }
  if (options.chunk == 0 || options.chunk > kernels::kMaxChunkElements)
    throw std::invalid_argument("--chunk must be in 1..2^31");
  if (options.ranks < 1) throw std::invalid_argument("--ranks must be at least 1");
  if (options.threads < 1) throw std::invalid_argument("--threads must be at least 1");
  return options;
}

// One chunk's share of the message.
struct ChunkMessage {
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
};

int run(const Options& o) {
  const std::uint64_t baseline_kib = proc_status_kib("VmRSS");
  const std::uint64_t n = o.parameters;
  const std::size_t local_size = dtype_size(o.local_dtype);
  const std::uint64_t chunks = (n + o.chunk - 1) / o.chunk;

  // The state, filled chunk by chunk: θ_g ~ N(0, 0.02) on the bf16 grid, θ_l moved by 8
  // AdamW-like steps at lr 3e-6, e from nothing, m after one earlier outer step.
  const auto global = std::make_unique_for_overwrite<float[]>(n);
  const auto momentum = std::make_unique_for_overwrite<float[]>(n);
  const auto residual = std::make_unique_for_overwrite<float[]>(n);
  const auto local = std::make_unique_for_overwrite<std::byte[]>(n * local_size);
  const std::uint64_t state_bytes = n * (12 + local_size);
  ThreadPool pool(o.threads);
  const auto ranges = [&](auto&& per_chunk) {
    // Contiguous ranges of chunks, one per thread, each with its own scratch.
    pool.parallel_for(o.threads, [&](std::size_t t) {
      const std::uint64_t first = chunks * t / o.threads, last = chunks * (t + 1) / o.threads;
      per_chunk(first, last);
    });
  };
  ranges([&](std::uint64_t first, std::uint64_t last) {
    for (std::uint64_t c = first; c < last; ++c) {
      const std::uint64_t begin = c * o.chunk, count = std::min(o.chunk, n - begin);
      testing::FastRandom random(c + 1);
      for (std::uint64_t i = begin; i < begin + count; ++i) {
        global[i] = round_to_bf16(0.02f * random.normal());
        const float direction = 0.08f * random.normal();
        float value = global[i];
        for (int step = 0; step < 8; ++step)
          value = value - 3e-6f * (direction + 0.1f * value);
        if (o.local_dtype == DType::float32) {
          reinterpret_cast<float*>(local.get())[i] = value;
        } else {
          reinterpret_cast<std::uint16_t*>(local.get())[i] = float_to_bf16_bits(value);
        }
        residual[i] = 0.0f;
        momentum[i] = 1e-5f * random.normal();
      }
    }
  });
  const std::uint64_t after_state_kib = proc_status_kib("VmRSS");

  // Gate: each chunk's fired entries go into the message, exactly sized.
  std::vector<ChunkMessage> message(chunks);
  ranges([&](std::uint64_t first, std::uint64_t last) {
    std::vector<std::uint32_t> offsets(o.chunk);
    std::vector<float> values(o.chunk);
    for (std::uint64_t c = first; c < last; ++c) {
      const std::uint64_t begin = c * o.chunk, count = std::min(o.chunk, n - begin);
      const kernels::GateChunk chunk{.global = global.get() + begin,
                                     .local = local.get() + begin * local_size,
                                     .local_dtype = o.local_dtype,
                                     .residual = residual.get() + begin,
                                     .count = count};
      const kernels::GateResult result = kernels::gate(chunk, offsets.data(), values.data());
      kernels::check_finite(result, "model", begin);
      const auto fired = static_cast<std::ptrdiff_t>(result.fired);
      message[c].offsets.assign(offsets.begin(), offsets.begin() + fired);
      message[c].values.assign(values.begin(), values.begin() + fired);
    }
  });
  std::uint64_t entries = 0;
  for (const ChunkMessage& m : message)
    entries += m.offsets.size();
  // The other ranks' messages (copies of ours: the same size, which is what memory sees).
  std::vector<std::vector<ChunkMessage>> received(static_cast<std::size_t>(o.ranks - 1), message);
  const std::uint64_t message_bytes = entries * 8 * static_cast<std::uint64_t>(o.ranks);

  // Aggregate, then commit + outer step + reset, chunk by chunk.
  ranges([&](std::uint64_t first, std::uint64_t last) {
    std::vector<float> g(o.chunk);
    std::vector<kernels::SparseEntries> ranks(static_cast<std::size_t>(o.ranks));
    for (std::uint64_t c = first; c < last; ++c) {
      const std::uint64_t begin = c * o.chunk, count = std::min(o.chunk, n - begin);
      ranks[0] = {message[c].offsets, message[c].values};
      for (std::size_t r = 1; r < ranks.size(); ++r)
        ranks[r] = {received[r - 1][c].offsets, received[r - 1][c].values};
      kernels::aggregate(ranks, g.data(), count);
      kernels::commit_and_outer_step(kernels::WindowChunk{.global = global.get() + begin,
                                                          .momentum = momentum.get() + begin,
                                                          .residual = residual.get() + begin,
                                                          .local = local.get() + begin * local_size,
                                                          .local_dtype = o.local_dtype,
                                                          .count = count},
                                     g.data(), kernels::OuterStepParams{});
    }
  });
  const Digest digest = kernels::state_digest(std::span<const float>(global.get(), n),
                                              std::span<const float>(momentum.get(), n));

  const std::uint64_t peak_kib = proc_status_kib("VmHWM");
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const std::uint64_t peak_bytes = peak_kib * 1024;
  const double overhead_mib = mib(peak_bytes) - mib(state_bytes) - mib(message_bytes);
  fmt::print(
      "one window over {} parameters ({} local weights, chunks of {}, {} rank(s), {} thread(s))\n",
      n, dtype_name(o.local_dtype), o.chunk, o.ranks, o.threads);
  fmt::print("  state (θ_g, m, e fp32 + θ_l)   {:10.1f} MiB\n", mib(state_bytes));
  fmt::print("  message ({} entries x 8 B x {} rank(s), {:.2f}% of elements fired)  {:10.1f} MiB\n",
             entries, o.ranks, 100.0 * static_cast<double>(entries) / static_cast<double>(n),
             mib(message_bytes));
  fmt::print("  RSS before the state           {:10.1f} MiB (process baseline)\n",
             baseline_kib / 1024.0);
  fmt::print("  RSS after filling the state    {:10.1f} MiB\n", after_state_kib / 1024.0);
  fmt::print("  peak RSS (VmHWM)               {:10.1f} MiB (ru_maxrss {:.1f} MiB)\n",
             peak_kib / 1024.0, static_cast<double>(usage.ru_maxrss) / 1024.0);
  fmt::print(
      "  peak - state - message         {:10.1f} MiB (limit {:.0f} MiB, baseline included)\n",
      overhead_mib, o.limit_mib);
  fmt::print("  state digest {}\n", digest_hex(digest));
  const bool ok = overhead_mib <= o.limit_mib;
  fmt::print("{}\n",
             ok ? "PASS" : "FAIL: the window used more memory than state + message + limit");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& error) {
    fmt::print(stderr, "pulseloco_bench_window_memory: {}\n", error.what());
    return 2;
  }
}
