#include <pulseloco/adapters/torch/synchronizer.h>

#include <fmt/format.h>
#include <torch/serialize.h>
#include <torch/types.h>
#include <torch/utils.h>

// The current CUDA stream comes from c10/cuda, which only a CUDA build of libtorch has whole
// (a CPU build may ship its headers without the generated cuda_cmake_macros.h). Without it the
// adapter stages CUDA parameters through host memory and refuses device state.
#if __has_include(<c10/cuda/CUDAStream.h>) && __has_include(<c10/cuda/impl/cuda_cmake_macros.h>)
#include <c10/cuda/CUDAStream.h>
#define PULSELOCO_TORCH_HAS_CUDA 1
#else
#define PULSELOCO_TORCH_HAS_CUDA 0
#endif

#include <algorithm>
#include <cstring>
#include <sstream>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>

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
  Device device;
  if (tensor.device().is_cuda()) {
    device = Device{DeviceKind::cuda, tensor.device().index()};
  } else if (!tensor.device().is_cpu()) {
    throw InvalidArgument("parameters must be CPU or CUDA tensors", {.tensor = name});
  }
  return TensorView{tensor.data_ptr(), static_cast<std::uint64_t>(tensor.numel()),
                    to_dtype(tensor, name), device};
}

// Whether CUDA parameters keep their state on the device (else they are staged through host
// memory); throws InvalidArgument when device state is asked for but cannot be had.
bool keeps_device_state(StateLocation location, const std::string& first_tensor) {
  if (location == StateLocation::host) return false;
  if (location == StateLocation::automatic && !device_state_available()) {
    logger().info(
        "CUDA parameters: this program does not link pulseloco_engine_cuda, so θ_g, m and e live "
        "in host memory and the parameters are staged through it at each window");
    return false;
  }
  if (!PULSELOCO_TORCH_HAS_CUDA) {
    throw InvalidArgument(
        "state_location=device needs the libtorch adapter built against a CUDA libtorch "
        "(c10/cuda headers); this one was not: use state_location=host",
        {.tensor = first_tensor});
  }
  return true;  // the engine names what to link when pulseloco_engine_cuda is missing
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
  const bool cuda = device.has_value() && device->is_cuda();
  if (device.has_value() && !cuda && !device->is_cpu()) {
    throw InvalidArgument("parameters must be CPU or CUDA tensors", {.tensor = names_.front()});
  }
  device_state_ = cuda && keeps_device_state(options_location_, names_.front());
  staged_ = cuda && !device_state_;
  device_index_ = cuda ? device->index() : 0;
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
#if PULSELOCO_TORCH_HAS_CUDA
  // The first attach reads the parameters on the engine's stream before any stream can be
  // handed over: the user's pending writes to them must be complete (once, at start-up).
  if (device_state_) c10::cuda::getCurrentCUDAStream(device_index_).synchronize();
#endif
  return views;
}

Synchronizer::Synchronizer(const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
                           EngineOptions options, std::unique_ptr<transport::Transport> transport)
    : options_location_(options.state_location) {
  std::vector<NamedTensor> views = prepare(named_parameters);
  torch::NoGradGuard no_grad;
  runner_ = std::make_unique<Engine>(std::move(views), std::move(options), std::move(transport));
  stage_from_host();  // the broadcast wrote rank 0's weights into the host views
}

Synchronizer::Synchronizer(const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
                           EngineOptions options, ElasticOptions elastic)
    : options_location_(options.state_location) {
  std::vector<NamedTensor> views = prepare(named_parameters);
  torch::NoGradGuard no_grad;
  auto elastic_engine =
      std::make_unique<ElasticEngine>(std::move(views), std::move(options), std::move(elastic));
  elastic_ = elastic_engine.get();
  runner_ = std::move(elastic_engine);
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

void Synchronizer::order_with_current_stream() {
#if PULSELOCO_TORCH_HAS_CUDA
  if (!device_state_) return;
  engine().set_cuda_stream(c10::cuda::getCurrentCUDAStream(device_index_).stream());
#endif
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
    // Device state averages the gradients where they are; host state needs them in host memory.
    if (device_state_) {
      grads.push_back(g.contiguous());
    } else {
      grads.push_back(g.device().is_cpu() && g.is_contiguous() ? g
                                                               : g.to(torch::kCPU).contiguous());
    }
    views.push_back(view_of(grads.back(), names_[i]));
  }
  order_with_current_stream();
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
  order_with_current_stream();
  auto report = runner_->after_optimizer_step();
  if (report) stage_from_host();
  return report;
}

std::optional<WindowReport> Synchronizer::complete_in_flight() {
  torch::NoGradGuard no_grad;
  // It writes θ_l (reset to the new θ_g) without reading it: nothing to stage to the host.
  auto report = runner_->complete_in_flight();
  if (report) stage_from_host();
  return report;
}

std::filesystem::path Synchronizer::save_checkpoint(const std::filesystem::path& root,
                                                    const CheckpointSave& save) {
  order_with_current_stream();
  return engine().save_checkpoint(root, save);
}

LoadedCheckpoint Synchronizer::load_checkpoint(const std::filesystem::path& path,
                                               std::span<const std::string> required_files) {
  stage_to_host();
  order_with_current_stream();
  LoadedCheckpoint loaded = engine().load_checkpoint(path, required_files);
  stage_from_host();
  return loaded;
}

CheckpointFile optimizer_file(const torch::optim::Optimizer& optimizer, std::string name) {
  std::ostringstream stream;
  try {
    torch::save(optimizer, stream);
  } catch (const c10::Error& error) {
    throw InvalidArgument(
        fmt::format("cannot serialise the optimizer's state: {}", error.what_without_backtrace()));
  }
  const std::string bytes = std::move(stream).str();
  CheckpointFile file{std::move(name), std::vector<std::byte>(bytes.size())};
  std::memcpy(file.bytes.data(), bytes.data(), bytes.size());
  return file;
}

void load_optimizer(torch::optim::Optimizer& optimizer, const LoadedCheckpoint& loaded,
                    std::string_view name) {
  const auto file = std::find_if(loaded.files.begin(), loaded.files.end(),
                                 [&](const CheckpointFile& f) { return f.name == name; });
  if (file == loaded.files.end()) {
    throw InvalidArgument(
        fmt::format("checkpoint {} holds no file '{}' of this rank", loaded.dir.string(), name));
  }
  try {
    torch::load(optimizer, reinterpret_cast<const char*>(file->bytes.data()), file->bytes.size());
  } catch (const c10::Error& error) {
    throw ProtocolError(fmt::format("checkpoint {}: libtorch cannot read this rank's '{}': {}",
                                    loaded.dir.string(), name, error.what_without_backtrace()));
  }
}

}  // namespace pulseloco::libtorch
