// The example model: a small decoder-only transformer (GPT-style, pre-norm) in libtorch.
//
//   tokens -> token embedding + learned positions -> N x [x + attn(LN(x)); x + MLP(LN(x))]
//          -> LN -> untied output projection -> next-token logits
//
// Causal multi-head self-attention and a 4x GELU MLP, no biases in the linear layers (LayerNorms
// have weight and bias), no dropout. Initial weights come from the example's own counter-based
// generator (task.h), not libtorch's global one: the same seed gives the same bits in any
// process, whatever else used libtorch's generator before.
//
// This header keeps libtorch out (it only forward-declares at::Tensor and torch::nn::Module);
// code that calls the tensor-returning methods includes the libtorch headers it needs itself.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "task.h"

namespace at {
class Tensor;
}  // namespace at
namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace pulseloco::example {

struct ModelConfig {
  int vocabulary = 512;
  int context = 64;
  int d_model = 256;
  int layers = 6;
  int heads = 8;
  int d_ff = 1024;

  // Throws InvalidArgument naming the bad field.
  void validate() const;
  // Canonical text, e.g. for cache metadata.
  [[nodiscard]] std::string describe() const;
  // Number of parameters of a model with this configuration.
  [[nodiscard]] std::uint64_t parameter_count() const;
};

class TransformerLM {
 public:
  TransformerLM(const ModelConfig& config, std::uint64_t seed);
  ~TransformerLM();
  TransformerLM(TransformerLM&&) noexcept;
  TransformerLM& operator=(TransformerLM&&) noexcept;
  TransformerLM(const TransformerLM&) = delete;
  TransformerLM& operator=(const TransformerLM&) = delete;

  [[nodiscard]] const ModelConfig& config() const noexcept;
  [[nodiscard]] std::uint64_t seed() const noexcept;

  // Parameters in a fixed order ("token_embedding.weight", "position_embedding",
  // "blocks.0.ln1.weight", ...), fp32, contiguous, on the CPU. The tensors share storage with
  // the model: writing into them changes the model.
  [[nodiscard]] std::vector<std::string> parameter_names() const;
  [[nodiscard]] std::vector<at::Tensor> parameters() const;
  [[nodiscard]] std::uint64_t parameter_count() const;
  // The underlying torch::nn::Module (e.g. for train()/eval() or serialization).
  [[nodiscard]] torch::nn::Module& module();

  // Next-token logits [batch, context, vocabulary] for token ids [batch, context].
  [[nodiscard]] at::Tensor forward(const at::Tensor& tokens);
  // Mean cross-entropy over the batch's answer tokens, with autograd (call backward()).
  [[nodiscard]] at::Tensor loss(const Batch& batch);
  // The same loss without autograd, as a number (evaluation).
  [[nodiscard]] double evaluate(const Batch& batch);
  // The same with every weight rounded to bf16 for the evaluation (restored afterwards): the
  // loss a bf16-compute model would see, which is what PULSELoCo's gate keeps exact.
  [[nodiscard]] double evaluate_bf16_weights(const Batch& batch);

  // xxh3-64 of every parameter's bytes in order (identical weights <=> identical digest).
  [[nodiscard]] std::uint64_t weights_digest() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pulseloco::example
