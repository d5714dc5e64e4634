#include <pulseloco/engine/host_state_memory.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::engine_detail {

HostStateMemory::HostStateMemory(StateTensors tensors, std::uint64_t piece_bytes)
    : layout_(std::move(tensors.layout)),
      options_(tensors.options != nullptr ? *tensors.options : EngineOptions{}),
      keeps_global_state_(tensors.keeps_global_state),
      piece_bytes_(piece_bytes) {
  tensors_.resize(tensors.locals.size());
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    TensorState& state = tensors_[t];
    state.local = tensors.locals[t];
    if (!keeps_global_state_) continue;
    state.global.assign(state.local.numel, 0.0f);
    state.momentum.assign(state.local.numel, 0.0f);
    state.residual.assign(state.local.numel, 0.0f);
    if (options_.overlap == Overlap::eager) state.start.assign(state.local.numel, 0.0f);
  }
}

std::byte* HostStateMemory::local_at(const ChunkRef& chunk) const {
  const TensorView& local = tensors_[chunk.tensor].local;
  return static_cast<std::byte*>(local.data) + chunk.begin * dtype_size(local.dtype);
}

kernels::GateChunk HostStateMemory::gate_chunk(const ChunkRef& chunk) const {
  const TensorState& state = tensors_[chunk.tensor];
  // Δ is measured against the point θ_l started from: S when kept, θ_g otherwise.
  const std::vector<float>& base = state.start.empty() ? state.global : state.start;
  return kernels::GateChunk{
      .global = base.data() + chunk.begin,
      .local = local_at(chunk),
      .local_dtype = state.local.dtype,
      .residual = state.residual.data() + chunk.begin,
      .count = chunk.length,
      .bf16_delta = options_.bf16_delta,
  };
}

kernels::GateResult HostStateMemory::gate(const ChunkRef& chunk, std::uint32_t* offsets,
                                          float* values) {
  return kernels::gate(gate_chunk(chunk), offsets, values);
}

ScratchPool<std::vector<float>>::Lease HostStateMemory::aggregate(
    const ChunkRef& chunk, std::span<const kernels::SparseEntries> ranks_in_order) {
  auto g = aggregate_scratch_.acquire();
  g->resize(chunk.length);
  kernels::aggregate(ranks_in_order, g->data(), chunk.length);
  return g;
}

void HostStateMemory::aggregate_and_commit(const ChunkRef& chunk,
                                           std::span<const kernels::SparseEntries> ranks_in_order,
                                           const kernels::OuterStepParams& params) {
  const auto g = aggregate(chunk, ranks_in_order);
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
          .bf16_delta = options_.bf16_delta,
      },
      g->data(), params);
}

void HostStateMemory::start_from_global(const ChunkRef& chunk) {
  TensorState& state = tensors_[chunk.tensor];
  if (state.start.empty()) return;
  std::memcpy(state.start.data() + chunk.begin, state.global.data() + chunk.begin,
              chunk.length * sizeof(float));
}

void HostStateMemory::aggregate_and_step(const ChunkRef& chunk,
                                         std::span<const kernels::SparseEntries> ranks_in_order,
                                         const kernels::OuterStepParams& params) {
  const auto g = aggregate(chunk, ranks_in_order);
  TensorState& state = tensors_[chunk.tensor];
  kernels::outer_step(state.global.data() + chunk.begin, state.momentum.data() + chunk.begin,
                      g->data(), local_at(chunk), state.local.dtype, chunk.length, params);
  start_from_global(chunk);
}

void HostStateMemory::start_from_own(const ChunkRef& chunk, const kernels::SparseEntries& own,
                                     const kernels::OuterStepParams& params) {
  TensorState& state = tensors_[chunk.tensor];
  if (state.start.empty()) throw InvalidArgument("internal: no start point kept (overlap eager)");
  auto m = momentum_scratch_.acquire();
  m->assign(state.momentum.begin() + static_cast<std::ptrdiff_t>(chunk.begin),
            state.momentum.begin() + static_cast<std::ptrdiff_t>(chunk.begin + chunk.length));
  // One rank's entries: the aggregate divides by 1, so g holds them as they are.
  const auto g = aggregate(chunk, std::span(&own, 1));
  start_from_global(chunk);
  kernels::outer_step(state.start.data() + chunk.begin, m->data(), g->data(), local_at(chunk),
                      state.local.dtype, chunk.length, params);
}

void HostStateMemory::local_from_start(ThreadPool& pool) {
  pool.parallel_for(layout_.chunks().size(), [&](std::size_t c) {
    const ChunkRef& chunk = layout_.chunks()[c];
    TensorState& state = tensors_[chunk.tensor];
    if (state.start.empty()) return;
    kernels::reset_local(state.start.data() + chunk.begin, local_at(chunk), state.local.dtype,
                         chunk.length);
  });
}

void HostStateMemory::restore_residual(const ChunkRef& chunk, const kernels::SparseEntries& own) {
  float* residual = tensors_[chunk.tensor].residual.data() + chunk.begin;
  for (std::size_t i = 0; i < own.offsets.size(); ++i)
    residual[own.offsets[i]] = own.values[i];
}

// Host memory has one place for buckets: `where` makes no difference here.
Bucket HostStateMemory::allocate_bucket(std::uint64_t elements) {
  return host_bucket(elements);
}

std::optional<std::uint64_t> HostStateMemory::pseudo_gradient(const ChunkRef& chunk, float* delta,
                                                              BucketMemory /*where*/) {
  const TensorState& state = tensors_[chunk.tensor];
  kernels::pseudo_gradient(state.global.data() + chunk.begin, local_at(chunk), state.local.dtype,
                           options_.bf16_delta, delta, chunk.length);
  for (std::uint64_t k = 0; k < chunk.length; ++k) {
    if (!std::isfinite(delta[k])) return k;
  }
  return std::nullopt;
}

void HostStateMemory::hold_dense_sum(const ChunkRef& chunk, const float* sum,
                                     BucketMemory /*where*/) {
  std::memcpy(tensors_[chunk.tensor].residual.data() + chunk.begin, sum,
              chunk.length * sizeof(float));
}

void HostStateMemory::load_gradient(const ChunkRef& chunk, const TensorView& gradient,
                                    float* bucket, BucketMemory /*where*/) {
  if (gradient.dtype == DType::float32) {
    std::memcpy(bucket, static_cast<const float*>(gradient.data) + chunk.begin,
                chunk.length * sizeof(float));
  } else {
    bf16_to_float(
        std::span(static_cast<const std::uint16_t*>(gradient.data) + chunk.begin, chunk.length),
        std::span(bucket, chunk.length));
  }
}

void HostStateMemory::store_average(const ChunkRef& chunk, float* sum, float divisor,
                                    const TensorView& gradient, BucketMemory /*where*/) {
  kernels::divide(sum, chunk.length, divisor);
  if (gradient.dtype == DType::float32) {
    std::memcpy(static_cast<float*>(gradient.data) + chunk.begin, sum,
                chunk.length * sizeof(float));
  } else {
    float_to_bf16(
        std::span<const float>(sum, chunk.length),
        std::span(static_cast<std::uint16_t*>(gradient.data) + chunk.begin, chunk.length));
  }
}

void HostStateMemory::apply_dense_average(const ChunkRef& chunk, float divisor,
                                          const kernels::OuterStepParams& params) {
  TensorState& state = tensors_[chunk.tensor];
  float* g = state.residual.data() + chunk.begin;
  kernels::divide(g, chunk.length, divisor);
  kernels::outer_step(state.global.data() + chunk.begin, state.momentum.data() + chunk.begin, g,
                      local_at(chunk), state.local.dtype, chunk.length, params);
  std::fill_n(g, chunk.length, 0.0f);
}

void HostStateMemory::global_from_local(ThreadPool& pool) {
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
    start_from_global(chunk);
  });
}

void HostStateMemory::reset_local(ThreadPool& pool) {
  pool.parallel_for(layout_.chunks().size(), [&](std::size_t c) {
    const ChunkRef& chunk = layout_.chunks()[c];
    TensorState& state = tensors_[chunk.tensor];
    kernels::reset_local(state.global.data() + chunk.begin, local_at(chunk), state.local.dtype,
                         chunk.length);
    start_from_global(chunk);
  });
}

void HostStateMemory::commit_residual(ThreadPool& pool) {
  pool.parallel_for(layout_.chunks().size(), [&](std::size_t c) {
    const ChunkRef& chunk = layout_.chunks()[c];
    kernels::commit_residual(gate_chunk(chunk),
                             tensors_[chunk.tensor].residual.data() + chunk.begin);
  });
}

void HostStateMemory::zero_residual() {
  for (TensorState& state : tensors_)
    std::fill(state.residual.begin(), state.residual.end(), 0.0f);
}

Digest HostStateMemory::digest(ThreadPool& pool) {
  std::vector<Digest> parts(tensors_.size() * 2);
  pool.parallel_for(tensors_.size(), [&](std::size_t t) {
    const TensorState& state = tensors_[t];
    if (!keeps_global_state_) {
      // No global state in ddp: the replicas' weights themselves must agree.
      parts[2 * t] = buffer_digest(
          std::span(static_cast<const std::byte*>(state.local.data), state.local.bytes()), pool);
      parts[2 * t + 1] = 0;
    } else {
      parts[2 * t] = buffer_digest(std::as_bytes(std::span(state.global)), pool);
      parts[2 * t + 1] = buffer_digest(std::as_bytes(std::span(state.momentum)), pool);
    }
  });
  return combine_digests(parts);
}

std::span<std::byte> HostStateMemory::bytes_of(StateBuffer buffer, std::size_t tensor,
                                               Range range) {
  TensorState& state = tensors_[tensor];
  if (buffer == StateBuffer::local) {
    const std::size_t element = dtype_size(state.local.dtype);
    return std::span(static_cast<std::byte*>(state.local.data) + range.begin * element,
                     range.count * element);
  }
  // Asked of the kept S, not of its storage: an empty tensor keeps an empty S.
  if (buffer == StateBuffer::start &&
      !(keeps_global_state_ && options_.overlap == Overlap::eager)) {
    throw InvalidArgument("no start point is kept (overlap eager only)");
  }
  std::vector<float>& values = buffer == StateBuffer::global     ? state.global
                               : buffer == StateBuffer::momentum ? state.momentum
                               : buffer == StateBuffer::start    ? state.start
                                                                 : state.residual;
  return std::as_writable_bytes(std::span(values).subspan(range.begin, range.count));
}

void HostStateMemory::read_host(StateBuffer buffer, std::size_t tensor, Range range,
                                const ReadPiece& read) {
  // The pieces are the buffer itself: reading is an update that changes nothing.
  update_host(buffer, tensor, range,
              [&](std::uint64_t offset, std::span<std::byte> piece) { read(offset, piece); });
}

void HostStateMemory::update_host(StateBuffer buffer, std::size_t tensor, Range range,
                                  const WritePiece& write) {
  const std::span<std::byte> bytes = bytes_of(buffer, tensor, range);
  const std::uint64_t piece = piece_bytes_ == 0 ? bytes.size() : piece_bytes_;
  for (std::uint64_t offset = 0; offset < bytes.size(); offset += piece) {
    write(offset, bytes.subspan(offset, std::min<std::uint64_t>(piece, bytes.size() - offset)));
  }
}

std::span<const float> HostStateMemory::host_values(StateBuffer buffer, std::size_t tensor) {
  if (buffer == StateBuffer::local) return StateMemory::host_values(buffer, tensor);
  const std::span<std::byte> bytes = bytes_of(buffer, tensor, {0, tensors_.at(tensor).local.numel});
  return {reinterpret_cast<const float*>(bytes.data()), bytes.size() / sizeof(float)};
}

}  // namespace pulseloco::engine_detail
