// The training example's weights as a trainer would publish them (bench/bench_patches.cpp): the
// example model (examples/train) loaded from its pretrained checkpoint, post-trained on one
// worker with AdamW (fp32 master weights) on the post-training mix, θ taken after every window
// of H steps. Built only with libtorch and the examples.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace pulseloco::bench {

struct ExampleRunOptions {
  double lr = 3e-6;
  int windows = 6;
  int steps_per_window = 8;  // H
  int batch_size = 4;        // pulseloco_train's default
  int pretrain_steps = 200;  // the example's default (a cached checkpoint when present)
  std::filesystem::path cache_dir;
  int threads = 2;  // libtorch's
};

// One version: every parameter's fp32 values, in the model's parameter order.
struct ExampleVersion {
  std::vector<std::vector<float>> tensors;
};

struct ExampleRun {
  std::string model;  // the model config's description
  std::vector<std::string> names;
  std::vector<std::vector<std::uint64_t>> shapes;
  std::vector<ExampleVersion> versions;  // the pretrained weights, then after each window
};

[[nodiscard]] ExampleRun run_example(const ExampleRunOptions& options);

}  // namespace pulseloco::bench
