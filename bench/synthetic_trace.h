// A synthetic PULSELoCo training trace: the window messages a real run would produce, without a
// model. Reused by the codec benchmark (bench/bench_codec.cpp) and by later payload studies.
//
// What it simulates (settings in TraceConfig; docs/benchmarks.md, "Synthetic training trace"):
//   - a transformer-like list of tensors; matrices start as N(0, std) weights with std drawn
//     per tensor from [0.02, 0.03] and rounded to the bf16 grid, norm weights start at 1.0;
//   - R workers, each running H AdamW steps (PyTorch semantics, fp32 local weights) per window
//     on gradients g = mu_i + sigma * xi: a persistent per-element mean mu_i ~ N(0, signal_std^2)
//     plus fresh noise xi ~ N(0, 1) every step (Irwin-Hall approximation, 4 uniforms);
//   - at every window boundary the real window kernels of kernels/window_kernels.h: gate()
//     per chunk (the message entries), commit_residual() (the residual carried to the next
//     window), aggregate() over all workers in rank order, outer_step() (Nesterov) and the
//     reset of the local weights.
// Deterministic: the same config gives the same bits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pulseloco::bench {

struct TraceTensor {
  std::string name;
  std::uint64_t numel = 0;
  float init_std = 0.0f;  // 0: a norm weight, initialised to 1.0
};

// Tensors of `layers` transformer blocks of width `dim`: q, k, v, o (dim x dim), MLP up and
// down (dim x 4 dim) and two norms (dim) per block.
[[nodiscard]] std::vector<TraceTensor> transformer_tensors(std::uint64_t dim, int layers,
                                                           std::uint64_t seed);

struct TraceConfig {
  std::vector<TraceTensor> tensors = transformer_tensors(512, 3, 1);
  int workers = 2;
  int inner_steps = 8;  // H
  float lr = 3e-6f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  // Gradient model, per element i and inner step t:
  //   g = c_t * a_i * (signal * mu_i + noise * xi_it)
  // a_i = grad_rms_median * exp(grad_rms_log_sigma * z_i): a persistent per-element gradient
  //   scale, log-normal across elements (LLM gradients span decades; elements whose gradients
  //   sit below Adam's eps barely move, which is what makes most updates invisible in bf16);
  // mu_i, z_i ~ N(0, 1) persistent; xi_it ~ N(0, 1) fresh every step (Irwin-Hall, 4 uniforms);
  // c_t = exp(scale_sigma * z_t): one factor per step and worker (RL batches differ in norm).
  // grad_rms_median is calibrated so that rank 0 fires about 1.4% of the elements per window,
  // the paper's 98.6% sparsity for 8 steps at lr 3e-6 (docs/benchmarks.md).
  float grad_rms_median = 4e-10f;
  float grad_rms_log_sigma = 2.0f;
  float signal = 0.3f;
  float noise = 0.954f;
  float scale_sigma = 0.5f;
  float outer_lr = 0.7f;
  float outer_momentum = 0.9f;
  std::uint64_t chunk_elements = std::uint64_t{1} << 20;
  std::uint64_t seed = 1;
};

// One chunk's gate output for one worker.
struct ChunkEntries {
  std::uint32_t tensor = 0;
  std::uint64_t begin = 0;
  std::uint64_t length = 0;
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
};

struct WindowMessages {
  std::uint64_t window = 0;
  // [worker][chunk], chunks in (tensor, begin) order; every chunk present, even when empty.
  std::vector<std::vector<ChunkEntries>> workers;

  [[nodiscard]] std::uint64_t entries(int worker) const;
};

class SyntheticTrainer {
 public:
  explicit SyntheticTrainer(TraceConfig config);
  ~SyntheticTrainer();
  SyntheticTrainer(const SyntheticTrainer&) = delete;
  SyntheticTrainer& operator=(const SyntheticTrainer&) = delete;

  // Runs one window (inner steps, gate, commit, aggregate, outer step, reset) and returns
  // every worker's message entries.
  [[nodiscard]] WindowMessages run_window();

  [[nodiscard]] const TraceConfig& config() const noexcept { return config_; }
  [[nodiscard]] std::uint64_t total_elements() const noexcept { return total_elements_; }

 private:
  struct Worker;
  void inner_steps(Worker& worker);

  TraceConfig config_;
  std::uint64_t total_elements_ = 0;
  std::vector<float> global_;         // θ_g
  std::vector<float> momentum_;       // outer m
  std::vector<float> g_;              // aggregate buffer
  std::vector<float> element_scale_;  // exp(grad_rms_log_sigma * z_i)
  std::vector<Worker> workers_;
  std::uint64_t window_ = 0;
  std::uint64_t adam_step_ = 0;
};

}  // namespace pulseloco::bench
