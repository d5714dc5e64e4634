#include <pulseloco/engine/replicated_state.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::engine_detail {

ReplicatedState::ReplicatedState(std::vector<NamedTensor> parameters, const EngineOptions& options)
    : keeps_global_state_(options.mode != Mode::ddp), bf16_delta_(options.bf16_delta) {
  std::vector<TensorInfo> infos;
  infos.reserve(parameters.size());
  tensors_.resize(parameters.size());
  for (std::size_t t = 0; t < parameters.size(); ++t) {
    const NamedTensor& p = parameters[t];
    if (p.view.dtype != DType::float32 && p.view.dtype != DType::bfloat16) {
      throw InvalidArgument("parameters must be float32 or bfloat16", {.tensor = p.name});
    }
    if (!p.view.device.is_cpu()) {
      throw InvalidArgument(
          "this engine keeps its state on the CPU; pass CPU tensors (the libtorch adapter "
          "stages CUDA parameters through host memory)",
          {.tensor = p.name});
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
    tensors_[t].local = p.view;
    tensors_[t].shape = std::move(shape);
    infos.push_back({p.name, p.view.numel, p.view.dtype});
  }
  layout_ = Layout(std::move(infos), options.chunk_elements, options.bucket_elements);
  if (!keeps_global_state_) return;
  for (TensorState& state : tensors_) {
    state.global.assign(state.local.numel, 0.0f);
    state.momentum.assign(state.local.numel, 0.0f);
    state.residual.assign(state.local.numel, 0.0f);
  }
}

void ReplicatedState::set_progress(std::uint64_t window, bool momentum_initialised) noexcept {
  window_ = window;
  momentum_initialised_ = momentum_initialised;
}

void ReplicatedState::commit_window() noexcept {
  if (keeps_global_state_) momentum_initialised_ = true;
  accepted_window_.reset();
  ++window_;
}

std::byte* ReplicatedState::local_at(const ChunkRef& chunk) const {
  const TensorView& local = tensors_[chunk.tensor].local;
  return static_cast<std::byte*>(local.data) + chunk.begin * dtype_size(local.dtype);
}

kernels::GateChunk ReplicatedState::gate_chunk(const ChunkRef& chunk) const {
  const TensorState& state = tensors_[chunk.tensor];
  return kernels::GateChunk{
      .global = state.global.data() + chunk.begin,
      .local = local_at(chunk),
      .local_dtype = state.local.dtype,
      .residual = state.residual.data() + chunk.begin,
      .count = chunk.length,
      .bf16_delta = bf16_delta_,
  };
}

kernels::GateResult ReplicatedState::gate(const ChunkRef& chunk, std::uint32_t* offsets,
                                          float* values) const {
  return kernels::gate(gate_chunk(chunk), offsets, values);
}

void ReplicatedState::aggregate_and_commit(const ChunkRef& chunk,
                                           std::span<const kernels::SparseEntries> ranks_in_order,
                                           const kernels::OuterStepParams& params) {
  auto g = aggregate_scratch_->acquire();
  g->resize(chunk.length);
  kernels::aggregate(ranks_in_order, g->data(), chunk.length);
  // Step 5's state change (e), then steps 8 and 9, in one pass over the chunk.
  TensorState& state = tensors_[chunk.tensor];
  kernels::commit_and_outer_step(
      kernels::WindowChunk{
          .global = state.global.data() + chunk.begin,
          .momentum = state.momentum.data() + chunk.begin,
          .residual = state.residual.data() + chunk.begin,
          .local = local_at(chunk),
          .local_dtype = state.local.dtype,
          .count = chunk.length,
          .bf16_delta = bf16_delta_,
      },
      g->data(), params);
}

void ReplicatedState::pseudo_gradient(const ChunkRef& chunk, float* delta) const {
  const TensorState& state = tensors_[chunk.tensor];
  kernels::pseudo_gradient(state.global.data() + chunk.begin, local_at(chunk), state.local.dtype,
                           bf16_delta_, delta, chunk.length);
}

void ReplicatedState::hold_dense_sum(const ChunkRef& chunk, const float* sum) {
  std::memcpy(tensors_[chunk.tensor].residual.data() + chunk.begin, sum,
              chunk.length * sizeof(float));
}

void ReplicatedState::apply_dense_average(const ChunkRef& chunk, float divisor,
                                          const kernels::OuterStepParams& params) {
  TensorState& state = tensors_[chunk.tensor];
  float* g = state.residual.data() + chunk.begin;
  kernels::divide(g, chunk.length, divisor);
  kernels::outer_step(state.global.data() + chunk.begin, state.momentum.data() + chunk.begin, g,
                      local_at(chunk), state.local.dtype, chunk.length, params);
  std::fill_n(g, chunk.length, 0.0f);
}

void ReplicatedState::global_from_local(ThreadPool& pool) {
  pool.parallel_for(layout_.chunks().size(), [&](std::size_t c) {
    const ChunkRef& chunk = layout_.chunks()[c];
    TensorState& state = tensors_[chunk.tensor];
    float* global = state.global.data() + chunk.begin;
    if (state.local.dtype == DType::float32) {
      std::memcpy(global, local_at(chunk), chunk.length * sizeof(float));
    } else {
      bf16_to_float(std::span(static_cast<const std::uint16_t*>(state.local.data) + chunk.begin,
                              chunk.length),
                    std::span(global, chunk.length));
    }
  });
}

void ReplicatedState::reset_local(ThreadPool& pool) {
  pool.parallel_for(layout_.chunks().size(), [&](std::size_t c) {
    const ChunkRef& chunk = layout_.chunks()[c];
    TensorState& state = tensors_[chunk.tensor];
    kernels::reset_local(state.global.data() + chunk.begin, local_at(chunk), state.local.dtype,
                         chunk.length);
  });
}

void ReplicatedState::commit_residual(ThreadPool& pool) {
  pool.parallel_for(layout_.chunks().size(), [&](std::size_t c) {
    const ChunkRef& chunk = layout_.chunks()[c];
    kernels::commit_residual(gate_chunk(chunk),
                             tensors_[chunk.tensor].residual.data() + chunk.begin);
  });
}

void ReplicatedState::zero_residual() {
  for (TensorState& state : tensors_)
    std::fill(state.residual.begin(), state.residual.end(), 0.0f);
}

Digest ReplicatedState::digest(ThreadPool& pool) const {
  std::vector<Digest> parts(tensors_.size() * 2);
  pool.parallel_for(tensors_.size(), [&](std::size_t t) {
    const TensorState& state = tensors_[t];
    if (!keeps_global_state_) {
      // No global state in ddp: the replicas' weights themselves must agree.
      parts[2 * t] = digest_bytes(
          std::span(static_cast<const std::byte*>(state.local.data), state.local.bytes()));
      parts[2 * t + 1] = 0;
    } else {
      parts[2 * t] = digest_of<float>(state.global);
      parts[2 * t + 1] = digest_of<float>(state.momentum);
    }
  });
  return combine_digests(parts);
}

std::span<const std::byte> ReplicatedState::host_bytes(StateBuffer buffer, std::size_t tensor,
                                                       Range range) const {
  const TensorState& state = tensors_[tensor];
  if (buffer == StateBuffer::local) {
    const std::size_t element = dtype_size(state.local.dtype);
    return std::span(static_cast<const std::byte*>(state.local.data) + range.begin * element,
                     range.count * element);
  }
  const std::vector<float>& values = buffer == StateBuffer::global     ? state.global
                                     : buffer == StateBuffer::momentum ? state.momentum
                                                                       : state.residual;
  return std::as_bytes(std::span(values).subspan(range.begin, range.count));
}

std::span<std::byte> ReplicatedState::host_bytes(StateBuffer buffer, std::size_t tensor,
                                                 Range range) {
  const std::span<const std::byte> bytes = std::as_const(*this).host_bytes(buffer, tensor, range);
  return {const_cast<std::byte*>(bytes.data()), bytes.size()};
}

std::span<const float> ReplicatedState::host_values(StateBuffer buffer, std::size_t tensor) const {
  const TensorState& state = tensors_.at(tensor);
  switch (buffer) {
    case StateBuffer::global:
      return state.global;
    case StateBuffer::momentum:
      return state.momentum;
    case StateBuffer::residual:
      return state.residual;
    case StateBuffer::local:
      break;
  }
  throw InvalidArgument("θ_l is the caller's own tensor; it has no fp32 view here");
}

}  // namespace pulseloco::engine_detail
