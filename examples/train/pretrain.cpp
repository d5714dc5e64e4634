#include "pretrain.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>
// Not self-contained: needs torch/types.h before it.
#include <torch/nn/utils/clip_grad.h>

#include <charconv>
#include <chrono>
#include <cmath>
#include <numbers>
#include <string>
#include <system_error>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>

namespace pulseloco::example {
namespace {

// Bump when the task generator, the model's code or the pretraining loop change in a way that
// changes the pretrained weights: old caches are then rebuilt.
constexpr const char* kPretrainVersion = "pulseloco-example-pretrain-v1";

double scheduled_lr(const PretrainOptions& options, int step) {
  if (step < options.warmup_steps) {
    return options.peak_lr * static_cast<double>(step + 1) / options.warmup_steps;
  }
  const double progress = static_cast<double>(step - options.warmup_steps) /
                          std::max(1, options.steps - options.warmup_steps);
  const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * std::min(1.0, progress)));
  return options.peak_lr * (0.1 + 0.9 * cosine);
}

std::vector<std::uint64_t> shape_of(const torch::Tensor& tensor) {
  std::vector<std::uint64_t> shape;
  for (const auto dim : tensor.sizes())
    shape.push_back(static_cast<std::uint64_t>(dim));
  return shape;
}

}  // namespace

struct Trainer::Impl {
  std::vector<torch::Tensor> parameters;
  torch::optim::AdamW optimizer;
};

Trainer::Trainer(TransformerLM& model, const OptimizerSettings& settings)
    : model_(model), settings_(settings) {
  if (!(settings.lr >= 0) || !std::isfinite(settings.lr)) {
    throw InvalidArgument(fmt::format("learning rate {} must be finite and >= 0", settings.lr));
  }
  auto parameters = model.parameters();
  torch::optim::AdamWOptions adam(settings.lr);
  adam.betas({settings.beta1, settings.beta2})
      .weight_decay(settings.weight_decay)
      .eps(settings.eps);
  impl_ = std::make_unique<Impl>(Impl{parameters, torch::optim::AdamW(parameters, adam)});
}

Trainer::~Trainer() = default;

double Trainer::forward_backward(const Batch& batch) {
  model_.module().train();
  impl_->optimizer.zero_grad();
  auto loss = model_.loss(batch);
  loss.backward();
  return loss.item<double>();
}

void Trainer::optimizer_step() {
  if (settings_.clip_grad_norm > 0) {
    torch::nn::utils::clip_grad_norm_(impl_->parameters, settings_.clip_grad_norm);
  }
  impl_->optimizer.step();
}

double Trainer::step(const Batch& batch) {
  const double loss = forward_backward(batch);
  optimizer_step();
  return loss;
}

void Trainer::set_lr(double lr) {
  settings_.lr = lr;
  for (auto& group : impl_->optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  }
}

torch::optim::Optimizer& Trainer::optimizer() noexcept {
  return impl_->optimizer;
}

void save_weights(const TransformerLM& model, const std::filesystem::path& path,
                  const io::Metadata& metadata) {
  const auto names = model.parameter_names();
  const auto parameters = model.parameters();
  std::vector<io::TensorSpec> specs;
  for (std::size_t i = 0; i < names.size(); ++i) {
    specs.push_back({names[i], io::TensorDType::f32, shape_of(parameters[i])});
  }
  io::SafetensorsWriter writer(path, metadata, std::move(specs));
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto tensor = parameters[i].detach().contiguous();
    writer.write(names[i], std::span(static_cast<const std::byte*>(tensor.data_ptr()),
                                     static_cast<std::size_t>(tensor.nbytes())));
  }
  writer.finish();
}

void load_weights(TransformerLM& model, const std::filesystem::path& path) {
  const io::SafetensorsReader reader(path);
  const auto names = model.parameter_names();
  const auto parameters = model.parameters();
  // Validate everything first: a bad file must not leave the model half-loaded.
  if (reader.tensors().size() != names.size()) {
    throw ProtocolError(fmt::format("'{}' has {} tensors, the model {} parameters", path.string(),
                                    reader.tensors().size(), names.size()));
  }
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!reader.contains(names[i])) {
      throw ProtocolError(fmt::format("'{}' lacks a parameter of the model", path.string()),
                          {.tensor = names[i]});
    }
    const io::TensorInfo& info = reader.tensor(names[i]);
    if (info.spec.dtype != io::TensorDType::f32 || info.spec.shape != shape_of(parameters[i])) {
      throw ProtocolError(
          fmt::format("'{}': the tensor is {} of shape [{}], the parameter F32 of shape [{}]",
                      path.string(), io::tensor_dtype_name(info.spec.dtype),
                      fmt::join(info.spec.shape, ", "), fmt::join(shape_of(parameters[i]), ", ")),
          {.tensor = names[i]});
    }
  }
  // Read into staging tensors, then copy, so a read error also leaves the model unchanged.
  std::vector<torch::Tensor> staged;
  for (std::size_t i = 0; i < names.size(); ++i) {
    auto tensor = torch::empty_like(parameters[i]).contiguous();
    reader.read(names[i], std::span(static_cast<std::byte*>(tensor.data_ptr()),
                                    static_cast<std::size_t>(tensor.nbytes())));
    staged.push_back(std::move(tensor));
  }
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < names.size(); ++i)
    parameters[i].copy_(staged[i]);
}

io::Metadata pretrain_identity(const ModelConfig& config, const PretrainOptions& options) {
  return {
      {"format", kPretrainVersion},
      {"model_config", config.describe()},
      {"task_mix", pretraining_mix().describe()},
      {"seed", std::to_string(options.seed)},
      {"pretrain_steps", std::to_string(options.steps)},
      {"batch_size", std::to_string(options.batch_size)},
      {"peak_lr", fmt::format("{}", options.peak_lr)},
      {"warmup_steps", std::to_string(options.warmup_steps)},
  };
}

std::filesystem::path pretrain_cache_path(const ModelConfig& config,
                                          const PretrainOptions& options) {
  std::string identity;
  for (const auto& [key, value] : pretrain_identity(config, options)) {
    identity += key + "=" + value + "\n";
  }
  const Digest digest = digest_bytes(std::as_bytes(std::span(identity.data(), identity.size())));
  return options.cache_dir / fmt::format("pretrained-{}.safetensors", digest_hex(digest));
}

void pretrain(TransformerLM& model, const PretrainOptions& options) {
  const TaskMix mix = pretraining_mix();
  OptimizerSettings settings;
  settings.lr = scheduled_lr(options, 0);
  Trainer trainer(model, settings);
  double running = 0;
  int counted = 0;
  for (int step = 0; step < options.steps; ++step) {
    trainer.set_lr(scheduled_lr(options, step));
    const Batch batch = make_batch(mix, options.seed, /*rank=*/0, static_cast<std::uint64_t>(step),
                                   options.batch_size, model.config().context);
    const double loss = trainer.step(batch);
    if (!std::isfinite(loss)) {
      throw NonFiniteError(fmt::format("pretraining loss became {} at step {}", loss, step));
    }
    running += loss;
    ++counted;
    if (options.log_every > 0 &&
        ((step + 1) % options.log_every == 0 || step + 1 == options.steps)) {
      logger().info("pretrain step {:4d}/{}: train loss {:.4f} (lr {:.2e})", step + 1,
                    options.steps, running / counted, scheduled_lr(options, step));
      running = 0;
      counted = 0;
    }
  }
}

PretrainResult load_or_pretrain(TransformerLM& model, const PretrainOptions& options) {
  if (model.seed() != options.seed) {
    throw InvalidArgument(fmt::format("the model was initialised with seed {}, pretraining uses {}",
                                      model.seed(), options.seed));
  }
  if (options.steps < 0 || options.batch_size <= 0 || options.warmup_steps <= 0) {
    throw InvalidArgument("pretraining needs steps >= 0, batch size > 0 and warmup steps > 0");
  }
  const ModelConfig& config = model.config();
  const io::Metadata identity = pretrain_identity(config, options);
  const Batch eval =
      make_eval_batch(pretraining_mix(), options.seed, options.eval_batch_size, config.context);
  PretrainResult result;
  result.checkpoint = pretrain_cache_path(config, options);
  result.steps = options.steps;

  if (std::filesystem::exists(result.checkpoint)) {
    try {
      const io::SafetensorsReader reader(result.checkpoint);
      for (const auto& [key, value] : identity) {
        const auto it = reader.metadata().find(key);
        if (it == reader.metadata().end() || it->second != value) {
          throw InvalidArgument(fmt::format("metadata '{}' is '{}', expected '{}'", key,
                                            it == reader.metadata().end() ? "<absent>" : it->second,
                                            value));
        }
      }
      const auto loss = reader.metadata().find("eval_loss_initial");
      const std::string loss_text = loss == reader.metadata().end() ? "" : loss->second;
      const auto [end, status] = std::from_chars(
          loss_text.data(), loss_text.data() + loss_text.size(), result.eval_loss_initial);
      if (loss_text.empty() || status != std::errc() ||
          end != loss_text.data() + loss_text.size()) {
        throw ProtocolError(fmt::format("metadata 'eval_loss_initial' is '{}', not a number",
                                        loss == reader.metadata().end() ? "<absent>" : loss_text));
      }
      load_weights(model, result.checkpoint);
      result.loaded_from_cache = true;
      result.eval_loss_final = model.evaluate(eval);
      return result;
    } catch (const std::exception& error) {
      // The cache is derived data: a stale or damaged one is rebuilt, and the reason logged.
      result.rebuild_reason = error.what();
      logger().warn("pretrained cache '{}' is not usable ({}); pretraining again",
                    result.checkpoint.string(), error.what());
    }
  }

  result.eval_loss_initial = model.evaluate(eval);
  const auto start = std::chrono::steady_clock::now();
  pretrain(model, options);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  result.eval_loss_final = model.evaluate(eval);

  std::error_code created;
  std::filesystem::create_directories(options.cache_dir, created);
  if (created) {
    throw IoError(fmt::format("cannot create the pretrained-state cache directory {}: {}",
                              options.cache_dir.string(), created.message()));
  }
  io::Metadata metadata = identity;
  metadata["eval_loss_initial"] = fmt::format("{:.17g}", result.eval_loss_initial);
  metadata["eval_loss_final"] = fmt::format("{:.17g}", result.eval_loss_final);
  metadata["pretrain_seconds"] = fmt::format("{:.3f}", result.seconds);
  metadata["torch_threads"] = std::to_string(torch::get_num_threads());
  save_weights(model, result.checkpoint, metadata);
  return result;
}

Bf16Weights::Bf16Weights(TransformerLM& model) : model_(model) {
  torch::NoGradGuard no_grad;
  for (const auto& p : model_.parameters())
    tensors_.push_back(p.detach().to(torch::kBFloat16).contiguous());
  load_into_model();
}

Bf16Weights::~Bf16Weights() = default;

void Bf16Weights::load_into_model() {
  torch::NoGradGuard no_grad;
  std::size_t i = 0;
  for (auto& p : model_.parameters())
    p.detach().copy_(tensors_[i++]);  // bf16 -> fp32 is exact
}

void Bf16Weights::round_from_model() {
  torch::NoGradGuard no_grad;
  std::size_t i = 0;
  for (auto& p : model_.parameters()) {
    tensors_[i].copy_(p.detach());  // fp32 -> bf16, round to nearest even
    p.detach().copy_(tensors_[i]);
    ++i;
  }
}

std::vector<std::uint16_t> bf16_snapshot(const TransformerLM& model) {
  std::vector<std::uint16_t> bits;
  bits.reserve(model.parameter_count());
  for (const auto& p : model.parameters()) {
    const auto tensor = p.detach().contiguous();
    const std::size_t offset = bits.size();
    bits.resize(offset + static_cast<std::size_t>(tensor.numel()));
    float_to_bf16(std::span(tensor.data_ptr<float>(), static_cast<std::size_t>(tensor.numel())),
                  std::span(bits).subspan(offset));
  }
  return bits;
}

double bf16_unchanged_fraction(const std::vector<std::uint16_t>& before,
                               const std::vector<std::uint16_t>& after) {
  if (before.size() != after.size() || before.empty()) {
    throw InvalidArgument(fmt::format("bf16 snapshots of {} and {} elements cannot be compared",
                                      before.size(), after.size()));
  }
  std::size_t unchanged = 0;
  for (std::size_t i = 0; i < before.size(); ++i) {
    unchanged += bf16_numeric_equal(before[i], after[i]) ? 1 : 0;
  }
  return static_cast<double>(unchanged) / static_cast<double>(before.size());
}

}  // namespace pulseloco::example
