// The parameter tensors of Qwen2.5 models, layer by layer, as Hugging Face's Qwen2ForCausalLM
// declares them (named_parameters order), built from the numbers of each model's public
// config.json. Used by the payload benchmark (bench/bench_payload.cpp) to size messages at the
// real shapes of 0.5B-7B models.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pulseloco::bench {

// The fields of a Qwen2 config.json that fix the parameter shapes.
struct QwenConfig {
  std::string_view name;  // "Qwen2.5-0.5B"
  std::uint64_t hidden_size = 0;
  std::uint64_t intermediate_size = 0;
  std::uint64_t num_hidden_layers = 0;
  std::uint64_t num_attention_heads = 0;
  std::uint64_t num_key_value_heads = 0;
  std::uint64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  std::uint64_t published_parameters = 0;  // the size the model card states, rounded (1e7)
};

// Qwen2.5-0.5B, 1.5B, 3B and 7B (the configs are cited in qwen_shapes.cpp).
[[nodiscard]] const std::vector<QwenConfig>& qwen25_configs();
// One of them by its short name ("0.5B", "1.5B", "3B", "7B") or full name; throws
// std::invalid_argument naming the unknown scale.
[[nodiscard]] const QwenConfig& qwen25_config(std::string_view scale);
// A tiny Qwen2-shaped model for tests and quick runs (not a real checkpoint).
[[nodiscard]] const QwenConfig& qwen2_tiny_config();
// qwen25_config(scale), or the tiny model for "tiny".
[[nodiscard]] const QwenConfig& qwen_config_or_tiny(std::string_view scale);

// What a tensor is, for the weight model of the synthetic generator.
enum class TensorKind : std::uint8_t { embedding, matrix, bias, norm };

struct ModelTensor {
  std::string name;
  std::vector<std::uint64_t> shape;
  TensorKind kind = TensorKind::matrix;

  [[nodiscard]] std::uint64_t numel() const;
};

// The tensors of a Qwen2 model in Qwen2ForCausalLM's order: embed_tokens; per layer q, k, v
// (weights and biases), o (no bias), gate, up, down, the two RMSNorm weights; the final norm;
// lm_head unless the embeddings are tied.
[[nodiscard]] std::vector<ModelTensor> qwen2_tensors(const QwenConfig& config);

[[nodiscard]] std::uint64_t total_parameters(const std::vector<ModelTensor>& tensors);

}  // namespace pulseloco::bench
