// A C++ rank of the mixed C++/Python group test (tests/python/test_mixed_group.py): the same
// parameters and per-step updates as tests/python/mixed_worker.py, on the engine and a group
// formed from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, PULSELOCO_*). No
// libtorch.
//
//   pulseloco_python_mixed_worker --mode pulse --windows 4 -H 2 --fp32 5000 --bf16 3001
//
// Prints one line per window: "window W digest HEX identical 0|1". Exit status 0, or 1 with
// the error on stderr.
//
// The updates are exact in both languages: an update is a small integer times a power of two,
// so the product is exact and each element's new value is one IEEE float32 addition (then, for
// bf16, float_to_bf16_bits' round to nearest even), which NumPy computes bit for bit alike.
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/group/make_transport.h>

namespace {

using namespace pulseloco;

// The formulas of mixed_worker.py, term for term.
float initial_fp32(std::uint64_t i) {
  return static_cast<float>(static_cast<std::int64_t>((i * 37) % 101) - 50) * 0x1p-8f;
}
float initial_bf16(std::uint64_t i) {
  return static_cast<float>(static_cast<std::int64_t>((i * 53) % 61) - 30) * 0x1p-6f;
}
float update_fp32(std::uint64_t rank, std::uint64_t step, std::uint64_t i) {
  return static_cast<float>(static_cast<std::int64_t>((rank * 131 + step * 31 + i * 7) % 17) - 8) *
         0x1p-15f;
}
float update_bf16(std::uint64_t rank, std::uint64_t step, std::uint64_t i) {
  return static_cast<float>(static_cast<std::int64_t>((rank * 29 + step * 13 + i * 11) % 23) - 11) *
         0x1p-9f;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pulseloco mixed C++/Python group test worker"};
  std::string mode = "pulse";
  std::uint64_t windows = 4;
  std::uint32_t steps = 2;
  std::uint64_t fp32_elements = 5000;
  std::uint64_t bf16_elements = 3001;
  int timeout_ms = 30'000;
  app.add_option("--mode", mode, "pulse or diloco");
  app.add_option("--windows", windows, "windows to run");
  app.add_option("-H", steps, "inner steps per window");
  app.add_option("--fp32", fp32_elements, "elements of the fp32 tensor \"w\"");
  app.add_option("--bf16", bf16_elements, "elements of the bf16 tensor \"h\"");
  app.add_option("--timeout-ms", timeout_ms, "every collective's timeout");
  CLI11_PARSE(app, argc, argv);

  try {
    std::vector<float> w(fp32_elements);
    std::vector<std::uint16_t> h(bf16_elements);
    for (std::uint64_t i = 0; i < w.size(); ++i)
      w[i] = initial_fp32(i);
    for (std::uint64_t i = 0; i < h.size(); ++i)
      h[i] = float_to_bf16_bits(initial_bf16(i));

    EngineOptions options;
    options.mode = parse_mode(mode);
    options.steps_per_window = steps;
    options.chunk_elements = 2048;
    options.bucket_elements = 4096;
    options.threads = 1;
    options.timeout = std::chrono::milliseconds(timeout_ms);
    std::vector<NamedTensor> parameters{
        {"w", TensorView{w.data(), w.size(), DType::float32, Device{}}, {}},
        {"h", TensorView{h.data(), h.size(), DType::bfloat16, Device{}}, {}},
    };
    Engine engine(std::move(parameters), options, group::make_transport(group::from_environment()));
    const auto rank = static_cast<std::uint64_t>(engine.rank());

    for (std::uint64_t step = 0; engine.committed_windows() < windows; ++step) {
      for (std::uint64_t i = 0; i < w.size(); ++i)
        w[i] += update_fp32(rank, step, i);
      for (std::uint64_t i = 0; i < h.size(); ++i)
        h[i] = float_to_bf16_bits(bf16_bits_to_float(h[i]) + update_bf16(rank, step, i));
      if (auto report = engine.after_optimizer_step())
        std::cout << fmt::format("window {} digest {:016x} identical {}\n", report->window,
                                 report->digest, report->replicas_identical ? 1 : 0)
                  << std::flush;
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "pulseloco_python_mixed_worker: " << e.what() << '\n';
    return 1;
  }
}
