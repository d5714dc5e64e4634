#include "qwen_shapes.h"

#include <stdexcept>

namespace pulseloco::bench {

const std::vector<QwenConfig>& qwen25_configs() {
  // From each model's public config.json on Hugging Face (huggingface.co/Qwen/<name>/blob/main/
  // config.json): hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
  // num_key_value_heads, vocab_size, tie_word_embeddings. The head dimension is
  // hidden_size / num_attention_heads; Qwen2's q, k and v projections have biases, o_proj and
  // the MLP have none. Published sizes: the model cards' "Number of Parameters" (0.49B, 1.54B,
  // 3.09B, 7.61B; 7.62B rounded from 7.6156e9). The test checks the totals against them.
  static const std::vector<QwenConfig> configs = {
      {"Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, true, 490'000'000},
      {"Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, true, 1'540'000'000},
      {"Qwen2.5-3B", 2048, 11008, 36, 16, 2, 151936, true, 3'090'000'000},
      {"Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, false, 7'620'000'000},
  };
  return configs;
}

const QwenConfig& qwen25_config(std::string_view scale) {
  for (const QwenConfig& config : qwen25_configs()) {
    const std::string_view full = config.name;
    if (full == scale || full.substr(full.find('-') + 1) == scale) return config;
  }
  throw std::invalid_argument("unknown Qwen2.5 scale '" + std::string(scale) +
                              "' (use 0.5B, 1.5B, 3B or 7B)");
}

const QwenConfig& qwen2_tiny_config() {
  static const QwenConfig tiny{"tiny", 64, 160, 2, 4, 2, 1000, true, 0};
  return tiny;
}

const QwenConfig& qwen_config_or_tiny(std::string_view scale) {
  return scale == "tiny" ? qwen2_tiny_config() : qwen25_config(scale);
}

std::uint64_t ModelTensor::numel() const {
  std::uint64_t n = 1;
  for (std::uint64_t d : shape)
    n *= d;
  return n;
}

std::vector<ModelTensor> qwen2_tensors(const QwenConfig& c) {
  const std::uint64_t head_dim = c.hidden_size / c.num_attention_heads;
  const std::uint64_t kv_dim = head_dim * c.num_key_value_heads;
  const std::uint64_t h = c.hidden_size;
  std::vector<ModelTensor> tensors;
  tensors.push_back({"model.embed_tokens.weight", {c.vocab_size, h}, TensorKind::embedding});
  for (std::uint64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    tensors.push_back({p + "self_attn.q_proj.weight", {h, h}, TensorKind::matrix});
    tensors.push_back({p + "self_attn.q_proj.bias", {h}, TensorKind::bias});
    tensors.push_back({p + "self_attn.k_proj.weight", {kv_dim, h}, TensorKind::matrix});
    tensors.push_back({p + "self_attn.k_proj.bias", {kv_dim}, TensorKind::bias});
    tensors.push_back({p + "self_attn.v_proj.weight", {kv_dim, h}, TensorKind::matrix});
    tensors.push_back({p + "self_attn.v_proj.bias", {kv_dim}, TensorKind::bias});
    tensors.push_back({p + "self_attn.o_proj.weight", {h, h}, TensorKind::matrix});
    tensors.push_back({p + "mlp.gate_proj.weight", {c.intermediate_size, h}, TensorKind::matrix});
    tensors.push_back({p + "mlp.up_proj.weight", {c.intermediate_size, h}, TensorKind::matrix});
    tensors.push_back({p + "mlp.down_proj.weight", {h, c.intermediate_size}, TensorKind::matrix});
    tensors.push_back({p + "input_layernorm.weight", {h}, TensorKind::norm});
    tensors.push_back({p + "post_attention_layernorm.weight", {h}, TensorKind::norm});
  }
  tensors.push_back({"model.norm.weight", {h}, TensorKind::norm});
  if (!c.tie_word_embeddings) {
    tensors.push_back({"lm_head.weight", {c.vocab_size, h}, TensorKind::embedding});
  }
  return tensors;
}

std::uint64_t total_parameters(const std::vector<ModelTensor>& tensors) {
  std::uint64_t total = 0;
  for (const ModelTensor& t : tensors)
    total += t.numel();
  return total;
}

}  // namespace pulseloco::bench
