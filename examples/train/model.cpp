#include "model.h"

#include <fmt/format.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cmath>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::example {
namespace {

namespace F = torch::nn::functional;

// Causal multi-head self-attention (libtorch 1.13 has no fused scaled_dot_product_attention).
struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int d_model, int heads) : heads_(heads) {
    qkv = register_module(
        "qkv", torch::nn::Linear(torch::nn::LinearOptions(d_model, 3 * d_model).bias(false)));
    proj = register_module(
        "proj", torch::nn::Linear(torch::nn::LinearOptions(d_model, d_model).bias(false)));
  }

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& causal_mask) {
    const auto batch = x.size(0);
    const auto time = x.size(1);
    const auto width = x.size(2);
    const auto head_dim = width / heads_;
    auto parts = qkv(x).view({batch, time, 3, heads_, head_dim}).permute({2, 0, 3, 1, 4});
    const auto q = parts[0];  // [batch, heads, time, head_dim]
    const auto k = parts[1];
    const auto v = parts[2];
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim));
    scores = scores.masked_fill(causal_mask.slice(0, 0, time).slice(1, 0, time),
                                -std::numeric_limits<float>::infinity());
    const auto attended = torch::matmul(torch::softmax(scores, -1), v);
    return proj(attended.transpose(1, 2).contiguous().view({batch, time, width}));
  }

  torch::nn::Linear qkv{nullptr};
  torch::nn::Linear proj{nullptr};
  std::int64_t heads_;
};
TORCH_MODULE(Attention);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int d_model, int heads, int d_ff) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    attn = register_module("attn", Attention(d_model, heads));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
    fc = register_module("fc",
                         torch::nn::Linear(torch::nn::LinearOptions(d_model, d_ff).bias(false)));
    out = register_module("out",
                          torch::nn::Linear(torch::nn::LinearOptions(d_ff, d_model).bias(false)));
  }

  torch::Tensor forward(torch::Tensor x, const torch::Tensor& causal_mask) {
    x = x + attn(ln1(x), causal_mask);
    return x + out(torch::gelu(fc(ln2(x))));
  }

  torch::nn::LayerNorm ln1{nullptr};
  Attention attn{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  torch::nn::Linear fc{nullptr};
  torch::nn::Linear out{nullptr};
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  explicit NetImpl(const ModelConfig& config) {
    token_embedding =
        register_module("token_embedding", torch::nn::Embedding(config.vocabulary, config.d_model));
    position_embedding =
        register_parameter("position_embedding", torch::zeros({config.context, config.d_model}));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < config.layers; ++i) {
      blocks->push_back(Block(config.d_model, config.heads, config.d_ff));
    }
    ln_f = register_module("ln_f",
                           torch::nn::LayerNorm(torch::nn::LayerNormOptions({config.d_model})));
    head = register_module(
        "head",
        torch::nn::Linear(torch::nn::LinearOptions(config.d_model, config.vocabulary).bias(false)));
    causal_mask = register_buffer(
        "causal_mask", torch::ones({config.context, config.context}, torch::kBool).triu(1));
  }

  torch::Tensor forward(const torch::Tensor& tokens) {
    const auto time = tokens.size(1);
    auto x = token_embedding(tokens) + position_embedding.slice(0, 0, time);
    for (const auto& block : *blocks)
      x = block->as<Block>()->forward(x, causal_mask);
    return head(ln_f(x));
  }

  torch::nn::Embedding token_embedding{nullptr};
  torch::Tensor position_embedding;
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
  torch::Tensor causal_mask;
};
TORCH_MODULE(Net);

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// GPT-2 style: N(0, 0.02) for matrices and embeddings, N(0, 0.02 / sqrt(2 * layers)) for the
// projections that write into the residual stream, LayerNorm weight 1 and bias 0. Each
// parameter draws from its own stream (seed, index), so the order of filling does not matter.
void initialise(NetImpl& net, const ModelConfig& config, std::uint64_t seed) {
  torch::NoGradGuard no_grad;
  const double residual_std = 0.02 / std::sqrt(2.0 * config.layers);
  std::uint64_t index = 0;
  for (auto& item : net.named_parameters()) {
    const std::string& name = item.key();
    torch::Tensor& tensor = item.value();
    const bool layer_norm = name.find(".ln") != std::string::npos || name.rfind("ln_f.", 0) == 0;
    if (layer_norm) {
      tensor.fill_(ends_with(name, ".weight") ? 1.0 : 0.0);
    } else {
      const double std_dev = (ends_with(name, "attn.proj.weight") || ends_with(name, ".out.weight"))
                                 ? residual_std
                                 : 0.02;
      SplitMix64 rng(mix_seed({seed, 0x1417ull, index}));
      auto values = tensor.data_ptr<float>();
      for (std::int64_t i = 0; i < tensor.numel(); ++i) {
        values[i] = static_cast<float>(rng.normal() * std_dev);
      }
    }
    ++index;
  }
}

torch::Tensor tokens_tensor(const std::vector<std::int64_t>& values, const Batch& batch) {
  return torch::from_blob(const_cast<std::int64_t*>(values.data()),
                          {batch.batch_size, batch.context}, torch::kInt64)
      .clone();
}

}  // namespace

void ModelConfig::validate() const {
  auto positive = [](int value, const char* field) {
    if (value <= 0)
      throw InvalidArgument(fmt::format("model config: {} = {} must be > 0", field, value));
  };
  positive(vocabulary, "vocabulary");
  positive(context, "context");
  positive(d_model, "d_model");
  positive(layers, "layers");
  positive(heads, "heads");
  positive(d_ff, "d_ff");
  if (d_model % heads != 0) {
    throw InvalidArgument(
        fmt::format("model config: d_model = {} is not a multiple of heads = {}", d_model, heads));
  }
  if (vocabulary < kMinVocabulary) {
    throw InvalidArgument(
        fmt::format("model config: vocabulary = {} is smaller than the {} tokens "
                    "the task uses",
                    vocabulary, kMinVocabulary));
  }
}

std::string ModelConfig::describe() const {
  return fmt::format("vocab={},context={},d_model={},layers={},heads={},d_ff={}", vocabulary,
                     context, d_model, layers, heads, d_ff);
}

std::uint64_t ModelConfig::parameter_count() const {
  const std::uint64_t d = d_model;
  const std::uint64_t per_layer = 4 * d * d + 2 * d * d_ff + 4 * d;  // attn, MLP, 2 LayerNorms
  return 2 * static_cast<std::uint64_t>(vocabulary) * d + static_cast<std::uint64_t>(context) * d +
         layers * per_layer + 2 * d;
}

struct TransformerLM::Impl {
  ModelConfig config;
  std::uint64_t seed;
  Net net;
};

TransformerLM::TransformerLM(const ModelConfig& config, std::uint64_t seed) {
  config.validate();
  impl_ = std::make_unique<Impl>(Impl{config, seed, Net(config)});
  initialise(*impl_->net, config, seed);
}

TransformerLM::~TransformerLM() = default;
TransformerLM::TransformerLM(TransformerLM&&) noexcept = default;
TransformerLM& TransformerLM::operator=(TransformerLM&&) noexcept = default;

const ModelConfig& TransformerLM::config() const noexcept {
  return impl_->config;
}
std::uint64_t TransformerLM::seed() const noexcept {
  return impl_->seed;
}

std::vector<std::string> TransformerLM::parameter_names() const {
  std::vector<std::string> names;
  for (const auto& item : impl_->net->named_parameters())
    names.push_back(item.key());
  return names;
}

std::vector<torch::Tensor> TransformerLM::parameters() const {
  return impl_->net->parameters();
}

std::uint64_t TransformerLM::parameter_count() const {
  std::uint64_t count = 0;
  for (const auto& p : impl_->net->parameters())
    count += static_cast<std::uint64_t>(p.numel());
  return count;
}

torch::nn::Module& TransformerLM::module() {
  return *impl_->net;
}

torch::Tensor TransformerLM::forward(const torch::Tensor& tokens) {
  return impl_->net->forward(tokens);
}

torch::Tensor TransformerLM::loss(const Batch& batch) {
  if (batch.context > impl_->config.context) {
    throw InvalidArgument(fmt::format("batch context {} exceeds the model's {}", batch.context,
                                      impl_->config.context));
  }
  const auto logits = forward(tokens_tensor(batch.inputs, batch));
  const auto targets = tokens_tensor(batch.targets, batch);
  return F::cross_entropy(logits.view({-1, logits.size(-1)}), targets.view({-1}),
                          F::CrossEntropyFuncOptions().ignore_index(kIgnoreTarget));
}

double TransformerLM::evaluate(const Batch& batch) {
  torch::NoGradGuard no_grad;
  const bool was_training = impl_->net->is_training();
  impl_->net->eval();
  const double value = loss(batch).item<double>();
  impl_->net->train(was_training);
  return value;
}

double TransformerLM::evaluate_bf16_weights(const Batch& batch) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> saved;
  for (auto& p : impl_->net->parameters()) {
    saved.push_back(p.detach().clone());
    p.detach().copy_(p.detach().to(torch::kBFloat16).to(torch::kFloat32));
  }
  const double value = evaluate(batch);
  std::size_t i = 0;
  for (auto& p : impl_->net->parameters())
    p.detach().copy_(saved[i++]);
  return value;
}

std::uint64_t TransformerLM::weights_digest() const {
  DigestStream stream;
  for (const auto& p : impl_->net->parameters()) {
    const auto contiguous = p.detach().contiguous();
    stream.update(std::span(static_cast<const std::byte*>(contiguous.data_ptr()),
                            static_cast<std::size_t>(contiguous.nbytes())));
  }
  return stream.finish();
}

}  // namespace pulseloco::example
