#include <pulseloco/engine/replicated_state.h>

#include <fmt/format.h>

#include <cstring>
#include <utility>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/host_state_memory.h>

namespace pulseloco::engine_detail {

ReplicatedState::ReplicatedState() : memory_(std::make_unique<HostStateMemory>(StateTensors{})) {}

ReplicatedState::ReplicatedState(std::vector<NamedTensor> parameters, const EngineOptions& options,
                                 const MemoryFactory& memory)
    : keeps_global_state_(options.mode != Mode::ddp),
      keeps_start_(options.overlap == Overlap::eager) {
  std::vector<TensorInfo> infos;
  std::vector<TensorView> locals;
  infos.reserve(parameters.size());
  locals.reserve(parameters.size());
  tensors_.resize(parameters.size());
  for (std::size_t t = 0; t < parameters.size(); ++t) {
    const NamedTensor& p = parameters[t];
    if (p.view.dtype != DType::float32 && p.view.dtype != DType::bfloat16) {
      throw InvalidArgument("parameters must be float32 or bfloat16", {.tensor = p.name});
    }
    if (p.view.numel > 0 && p.view.data == nullptr) {
      throw InvalidArgument("parameter has elements but no data", {.tensor = p.name});
    }
    std::vector<std::uint64_t> shape =
        p.shape.empty() ? std::vector<std::uint64_t>{p.view.numel} : p.shape;
    std::uint64_t product = 1;
    for (std::uint64_t d : shape)
      product *= d;
    if (product != p.view.numel) {
      throw InvalidArgument("shape does not match the element count", {.tensor = p.name});
    }
    tensors_[t] = {p.view.dtype, std::move(shape)};
    numels_.push_back(p.view.numel);
    locals.push_back(p.view);
    infos.push_back({p.name, p.view.numel, p.view.dtype});
  }
  layout_ = Layout(std::move(infos), options.chunk_elements, options.bucket_elements);
  // The memory checks the devices (one per rank, and one it can work on).
  memory_ = memory(StateTensors{
      .layout = layout_,
      .locals = std::move(locals),
      .keeps_global_state = keeps_global_state_,
      .options = &options,
  });
}

void ReplicatedState::set_progress(std::uint64_t committed_windows,
                                   bool momentum_initialised) noexcept {
  committed_windows_ = committed_windows;
  momentum_initialised_ = momentum_initialised;
}

void ReplicatedState::commit_window() noexcept {
  if (keeps_global_state_) momentum_initialised_ = true;
  accepted_after_.reset();
  ++committed_windows_;
}

std::vector<float> ReplicatedState::copy_values(StateBuffer buffer, std::size_t tensor) const {
  if (buffer == StateBuffer::local) {
    throw InvalidArgument("θ_l is the caller's own tensor; it has no fp32 copy here");
  }
  if (!keeps_global_state_) {
    throw InvalidArgument("mode ddp keeps no θ_g, m or e (its replicas' state is θ_l)");
  }
  std::vector<float> values(numels_.at(tensor));
  read_host(buffer, tensor, whole(tensor),
            [&](std::uint64_t offset, std::span<const std::byte> piece) {
              std::memcpy(reinterpret_cast<std::byte*>(values.data()) + offset, piece.data(),
                          piece.size());
            });
  return values;
}

}  // namespace pulseloco::engine_detail
