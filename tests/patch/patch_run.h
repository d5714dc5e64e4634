// A deterministic multi-version run for the patch tests: fp32 master weights of a small model
// moved each version by small AdamW-like steps (a few percent of the bf16 values change), one
// tensor given to the publisher in bf16, and one large tensor where only three elements move,
// far apart (its gap_delta gaps exceed 65535, so its indices are U32). The expected bf16 state
// of every version is the plain cast of the weights, computed here independently of the
// publisher.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/patch/bf16_state.h>
#include <pulseloco/patch/publisher.h>
#include "kernels/window_test_inputs.h"

namespace pulseloco::testing {

struct RunTensor {
  std::string name;
  std::vector<std::uint64_t> shape;
  DType dtype = DType::float32;  // what the publisher is given
  bool sparse = false;           // only three far-apart elements move
  std::vector<float> master;
  std::vector<std::uint16_t> bf16;  // the bf16 copy when dtype is bfloat16
};

class PatchRun {
 public:
  explicit PatchRun(std::uint64_t seed) : random_(seed) {
    add("model.embed_tokens.weight", {64, 96}, DType::float32, false);
    add("model.layers.0.mlp.up_proj.weight", {96, 128}, DType::float32, false);
    add("model.layers.0.input_layernorm.weight", {96}, DType::bfloat16, false);
    add("lm_head.sparse.weight", {300'000}, DType::float32, true);
  }

  // Moves the weights to the next version.
  void step() {
    for (RunTensor& tensor : tensors_) {
      if (tensor.sparse) {
        for (const std::size_t i : {std::size_t{5}, std::size_t{100'000}, std::size_t{299'990}})
          tensor.master[i] *= 1.0f + 0.05f * random_.uniform();
      } else {
        for (float& w : tensor.master)
          w -= 1e-5f * random_.normal();
      }
      if (tensor.dtype == DType::bfloat16) float_to_bf16(tensor.master, tensor.bf16);
    }
  }

  [[nodiscard]] std::vector<patch::WeightsView> views() const {
    std::vector<patch::WeightsView> out;
    for (const RunTensor& tensor : tensors_) {
      out.push_back({.name = tensor.name,
                     .shape = tensor.shape,
                     .data = tensor.dtype == DType::float32
                                 ? static_cast<const void*>(tensor.master.data())
                                 : static_cast<const void*>(tensor.bf16.data()),
                     .dtype = tensor.dtype});
    }
    return out;
  }

  // The bf16 state a receiver must hold at the current version.
  [[nodiscard]] patch::Bf16State expected() const {
    std::vector<patch::Bf16Tensor> out;
    for (const RunTensor& tensor : tensors_) {
      patch::Bf16Tensor bf16{.name = tensor.name, .shape = tensor.shape};
      for (const float w : tensor.master)
        bf16.bits.push_back(float_to_bf16_bits(w));
      out.push_back(std::move(bf16));
    }
    return patch::Bf16State(std::move(out));
  }

  [[nodiscard]] std::vector<RunTensor>& tensors() { return tensors_; }

 private:
  void add(std::string name, std::vector<std::uint64_t> shape, DType dtype, bool sparse) {
    RunTensor tensor{
        .name = std::move(name), .shape = std::move(shape), .dtype = dtype, .sparse = sparse};
    std::uint64_t n = 1;
    for (const std::uint64_t d : tensor.shape)
      n *= d;
    tensor.master.resize(n);
    for (float& w : tensor.master)
      w = 0.02f * random_.normal();
    if (dtype == DType::bfloat16) {
      tensor.bf16.resize(n);
      float_to_bf16(tensor.master, tensor.bf16);
    }
    tensors_.push_back(std::move(tensor));
  }

  FastRandom random_;
  std::vector<RunTensor> tensors_;
};

// Publishes versions 1..versions of the run into `directory`; returns the expected state of
// each version (index v - 1).
inline std::vector<patch::Bf16State> publish_run(const std::filesystem::path& directory,
                                                 std::uint64_t versions, std::uint64_t seed,
                                                 patch::PublisherOptions options) {
  PatchRun run(seed);
  patch::Publisher publisher(directory, std::move(options));
  std::vector<patch::Bf16State> expected;
  for (std::uint64_t v = 1; v <= versions; ++v) {
    if (v > 1) run.step();
    const std::vector<patch::WeightsView> views = run.views();
    (void)publisher.publish(views, v);
    expected.push_back(run.expected());
  }
  return expected;
}

}  // namespace pulseloco::testing
