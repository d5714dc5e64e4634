// Training the example model: the inner optimizer (AdamW), the pretraining phase with its
// cached checkpoint, weight files, and the bf16 update-sparsity measurement.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <torch/optim/optimizer.h>

#include <pulseloco/io/safetensors.h>
#include "model.h"
#include "task.h"

namespace pulseloco::example {

// AdamW as PyTorch's torch.optim.AdamW (decoupled weight decay), fp32 master weights.
struct OptimizerSettings {
  double lr = 3e-6;  // the RL-like post-training default
  double beta1 = 0.9;
  double beta2 = 0.95;
  double weight_decay = 0.1;
  double eps = 1e-8;
  double clip_grad_norm = 1.0;  // <= 0: no clipping
};

// One model's optimizer. step() = forward_backward() + optimizer_step(); the split lets a
// caller act on the gradients in between (e.g. DDP all-reduces them).
class Trainer {
 public:
  Trainer(TransformerLM& model, const OptimizerSettings& settings);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Zeroes the gradients, computes the loss of `batch` and its gradients; returns the loss.
  double forward_backward(const Batch& batch);
  // Clips the gradient norm (if configured) and applies one AdamW step.
  void optimizer_step();
  // Both; returns the loss before the step.
  double step(const Batch& batch);

  void set_lr(double lr);

  // The AdamW optimizer, whose state (moments and step counts) checkpoints save: restoring it
  // makes a resumed run continue bit-identically (libtorch::optimizer_file).
  [[nodiscard]] torch::optim::Optimizer& optimizer() noexcept;
  [[nodiscard]] const OptimizerSettings& settings() const noexcept { return settings_; }
  [[nodiscard]] TransformerLM& model() noexcept { return model_; }

 private:
  struct Impl;
  TransformerLM& model_;
  OptimizerSettings settings_;
  std::unique_ptr<Impl> impl_;
};

// The model's weights stored in bf16, as a user of a torch bf16 model holds them (the tensors a
// synchronizer is given). The model computes forward and backward in fp32 on exactly these
// values; the Trainer's AdamW keeps fp32 moments and computes each update in fp32 from them; the
// updated weight is rounded to bf16 (round to nearest even) and stored back.
class Bf16Weights {
 public:
  // bf16 copies of the model's current parameters; the model is set to their values.
  explicit Bf16Weights(TransformerLM& model);
  ~Bf16Weights();
  Bf16Weights(const Bf16Weights&) = delete;
  Bf16Weights& operator=(const Bf16Weights&) = delete;

  // The bf16 tensors, in TransformerLM::parameter_names() order, contiguous, on the CPU.
  [[nodiscard]] const std::vector<at::Tensor>& tensors() const noexcept { return tensors_; }
  // model = float(bf16 weights): before a forward pass (a window may have reset the weights).
  void load_into_model();
  // bf16 weights = bf16(model), and the model set to the rounded values: after an optimizer step.
  void round_from_model();

 private:
  TransformerLM& model_;
  std::vector<at::Tensor> tensors_;
};

// Weight files: one F32 tensor per parameter, named as TransformerLM::parameter_names().
void save_weights(const TransformerLM& model, const std::filesystem::path& path,
                  const io::Metadata& metadata);
// Validates the file against the model (every parameter present with the right shape and
// dtype, nothing else) before changing any weight. Throws ProtocolError/IoError/InvalidArgument.
void load_weights(TransformerLM& model, const std::filesystem::path& path);

struct PretrainOptions {
  std::uint64_t seed = 1234;  // initial weights and data
  int steps = 200;  // time and held-out loss: docs/benchmarks.md, "Training example model"
  int batch_size = 16;
  double peak_lr = 3e-3;
  int warmup_steps = 40;  // linear warmup, then cosine decay to 10% of the peak
  int eval_batch_size = 64;
  int log_every = 50;               // 0: quiet
  std::filesystem::path cache_dir;  // where the pretrained checkpoint is cached
};

struct PretrainResult {
  bool loaded_from_cache = false;
  std::filesystem::path checkpoint;
  std::string rebuild_reason;  // why an existing cache was not used (empty if none was there)
  double seconds = 0;          // pretraining wall time (0 when loaded)
  int steps = 0;
  double eval_loss_initial = 0;  // held-out pretraining-mix loss of the initial weights
  double eval_loss_final = 0;    // ... and of the pretrained weights
};

// The metadata that identifies a pretrained state: model config, seed, optimizer schedule,
// task version and mix. A cache whose metadata differs in any of them is rebuilt.
[[nodiscard]] io::Metadata pretrain_identity(const ModelConfig& config,
                                             const PretrainOptions& options);
// <cache_dir>/pretrained-<digest of the identity>.safetensors
[[nodiscard]] std::filesystem::path pretrain_cache_path(const ModelConfig& config,
                                                        const PretrainOptions& options);

// Makes `model` (freshly constructed with options.seed) the pretrained model: loads the cache
// when it exists and matches, otherwise pretrains and writes the cache (atomically, so
// concurrent processes never see a partial file).
PretrainResult load_or_pretrain(TransformerLM& model, const PretrainOptions& options);

// Trains `steps` steps on `mix` from its current weights (the pretraining loop).
void pretrain(TransformerLM& model, const PretrainOptions& options);

// Snapshot of the bf16 view of every parameter (what a bf16 forward pass sees).
[[nodiscard]] std::vector<std::uint16_t> bf16_snapshot(const TransformerLM& model);
// Fraction of elements whose bf16 value is numerically equal in two snapshots.
[[nodiscard]] double bf16_unchanged_fraction(const std::vector<std::uint16_t>& before,
                                             const std::vector<std::uint16_t>& after);

}  // namespace pulseloco::example
