#include "synthetic_trace.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

#include <pulseloco/base/bf16.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::bench {
namespace {

[[nodiscard]] std::uint64_t splitmix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A standard normal variate from 64 random bits: the Irwin-Hall sum of four 16-bit uniforms,
// centred and scaled to unit variance (support +-3.46; plenty for a gradient-noise model).
[[nodiscard]] float normal_from_bits(std::uint64_t bits) noexcept {
  const auto u0 = static_cast<float>(bits & 0xFFFF);
  const auto u1 = static_cast<float>((bits >> 16) & 0xFFFF);
  const auto u2 = static_cast<float>((bits >> 32) & 0xFFFF);
  const auto u3 = static_cast<float>(bits >> 48);
  constexpr float kScale = 1.7320508f / 65536.0f;  // sqrt(3) / 2^16
  return ((u0 + u1) + (u2 + u3) - 2.0f * 65535.0f) * kScale;
}

[[nodiscard]] float normal(std::uint64_t stream, std::uint64_t index) noexcept {
  return normal_from_bits(splitmix64(stream ^ splitmix64(index)));
}

}  // namespace

std::uint64_t WindowMessages::entries(int worker) const {
  std::uint64_t total = 0;
  for (const auto& chunk : workers.at(static_cast<std::size_t>(worker))) {
    total += chunk.offsets.size();
  }
  return total;
}

std::vector<TraceTensor> transformer_tensors(std::uint64_t dim, int layers, std::uint64_t seed) {
  std::vector<TraceTensor> tensors;
  std::uint64_t draw = splitmix64(seed ^ 0x7E45);
  const auto init_std = [&] {
    draw = splitmix64(draw);
    return 0.02f + 0.01f * static_cast<float>(draw >> 40) / static_cast<float>(1u << 24);
  };
  for (int layer = 0; layer < layers; ++layer) {
    const std::string prefix = "layers." + std::to_string(layer) + ".";
    tensors.push_back({prefix + "input_norm.weight", dim, 0.0f});
    for (const char* name : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
      tensors.push_back({prefix + "attn." + name + ".weight", dim * dim, init_std()});
    }
    tensors.push_back({prefix + "post_norm.weight", dim, 0.0f});
    tensors.push_back({prefix + "mlp.up_proj.weight", 4 * dim * dim, init_std()});
    tensors.push_back({prefix + "mlp.down_proj.weight", 4 * dim * dim, init_std()});
  }
  return tensors;
}

struct SyntheticTrainer::Worker {
  std::vector<float> local;     // θ_l (fp32)
  std::vector<float> residual;  // e
  std::vector<float> adam_m;
  std::vector<float> adam_v;
  std::uint64_t noise_stream = 0;
};

SyntheticTrainer::SyntheticTrainer(TraceConfig config) : config_(std::move(config)) {
  if (config_.workers < 1 || config_.inner_steps < 1 || config_.chunk_elements == 0 ||
      config_.chunk_elements > kernels::kMaxChunkElements) {
    throw std::invalid_argument("SyntheticTrainer: invalid configuration");
  }
  for (const auto& tensor : config_.tensors)
    total_elements_ += tensor.numel;
  global_.resize(total_elements_);
  momentum_.assign(total_elements_, 0.0f);
  g_.resize(total_elements_);
  element_scale_.resize(total_elements_);
  const std::uint64_t rms_stream = splitmix64(config_.seed ^ 0x7235);
  for (std::uint64_t i = 0; i < total_elements_; ++i) {
    element_scale_[i] = std::exp(config_.grad_rms_log_sigma * normal(rms_stream, i));
  }
  std::uint64_t base = 0;
  for (std::size_t t = 0; t < config_.tensors.size(); ++t) {
    const auto& tensor = config_.tensors[t];
    const std::uint64_t stream = splitmix64(config_.seed ^ (0x1000 + t));
    for (std::uint64_t i = 0; i < tensor.numel; ++i) {
      // Initial weights on the bf16 grid, as a bf16 checkpoint loaded into fp32.
      global_[base + i] =
          tensor.init_std == 0.0f ? 1.0f : round_to_bf16(tensor.init_std * normal(stream, i));
    }
    base += tensor.numel;
  }
  workers_.resize(static_cast<std::size_t>(config_.workers));
  for (std::size_t r = 0; r < workers_.size(); ++r) {
    Worker& worker = workers_[r];
    worker.local = global_;
    worker.residual.assign(total_elements_, 0.0f);
    worker.adam_m.assign(total_elements_, 0.0f);
    worker.adam_v.assign(total_elements_, 0.0f);
    worker.noise_stream = splitmix64(config_.seed ^ (0xA000 + r));
  }
}

SyntheticTrainer::~SyntheticTrainer() = default;

void SyntheticTrainer::inner_steps(Worker& worker) {
  const float lr = config_.lr;
  const float beta1 = config_.beta1;
  const float beta2 = config_.beta2;
  const std::uint64_t mu_stream = splitmix64(config_.seed ^ 0x5157);
  for (int h = 0; h < config_.inner_steps; ++h) {
    const std::uint64_t step = adam_step_ + static_cast<std::uint64_t>(h) + 1;
    // PyTorch AdamW (foreach=False): decay, moments, bias corrections, then the step.
    const float decay = 1.0f - lr * config_.weight_decay;
    const auto t = static_cast<double>(step);
    const auto bias1 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), t));
    const auto bias2_sqrt =
        static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(beta2), t)));
    const float step_size = lr / bias1;
    const std::uint64_t noise = splitmix64(worker.noise_stream ^ step);
    const float scale = config_.grad_rms_median *
                        std::exp(config_.scale_sigma * normal(worker.noise_stream, ~step));
    float* local = worker.local.data();
    float* m = worker.adam_m.data();
    float* v = worker.adam_v.data();
    for (std::uint64_t i = 0; i < total_elements_; ++i) {
      const float rms = scale * element_scale_[i];
      const float grad =
          rms * (config_.signal * normal(mu_stream, i) + config_.noise * normal(noise, i));
      local[i] = local[i] * decay;
      m[i] = beta1 * m[i] + (1.0f - beta1) * grad;
      v[i] = beta2 * v[i] + (1.0f - beta2) * grad * grad;
      const float denom = std::sqrt(v[i]) / bias2_sqrt + config_.eps;
      local[i] = local[i] - step_size * (m[i] / denom);
    }
  }
}

WindowMessages SyntheticTrainer::run_window() {
  for (Worker& worker : workers_)
    inner_steps(worker);
  adam_step_ += static_cast<std::uint64_t>(config_.inner_steps);

  WindowMessages messages;
  messages.window = window_;
  messages.workers.resize(workers_.size());
  std::vector<std::uint32_t> offsets(config_.chunk_elements);
  std::vector<float> values(config_.chunk_elements);
  std::uint64_t base = 0;
  for (std::size_t t = 0; t < config_.tensors.size(); ++t) {
    const std::uint64_t numel = config_.tensors[t].numel;
    for (std::uint64_t begin = 0; begin < numel; begin += config_.chunk_elements) {
      const std::uint64_t length = std::min(config_.chunk_elements, numel - begin);
      const std::uint64_t at = base + begin;
      std::vector<kernels::SparseEntries> per_rank;
      for (std::size_t r = 0; r < workers_.size(); ++r) {
        Worker& worker = workers_[r];
        const kernels::GateChunk chunk{.global = global_.data() + at,
                                       .local = worker.local.data() + at,
                                       .local_dtype = DType::float32,
                                       .residual = worker.residual.data() + at,
                                       .count = length};
        const kernels::GateResult result = kernels::gate(chunk, offsets.data(), values.data());
        if (result.non_finite_offset) {
          throw std::runtime_error("synthetic trace diverged at tensor " + config_.tensors[t].name);
        }
        ChunkEntries entries;
        entries.tensor = static_cast<std::uint32_t>(t);
        entries.begin = begin;
        entries.length = length;
        entries.offsets.assign(offsets.begin(),
                               offsets.begin() + static_cast<std::ptrdiff_t>(result.fired));
        entries.values.assign(values.begin(),
                              values.begin() + static_cast<std::ptrdiff_t>(result.fired));
        kernels::commit_residual(chunk, worker.residual.data() + at);
        messages.workers[r].push_back(std::move(entries));
      }
      for (std::size_t r = 0; r < workers_.size(); ++r) {
        const ChunkEntries& entries = messages.workers[r].back();
        per_rank.push_back({entries.offsets, entries.values});
      }
      kernels::aggregate(per_rank, g_.data() + at, length);
      // Every worker resets θ_l to the same θ_g; the first worker's buffer carries the step's
      // output and the others copy it.
      kernels::outer_step(
          global_.data() + at, momentum_.data() + at, g_.data() + at, workers_[0].local.data() + at,
          DType::float32, length,
          {.lr = config_.outer_lr, .momentum = config_.outer_momentum, .first_step = window_ == 0});
      for (std::size_t r = 1; r < workers_.size(); ++r) {
        std::copy_n(workers_[0].local.data() + at, length, workers_[r].local.data() + at);
      }
    }
    base += numel;
  }
  ++window_;
  return messages;
}

}  // namespace pulseloco::bench
