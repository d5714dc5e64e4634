// Test-only reference for the window kernels, written with libtorch tensor operations step by
// step as the PULSE authors' Python does it (pulseloco-algorithm.md steps 1-9):
//   Δ = θ_g - θ_l (bf16 θ_l: the authors' θ_g - float(θ_l), or the project's exact
//   float(bf16(θ_g)) - float(θ_l));  s = e + Δ;  w̃ = θ_g - s;  fire = w̃.bfloat16() !=
//   θ_g.bfloat16(); sent = (fire.nonzero(), s[fire]);  e = where(fire, 0, s); g = zeros;
//   g.index_add_(0, idx_r, val_r) for r = 0..R-1; g.div_(R); torch::optim::SGD(lr, momentum,
//   nesterov=true) with g as the gradient;  θ_l = θ_g.to(dtype).
// Nothing here calls pulseloco's kernels: the kernel tests compare against these results.
#pragma once

#include <torch/optim/sgd.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::testing {

struct ReferenceGate {
  torch::Tensor fire;      // bool, one per element
  torch::Tensor indices;   // int64, the fired elements, ascending
  torch::Tensor values;    // float32, s at those elements
  torch::Tensor residual;  // float32, e after the commit: where(fire, 0, s)
  // First index whose s is NaN or infinite; when set, nothing else is filled in.
  std::optional<std::int64_t> non_finite_index;
};

// Steps 1-5. `local` is float32 or bfloat16; `global` and `residual` are float32. `bf16_delta`
// chooses step 1 for bfloat16 `local` (no effect on float32).
[[nodiscard]] ReferenceGate reference_gate(const torch::Tensor& global, const torch::Tensor& local,
                                           const torch::Tensor& residual,
                                           kernels::Bf16Delta bf16_delta);

struct ReferenceMessage {
  torch::Tensor indices;  // int64
  torch::Tensor values;   // float32
};

// Step 7: index_add_ of every rank's values in rank order into zeros, then div_(R).
[[nodiscard]] torch::Tensor reference_aggregate(const std::vector<ReferenceMessage>& ranks,
                                                std::int64_t count);

// Step 8 with torch::optim::SGD(lr, momentum, dampening=0, nesterov=true): the optimizer owns
// θ_g (a float32 parameter) and its momentum buffer across windows.
class ReferenceOuterOptimizer {
 public:
  ReferenceOuterOptimizer(const torch::Tensor& initial_global, float lr, float momentum);

  // Sets g as the parameter's gradient and runs optimizer.step().
  void step(const torch::Tensor& g);

  [[nodiscard]] const torch::Tensor& global() const { return global_; }
  // The SGD momentum buffer (undefined before the first step).
  [[nodiscard]] torch::Tensor momentum() const;

 private:
  torch::Tensor global_;
  std::unique_ptr<torch::optim::SGD> optimizer_;
};

}  // namespace pulseloco::testing
