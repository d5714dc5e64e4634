// The window kernels on CUDA (contract: kernels/cuda/window_kernels_cuda.h).
//
// Per-element arithmetic mirrors kernels/cpu/window_kernels_internal.h operation for operation,
// with explicitly rounded intrinsics so that nvcc can neither contract nor reassociate
// (the build also passes --fmad=false).
#include <cuda_runtime.h>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <cub/device/device_select.cuh>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/kernels/argument_checks.h>
#include <pulseloco/kernels/cuda/cuda_internal.h>
#include <pulseloco/kernels/cuda/window_kernels_cuda.h>
#include <pulseloco/kernels/local_kind.h>
#include <pulseloco/kernels/cuda/launch.cuh>

namespace pulseloco::kernels::cuda {
namespace detail {
namespace {

// ---- per-element arithmetic (device) --------------------------------------------------------

__device__ __forceinline__ bool is_finite_value(float value) {
  return (__float_as_uint(value) & 0x7F800000u) != 0x7F800000u;
}

template <DType kLocal>
__device__ __forceinline__ float load_local(const void* local, std::uint64_t i) {
  if constexpr (kLocal == DType::float32) {
    return static_cast<const float*>(local)[i];
  } else {
    return bf16_bits_to_float(static_cast<const std::uint16_t*>(local)[i]);
  }
}

template <DType kLocal>
__device__ __forceinline__ void store_local(void* local, std::uint64_t i, float value) {
  if constexpr (kLocal == DType::float32) {
    static_cast<float*>(local)[i] = value;
  } else {
    static_cast<std::uint16_t*>(local)[i] = float_to_bf16_bits(value);
  }
}

struct GateLane {
  float s;
  bool fire;
};

// Steps 1-4 for one element (the CPU's gate_lane).
template <DType kLocal, Bf16Delta kDelta>
__device__ __forceinline__ GateLane gate_lane(float global, float local, float residual) {
  const std::uint16_t global_bf16 = float_to_bf16_bits(global);
  const float seen_global = ::pulseloco::kernels::detail::kDeltaThroughCast<kLocal, kDelta>
                                ? bf16_bits_to_float(global_bf16)
                                : global;
  const float delta = __fsub_rn(seen_global, local);                            // step 1
  const float s = __fadd_rn(residual, delta);                                   // step 2
  const float corrected = __fsub_rn(global, s);                                 // step 3
  return {s, !bf16_numeric_equal(global_bf16, float_to_bf16_bits(corrected))};  // step 4
}

// Step 8 for one element (the CPU's outer_lane).
__device__ __forceinline__ void outer_lane(float& global, float& momentum, float g, float lr,
                                           float mu, bool first_step) {
  const float m = first_step ? g : __fadd_rn(__fmul_rn(mu, momentum), g);  // two roundings
  const float d = __fmaf_rn(mu, m, g);                                     // one rounding
  global = __fmaf_rn(-lr, d, global);                                      // one rounding
  momentum = m;
}

// ---- the gate: a stable CUB DeviceSelect over computed items ---------------------------------

// Item of element i: fire in bit 63, i in bits 32..62 (i < 2^31), the bits of s in 0..31.
// A non-finite s is recorded (lowest offset wins, whatever the order) and never selected.
template <DType kLocal, Bf16Delta kDelta>
struct GateItem {
  const float* global;
  const void* local;
  const float* residual;
  unsigned long long* non_finite_min;

  __device__ std::uint64_t operator()(std::uint32_t i) const {
    const GateLane lane =
        gate_lane<kLocal, kDelta>(global[i], load_local<kLocal>(local, i), residual[i]);
    if (!is_finite_value(lane.s)) {
      atomicMin(non_finite_min, static_cast<unsigned long long>(i));
      return 0;
    }
    return (static_cast<std::uint64_t>(lane.fire) << 63) | (static_cast<std::uint64_t>(i) << 32) |
           __float_as_uint(lane.s);
  }
};

struct IsFired {
  __device__ bool operator()(std::uint64_t item) const { return (item >> 63) != 0; }
};

// Writes the k-th selected item as (offset, value).
struct WriteEntry {
  std::uint32_t* offsets;
  float* values;

  __device__ void operator()(std::ptrdiff_t k, std::uint64_t item) const {
    offsets[k] = static_cast<std::uint32_t>(item >> 32) & 0x7FFFFFFFu;
    values[k] = __uint_as_float(static_cast<std::uint32_t>(item));
  }
};

// Writes the k-th selected item of a chunk at the packed output's cursor, within its capacity.
struct WritePackedEntry {
  std::uint32_t* offsets;
  float* values;
  std::uint64_t capacity;
  const unsigned long long* cursor;  // advanced only after the chunk's selection completes

  __device__ void operator()(std::ptrdiff_t k, std::uint64_t item) const {
    const std::uint64_t at = *cursor + static_cast<std::uint64_t>(k);
    if (at >= capacity) return;
    offsets[at] = static_cast<std::uint32_t>(item >> 32) & 0x7FFFFFFFu;
    values[at] = __uint_as_float(static_cast<std::uint32_t>(item));
  }
};

// One call of cub::DeviceSelect::If: a size query when `temp` is null, the gate otherwise;
// `write` places the k-th fired entry, `selected` receives the count.
template <DType kLocal, Bf16Delta kDelta, class Write>
cudaError_t gate_select(void* temp, std::size_t& temp_bytes, const GateChunk& chunk, Write write,
                        long long* selected, unsigned long long* non_finite_min,
                        cudaStream_t stream) {
  const auto items = thrust::make_transform_iterator(
      thrust::counting_iterator<std::uint32_t>(0),
      GateItem<kLocal, kDelta>{chunk.global, chunk.local, chunk.residual, non_finite_min});
  const auto out = thrust::make_tabulate_output_iterator(write);
  return cub::DeviceSelect::If(temp, temp_bytes, items, out, selected,
                               static_cast<std::int64_t>(chunk.count), IsFired{}, stream);
}

// After a chunk's selection: its slot learns where its entries start, and the cursor moves on.
__global__ void advance_gate_cursor_kernel(unsigned long long* cursor, GateSlot* slot) {
  slot->first = *cursor;
  *cursor += static_cast<unsigned long long>(slot->fired);
}

__global__ void begin_packed_gate_kernel(unsigned long long* cursor, GateSlot* slots,
                                         std::uint64_t count) {
  for (std::uint64_t i = first_index(); i < count; i += grid_stride())
    slots[i] = GateSlot{};
  if (first_index() == 0) *cursor = 0;
}

// ---- element-wise kernels ------------------------------------------------------------------

template <DType kLocal, Bf16Delta kDelta>
__global__ void commit_residual_kernel(const float* global, const void* local,
                                       const float* residual, float* residual_out,
                                       std::uint64_t count) {
  for (std::uint64_t i = first_index(); i < count; i += grid_stride()) {
    const GateLane lane =
        gate_lane<kLocal, kDelta>(global[i], load_local<kLocal>(local, i), residual[i]);
    residual_out[i] = lane.fire ? 0.0f : lane.s;
  }
}

template <DType kLocal>
__global__ void outer_step_kernel(float* global, float* momentum, const float* g, void* local,
                                  std::uint64_t count, float lr, float mu, bool first_step) {
  for (std::uint64_t i = first_index(); i < count; i += grid_stride()) {
    float theta = global[i];
    float m = first_step ? 0.0f : momentum[i];
    outer_lane(theta, m, g[i], lr, mu, first_step);
    global[i] = theta;
    momentum[i] = m;
    store_local<kLocal>(local, i, theta);
  }
}

template <DType kLocal, Bf16Delta kDelta>
__global__ void commit_and_outer_step_kernel(float* global, float* momentum, float* residual,
                                             void* local, const float* g, std::uint64_t count,
                                             float lr, float mu, bool first_step) {
  for (std::uint64_t i = first_index(); i < count; i += grid_stride()) {
    float theta = global[i];
    const GateLane lane =
        gate_lane<kLocal, kDelta>(theta, load_local<kLocal>(local, i), residual[i]);
    residual[i] = lane.fire ? 0.0f : lane.s;
    float m = first_step ? 0.0f : momentum[i];
    outer_lane(theta, m, g[i], lr, mu, first_step);
    global[i] = theta;
    momentum[i] = m;
    store_local<kLocal>(local, i, theta);
  }
}

__global__ void cast_to_bf16_kernel(const float* global, std::uint16_t* local,
                                    std::uint64_t count) {
  for (std::uint64_t i = first_index(); i < count; i += grid_stride())
    local[i] = float_to_bf16_bits(global[i]);
}

template <DType kLocal, Bf16Delta kDelta>
__global__ void pseudo_gradient_kernel(const float* global, const void* local, float* delta,
                                       std::uint64_t count) {
  for (std::uint64_t i = first_index(); i < count; i += grid_stride()) {
    const float seen_global = ::pulseloco::kernels::detail::kDeltaThroughCast<kLocal, kDelta>
                                  ? round_to_bf16(global[i])
                                  : global[i];
    delta[i] = __fsub_rn(seen_global, load_local<kLocal>(local, i));
  }
}

__global__ void divide_kernel(float* values, std::uint64_t count, float divisor) {
  for (std::uint64_t i = first_index(); i < count; i += grid_stride())
    values[i] = __fdiv_rn(values[i], divisor);
}

__global__ void first_non_finite_kernel(const float* values, std::uint64_t count,
                                        unsigned long long* non_finite_min) {
  for (std::uint64_t i = first_index(); i < count; i += grid_stride()) {
    if (!isfinite(values[i])) atomicMin(non_finite_min, static_cast<unsigned long long>(i));
  }
}

// Flags the first entry (lowest rank, then lowest index) whose offset is not strictly above
// its predecessor's or not below `count`.
__global__ void validate_entries_kernel(const std::uint32_t* offsets, std::uint64_t entries,
                                        std::uint64_t count, unsigned long long rank,
                                        unsigned long long* bad_entry_min) {
  for (std::uint64_t k = first_index(); k < entries; k += grid_stride()) {
    const bool bad = offsets[k] >= count || (k > 0 && offsets[k] <= offsets[k - 1]);
    if (bad) atomicMin(bad_entry_min, (rank << 32) | k);
  }
}

// One rank's entries: its offsets are unique, so no two threads touch the same element. An
// offset at or beyond `count` (entries the caller did not validate first) writes nothing.
__global__ void scatter_add_kernel(const std::uint32_t* offsets, const float* values,
                                   std::uint64_t entries, float* g, std::uint64_t count) {
  for (std::uint64_t k = first_index(); k < entries; k += grid_stride()) {
    const std::uint32_t offset = offsets[k];
    if (offset < count) g[offset] = __fadd_rn(g[offset], values[k]);
  }
}

}  // namespace

std::size_t gate_temp_bytes(std::uint64_t count) {
  std::size_t bytes_f32 = 0, bytes_bf16 = 0, bytes_bf16_authors = 0;
  GateChunk chunk;
  chunk.count = count;
  const WriteEntry write{nullptr, nullptr};
  PULSELOCO_CUDA_CHECK((gate_select<DType::float32, Bf16Delta::exact>(
      nullptr, bytes_f32, chunk, write, nullptr, nullptr, nullptr)));
  PULSELOCO_CUDA_CHECK((gate_select<DType::bfloat16, Bf16Delta::exact>(
      nullptr, bytes_bf16, chunk, write, nullptr, nullptr, nullptr)));
  PULSELOCO_CUDA_CHECK((gate_select<DType::bfloat16, Bf16Delta::authors>(
      nullptr, bytes_bf16_authors, chunk, write, nullptr, nullptr, nullptr)));
  return std::max({bytes_f32, bytes_bf16, bytes_bf16_authors});
}

// g = the ranks' entries added in rank order, divided by their count. One launch per rank, in
// rank order on one stream: the additions into each element happen in rank order, as on the CPU.
void enqueue_sum(std::span<const SparseEntries> ranks_in_order, float* g, std::uint64_t count,
                 cudaStream_t stream) {
  if (count == 0) return;
  PULSELOCO_CUDA_CHECK(cudaMemsetAsync(g, 0, count * sizeof(float), stream));  // +0
  for (const SparseEntries& entries : ranks_in_order) {
    launch("scatter_add_kernel", scatter_add_kernel, entries.offsets.size(), stream,
           entries.offsets.data(), entries.values.data(),
           static_cast<std::uint64_t>(entries.offsets.size()), g, count);
  }
  launch("divide_kernel", divide_kernel, count, stream, g, count,
         static_cast<float>(ranks_in_order.size()));
}

// The gate's selection of one chunk on `stream`, with the workspace's CUB storage grown to what
// it needs.
template <class Write>
void run_gate_select(const GateChunk& chunk, Write write, long long* selected,
                     unsigned long long* non_finite_min, DeviceWorkspace::Impl& impl,
                     cudaStream_t stream) {
  const auto select = [&](void* temp, std::size_t& bytes, long long* count) {
    return ::pulseloco::kernels::detail::with_local_kind(
        chunk.local_dtype, chunk.bf16_delta, [&]<DType kL, Bf16Delta kD>() {
          return gate_select<kL, kD>(temp, bytes, chunk, write, count, non_finite_min, stream);
        });
  };
  std::size_t needed = 0;
  PULSELOCO_CUDA_CHECK(select(nullptr, needed, nullptr));
  // Never leave the storage null: CUB would take the second call for another size query.
  impl.reserve_temp(std::max<std::size_t>(needed, 256));
  std::size_t available = impl.temp_bytes;
  PULSELOCO_CUDA_CHECK(select(impl.temp, available, selected));
}

}  // namespace detail

namespace checks = ::pulseloco::kernels::detail;  // the argument checks shared with the CPU
using detail::as_stream;
using detail::launch;

GateResult gate(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values,
                DeviceWorkspace& workspace, void* stream) {
  checks::check_gate_chunk(chunk, "cuda::gate");
  checks::check_pointer(out_offsets, chunk.count, "cuda::gate", "offset output");
  checks::check_pointer(out_values, chunk.count, "cuda::gate", "value output");
  detail::check_current_device(workspace, "cuda::gate");
  if (chunk.count == 0) return GateResult{};
  DeviceWorkspace::Impl& impl = workspace.impl();
  const cudaStream_t s = as_stream(stream);
  PULSELOCO_CUDA_CHECK(
      cudaMemsetAsync(&impl.device_counters->non_finite_min, 0xFF, sizeof(unsigned long long), s));
  detail::run_gate_select(chunk, detail::WriteEntry{out_offsets, out_values},
                          &impl.device_counters->selected, &impl.device_counters->non_finite_min,
                          impl, s);
  PULSELOCO_CUDA_CHECK(cudaMemcpyAsync(impl.host_counters, impl.device_counters,
                                       sizeof(detail::DeviceCounters), cudaMemcpyDeviceToHost, s));
  PULSELOCO_CUDA_CHECK(cudaStreamSynchronize(s));
  const detail::DeviceCounters& result = *impl.host_counters;
  if (result.non_finite_min != detail::kNoOffset)
    return GateResult{.fired = 0, .non_finite_offset = result.non_finite_min};
  return GateResult{.fired = static_cast<std::uint64_t>(result.selected),
                    .non_finite_offset = std::nullopt};
}

void begin_packed_gate(const PackedGateOutput& out, std::size_t slots, void* stream) {
  if (out.cursor == nullptr || (slots > 0 && out.slots == nullptr)) {
    throw InvalidArgument("cuda::begin_packed_gate: null cursor or slots");
  }
  const cudaStream_t s = as_stream(stream);
  detail::begin_packed_gate_kernel<<<detail::blocks_for(std::max<std::size_t>(slots, 1)),
                                     detail::kThreads, 0, s>>>(out.cursor, out.slots, slots);
  detail::check(static_cast<int>(cudaGetLastError()), "begin_packed_gate_kernel");
}

void enqueue_gate(const GateChunk& chunk, std::size_t slot, const PackedGateOutput& out,
                  DeviceWorkspace& workspace, void* stream) {
  checks::check_gate_chunk(chunk, "cuda::enqueue_gate");
  if (out.cursor == nullptr || out.slots == nullptr ||
      (out.capacity > 0 && (out.offsets == nullptr || out.values == nullptr))) {
    throw InvalidArgument("cuda::enqueue_gate: null packed output");
  }
  detail::check_current_device(workspace, "cuda::enqueue_gate");
  if (chunk.count == 0) return;  // the slot keeps "nothing fired" and its first entry 0
  const cudaStream_t s = as_stream(stream);
  GateSlot* target = out.slots + slot;
  detail::run_gate_select(
      chunk, detail::WritePackedEntry{out.offsets, out.values, out.capacity, out.cursor},
      &target->fired, &target->non_finite_min, workspace.impl(), s);
  detail::advance_gate_cursor_kernel<<<1, 1, 0, s>>>(out.cursor, target);
  detail::check(static_cast<int>(cudaGetLastError()), "advance_gate_cursor_kernel");
}

void commit_residual(const GateChunk& chunk, float* residual_out, void* stream) {
  checks::check_gate_chunk(chunk, "cuda::commit_residual");
  checks::check_pointer(residual_out, chunk.count, "cuda::commit_residual", "residual output");
  checks::with_local_kind(chunk.local_dtype, chunk.bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    launch("commit_residual_kernel", detail::commit_residual_kernel<kL, kD>, chunk.count,
           as_stream(stream), chunk.global, chunk.local, chunk.residual, residual_out, chunk.count);
  });
}

void aggregate(std::span<const SparseEntries> ranks_in_order, float* g, std::uint64_t count,
               DeviceWorkspace& workspace, void* stream) {
  constexpr const char* kName = "cuda::aggregate";
  checks::check_count(count, kName);
  checks::check_pointer(g, count, kName, "output");
  checks::check_ranks_shape(ranks_in_order, kName);
  detail::check_current_device(workspace, kName);
  DeviceWorkspace::Impl& impl = workspace.impl();
  const cudaStream_t s = as_stream(stream);

  // Validate every rank's offsets on the device, and look at the verdict before writing g.
  PULSELOCO_CUDA_CHECK(
      cudaMemsetAsync(&impl.device_counters->bad_entry_min, 0xFF, sizeof(unsigned long long), s));
  for (std::size_t r = 0; r < ranks_in_order.size(); ++r) {
    const SparseEntries& entries = ranks_in_order[r];
    launch("validate_entries_kernel", detail::validate_entries_kernel, entries.offsets.size(), s,
           entries.offsets.data(), static_cast<std::uint64_t>(entries.offsets.size()), count,
           static_cast<unsigned long long>(r), &impl.device_counters->bad_entry_min);
  }
  PULSELOCO_CUDA_CHECK(cudaMemcpyAsync(impl.host_counters, impl.device_counters,
                                       sizeof(detail::DeviceCounters), cudaMemcpyDeviceToHost, s));
  PULSELOCO_CUDA_CHECK(cudaStreamSynchronize(s));
  const unsigned long long bad = impl.host_counters->bad_entry_min;
  if (bad != detail::kNoOffset) {
    const auto rank = static_cast<int>(bad >> 32);
    const std::uint64_t entry = bad & 0xFFFFFFFFull;
    ErrorContext context;  // (no designated initialisers: nvcc's host pass warns about them)
    context.peer = rank;
    context.index = entry;
    throw InvalidArgument("cuda::aggregate: entry " + std::to_string(entry) +
                              " breaks the rule that offsets are strictly ascending and below "
                              "the chunk length " +
                              std::to_string(count),
                          std::move(context));
  }

  detail::enqueue_sum(ranks_in_order, g, count, s);
}

void enqueue_aggregate(std::span<const SparseEntries> ranks_in_order, float* g, std::uint64_t count,
                       unsigned long long* bad_entry_min, void* stream) {
  constexpr const char* kName = "cuda::enqueue_aggregate";
  checks::check_count(count, kName);
  checks::check_pointer(g, count, kName, "output");
  checks::check_ranks_shape(ranks_in_order, kName);
  if (bad_entry_min == nullptr) throw InvalidArgument("cuda::enqueue_aggregate: null counter");
  const cudaStream_t s = as_stream(stream);
  for (std::size_t r = 0; r < ranks_in_order.size(); ++r) {
    const SparseEntries& entries = ranks_in_order[r];
    launch("validate_entries_kernel", detail::validate_entries_kernel, entries.offsets.size(), s,
           entries.offsets.data(), static_cast<std::uint64_t>(entries.offsets.size()), count,
           static_cast<unsigned long long>(r), bad_entry_min);
  }
  detail::enqueue_sum(ranks_in_order, g, count, s);
}

void outer_step(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                std::uint64_t count, const OuterStepParams& params, void* stream) {
  constexpr const char* kName = "cuda::outer_step";
  checks::check_count(count, kName);
  checks::check_dtype(local_dtype, kName);
  checks::check_outer_params(params, kName);
  checks::check_pointer(global, count, kName, "global weights");
  checks::check_pointer(momentum, count, kName, "momentum");
  checks::check_pointer(g, count, kName, "aggregate");
  checks::check_pointer(local, count, kName, "local weights");
  if (local_dtype == DType::float32) {
    launch("outer_step_kernel", detail::outer_step_kernel<DType::float32>, count, as_stream(stream),
           global, momentum, g, local, count, params.lr, params.momentum, params.first_step);
  } else {
    launch("outer_step_kernel", detail::outer_step_kernel<DType::bfloat16>, count,
           as_stream(stream), global, momentum, g, local, count, params.lr, params.momentum,
           params.first_step);
  }
}

void commit_and_outer_step(const WindowChunk& chunk, const float* g, const OuterStepParams& params,
                           void* stream) {
  constexpr const char* kName = "cuda::commit_and_outer_step";
  checks::check_window_chunk(chunk, kName);
  checks::check_outer_params(params, kName);
  checks::check_pointer(g, chunk.count, kName, "aggregate");
  checks::with_local_kind(chunk.local_dtype, chunk.bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    launch("commit_and_outer_step_kernel", detail::commit_and_outer_step_kernel<kL, kD>,
           chunk.count, as_stream(stream), chunk.global, chunk.momentum, chunk.residual,
           chunk.local, g, chunk.count, params.lr, params.momentum, params.first_step);
  });
}

void reset_local(const float* global, void* local, DType local_dtype, std::uint64_t count,
                 void* stream) {
  constexpr const char* kName = "cuda::reset_local";
  checks::check_count(count, kName);
  checks::check_dtype(local_dtype, kName);
  checks::check_pointer(global, count, kName, "global weights");
  checks::check_pointer(local, count, kName, "local weights");
  if (count == 0) return;
  if (local_dtype == DType::float32) {
    if (static_cast<const void*>(global) != local) {
      PULSELOCO_CUDA_CHECK(cudaMemcpyAsync(local, global, count * sizeof(float),
                                           cudaMemcpyDeviceToDevice, as_stream(stream)));
    }
  } else {
    launch("cast_to_bf16_kernel", detail::cast_to_bf16_kernel, count, as_stream(stream), global,
           static_cast<std::uint16_t*>(local), count);
  }
}

void pseudo_gradient(const float* global, const void* local, DType local_dtype,
                     Bf16Delta bf16_delta, float* delta, std::uint64_t count, void* stream) {
  constexpr const char* kName = "cuda::pseudo_gradient";
  checks::check_count(count, kName);
  checks::check_dtype(local_dtype, kName);
  checks::check_bf16_delta(bf16_delta, kName);
  checks::check_pointer(global, count, kName, "global weights");
  checks::check_pointer(local, count, kName, "local weights");
  checks::check_pointer(delta, count, kName, "output");
  checks::with_local_kind(local_dtype, bf16_delta, [&]<DType kL, Bf16Delta kD>() {
    launch("pseudo_gradient_kernel", detail::pseudo_gradient_kernel<kL, kD>, count,
           as_stream(stream), global, local, delta, count);
  });
}

void divide(float* values, std::uint64_t count, float divisor, void* stream) {
  checks::check_count(count, "cuda::divide");
  checks::check_pointer(values, count, "cuda::divide", "values");
  launch("divide_kernel", detail::divide_kernel, count, as_stream(stream), values, count, divisor);
}

std::optional<std::uint64_t> first_non_finite(const float* values, std::uint64_t count,
                                              DeviceWorkspace& workspace, void* stream) {
  checks::check_count(count, "cuda::first_non_finite");
  checks::check_pointer(values, count, "cuda::first_non_finite", "values");
  detail::check_current_device(workspace, "cuda::first_non_finite");
  if (count == 0) return std::nullopt;
  DeviceWorkspace::Impl& impl = workspace.impl();
  const cudaStream_t s = as_stream(stream);
  PULSELOCO_CUDA_CHECK(
      cudaMemsetAsync(&impl.device_counters->non_finite_min, 0xFF, sizeof(unsigned long long), s));
  launch("first_non_finite_kernel", detail::first_non_finite_kernel, count, s, values, count,
         &impl.device_counters->non_finite_min);
  PULSELOCO_CUDA_CHECK(cudaMemcpyAsync(&impl.host_counters->non_finite_min,
                                       &impl.device_counters->non_finite_min,
                                       sizeof(unsigned long long), cudaMemcpyDeviceToHost, s));
  PULSELOCO_CUDA_CHECK(cudaStreamSynchronize(s));
  const unsigned long long lowest = impl.host_counters->non_finite_min;
  if (lowest == detail::kNoOffset) return std::nullopt;
  return static_cast<std::uint64_t>(lowest);
}

}  // namespace pulseloco::kernels::cuda
