#include <pulseloco/adapters/torch/synchronizer.h>

#include <torch/types.h>
#include <torch/utils.h>

#include <pulseloco/base/errors.h>

namespace pulseloco::libtorch {
namespace {

DType to_dtype(const torch::Tensor& tensor, const std::string& name) {
  if (tensor.scalar_type() == torch::kFloat32) return DType::float32;
  if (tensor.scalar_type() == torch::kBFloat16) return DType::bfloat16;
  throw InvalidArgument(std::string("parameter dtype ") +
                            std::string(c10::toString(tensor.scalar_type())) +
                            " is not supported (float32 or bfloat16)",
                        {.tensor = name});
}

TensorView view_of(const torch::Tensor& tensor, const std::string& name) {
  if (!tensor.is_contiguous()) {
    throw InvalidArgument("parameter is not contiguous", {.tensor = name});
  }
  if (!tensor.device().is_cpu()) {
    throw InvalidArgument("internal: engine views must be host tensors", {.tensor = name});
  }
  return TensorView{tensor.data_ptr(), static_cast<std::uint64_t>(tensor.numel()),
                    to_dtype(tensor, name), Device{}};
}

}  // namespace

std::vector<NamedTensor> Synchronizer::prepare(
    const torch::OrderedDict<std::string, torch::Tensor>& named_parameters) {
  std::optional<torch::Device> device;
  for (const auto& item : named_parameters) {
    const torch::Tensor& p = item.value();
    if (!device) device = p.device();
    if (p.device() != *device) {
      throw InvalidArgument("parameters live on different devices", {.tensor = item.key()});
    }
    (void)to_dtype(p, item.key());
    if (!p.is_contiguous()) {
      throw InvalidArgument("parameter is not contiguous", {.tensor = item.key()});
    }
    names_.push_back(item.key());
    parameters_.push_back(p);
  }
  staged_ = device.has_value() && !device->is_cpu();
  for (const auto& p : parameters_) {
    host_.push_back(
        staged_ ? torch::empty_like(p, torch::TensorOptions().device(torch::kCPU)).pin_memory()
                : p);
  }
  stage_to_host();
  std::vector<NamedTensor> views;
  views.reserve(parameters_.size());
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    views.push_back({names_[i], view_of(host_[i], names_[i])});
  }
  return views;
}

Synchronizer::Synchronizer(const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
                           EngineOptions options, std::unique_ptr<transport::Transport> transport) {
  std::vector<NamedTensor> views = prepare(named_parameters);
  torch::NoGradGuard no_grad;
  engine_ = std::make_unique<Engine>(std::move(views), std::move(options), std::move(transport));
  stage_from_host();  // the broadcast wrote rank 0's weights into the host views
}

Synchronizer::Synchronizer(const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
                           EngineOptions options, ElasticOptions elastic) {
  std::vector<NamedTensor> views = prepare(named_parameters);
  torch::NoGradGuard no_grad;
  elastic_ =
      std::make_unique<ElasticEngine>(std::move(views), std::move(options), std::move(elastic));
  stage_from_host();  // attaching wrote the group's weights into the host views
}

Synchronizer::~Synchronizer() = default;

void Synchronizer::stage_to_host() {
  if (!staged_) return;
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < parameters_.size(); ++i)
    host_[i].copy_(parameters_[i]);
}

void Synchronizer::stage_from_host() {
  if (!staged_) return;
  torch::NoGradGuard no_grad;
  for (std::size_t i = 0; i < parameters_.size(); ++i)
    parameters_[i].copy_(host_[i]);
}

void Synchronizer::before_optimizer_step() {
  if (engine().options().mode != Mode::ddp) return;
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  std::vector<TensorView> views;
  grads.reserve(parameters_.size());
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    torch::Tensor g = parameters_[i].grad();
    if (!g.defined()) {
      throw InvalidArgument("parameter has no gradient (call backward first)",
                            {.tensor = names_[i]});
    }
    grads.push_back(g.device().is_cpu() && g.is_contiguous() ? g : g.to(torch::kCPU).contiguous());
    views.push_back(view_of(grads.back(), names_[i]));
  }
  engine().average_gradients(views);
  for (std::size_t i = 0; i < parameters_.size(); ++i) {
    torch::Tensor g = parameters_[i].grad();
    if (!g.is_same(grads[i])) g.copy_(grads[i]);
  }
}

std::optional<WindowReport> Synchronizer::after_optimizer_step() {
  torch::NoGradGuard no_grad;
  // Windows read θ_l and write it back; staging is only needed on the steps that run one.
  if (engine().next_step_runs_window()) stage_to_host();
  auto report = elastic_ ? elastic_->after_optimizer_step() : engine_->after_optimizer_step();
  if (report) stage_from_host();
  return report;
}

void Synchronizer::save_checkpoint(const std::filesystem::path& dir) {
  engine().save_checkpoint(dir);
}

void Synchronizer::load_checkpoint(const std::filesystem::path& dir) {
  stage_to_host();
  engine().load_checkpoint(dir);
  stage_from_host();
}

}  // namespace pulseloco::libtorch
