// Internal: one pulse window's device phases against the device's copy bandwidth, and the same
// window with the state in host memory (bench_window_cuda.cpp).
#pragma once

#include <cstdint>

namespace pulseloco::bench {

struct WindowBenchOptions {
  std::uint64_t elements = 250'000'000;  // parameters of the model
  int repetitions = 5;                   // timed windows per mode and dtype (the median is kept)
  int host_threads = 0;                  // CPU kernels' threads in host mode; 0: all cores
  bool host_staging = true;              // also run the window with the state in host memory
  bool json = false;                     // JSON lines instead of the table
};

// Prints the results (a table, or one JSON record per line) and returns the exit status: 0 when
// it ran or when there is no CUDA device (it says so), 1 when a CUDA call or a kernel failed.
[[nodiscard]] int run_window_bench(const WindowBenchOptions& options);

}  // namespace pulseloco::bench
