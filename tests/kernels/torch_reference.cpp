#include "kernels/torch_reference.h"

#include <stdexcept>

namespace pulseloco::testing {

ReferenceGate reference_gate(const torch::Tensor& global, const torch::Tensor& local,
                             const torch::Tensor& residual, kernels::Bf16Delta bf16_delta) {
  torch::NoGradGuard no_grad;
  // Step 1. The authors' code: global - local, which PyTorch's type promotion computes as
  // θ_g - float(θ_l) for bf16 local weights too. `exact` leaves the cast residue of θ_g out of
  // the pseudo-gradient by seeing θ_g through the same cast.
  const torch::Tensor delta =
      local.scalar_type() == torch::kFloat32 || bf16_delta == kernels::Bf16Delta::authors
          ? global - local
          : global.to(torch::kBFloat16).to(torch::kFloat32) - local.to(torch::kFloat32);
  const torch::Tensor s = residual + delta;  // step 2

  ReferenceGate out;
  const torch::Tensor non_finite = torch::logical_not(torch::isfinite(s)).nonzero();
  if (non_finite.size(0) > 0) {
    out.non_finite_index = non_finite[0][0].item<std::int64_t>();
    return out;
  }
  const torch::Tensor corrected = global - s;                                // step 3
  out.fire = corrected.to(torch::kBFloat16) != global.to(torch::kBFloat16);  // step 4
  out.indices = out.fire.nonzero().squeeze(1);                               // step 5: what is sent
  out.values = s.masked_select(out.fire);
  out.residual = torch::where(out.fire, torch::zeros_like(s), s);  // and what is kept
  return out;
}

torch::Tensor reference_aggregate(const std::vector<ReferenceMessage>& ranks, std::int64_t count) {
  torch::NoGradGuard no_grad;
  torch::Tensor g = torch::zeros({count}, torch::kFloat32);
  for (const ReferenceMessage& message : ranks)
    g.index_add_(0, message.indices, message.values);
  g.div_(static_cast<std::int64_t>(ranks.size()));
  return g;
}

ReferenceOuterOptimizer::ReferenceOuterOptimizer(const torch::Tensor& initial_global, float lr,
                                                 float momentum)
    : global_(initial_global.to(torch::kFloat32).clone().set_requires_grad(true)) {
  // The options are doubles, as in Python; PyTorch narrows them to fp32 for fp32 tensors, which
  // gives back exactly the fp32 constants we pass.
  optimizer_ = std::make_unique<torch::optim::SGD>(std::vector<torch::Tensor>{global_},
                                                   torch::optim::SGDOptions(static_cast<double>(lr))
                                                       .momentum(static_cast<double>(momentum))
                                                       .dampening(0.0)
                                                       .weight_decay(0.0)
                                                       .nesterov(true));
}

void ReferenceOuterOptimizer::step(const torch::Tensor& g) {
  global_.mutable_grad() = g.clone();
  optimizer_->step();
}

torch::Tensor ReferenceOuterOptimizer::momentum() const {
  const auto& state = optimizer_->state();
  if (state.empty()) return {};
  if (state.size() != 1) throw std::logic_error("reference optimizer holds more than one state");
  return static_cast<const torch::optim::SGDParamState&>(*state.begin()->second).momentum_buffer();
}

}  // namespace pulseloco::testing
