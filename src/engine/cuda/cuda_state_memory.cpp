#include <pulseloco/engine/cuda/cuda_state_memory.h>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/kernels/cuda/cuda_internal.h>
#include <pulseloco/kernels/cuda/patch_kernels_cuda.h>

namespace pulseloco::engine_detail {

using kernels::cuda::detail::check;

namespace {

cudaStream_t as_stream(void* stream) {
  return static_cast<cudaStream_t>(stream);
}
cudaEvent_t as_event(void* event) {
  return static_cast<cudaEvent_t>(event);
}

template <typename T>
T* device_alloc(std::uint64_t count, const char* what) {
  void* pointer = nullptr;
  if (count > 0) check(cudaMalloc(&pointer, count * sizeof(T)), what);
  return static_cast<T*>(pointer);
}

// θ_g, m or e of one tensor: a device without room for them is told apart from other failures.
float* state_alloc(std::uint64_t count, const char* what, const std::string& tensor) {
  void* pointer = nullptr;
  if (count == 0) return nullptr;
  const cudaError_t status = cudaMalloc(&pointer, count * sizeof(float));
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clears the error, so later calls do not report it again
    throw IoError(fmt::format("no room on the device for {} ({} bytes; θ_g, m and e take 12 bytes "
                              "per parameter): keep the state in host memory with "
                              "state_location=host",
                              what, count * sizeof(float)),
                  {.tensor = tensor});
  }
  check(status, "cudaMalloc (state)");
  return static_cast<float*>(pointer);
}

}  // namespace

// Makes the memory's device current on the calling thread (a pool worker, or the caller's
// thread whose current device may be another) and restores the previous one.
class CudaStateMemory::DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

CudaStateMemory::CudaStateMemory(StateTensors tensors)
    : layout_(std::move(tensors.layout)),
      options_(tensors.options != nullptr ? *tensors.options : EngineOptions{}),
      keeps_global_state_(tensors.keeps_global_state),
      device_(tensors.locals.empty() ? 0 : tensors.locals.front().device.index) {
  try {
    allocate(tensors);
  } catch (...) {
    release();  // the destructor does not run for a constructor that throws
    throw;
  }
}

void CudaStateMemory::allocate(const StateTensors& tensors) {
  int devices = 0;
  check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  if (device_ < 0 || device_ >= devices) {
    throw InvalidArgument(fmt::format("the parameters are on cuda:{}, but this process sees {} "
                                      "CUDA device(s)",
                                      device_, devices),
                          {.tensor = layout_.tensors().front().name});
  }
  const DeviceGuard guard(device_);
  chunk_capacity_ = 0;
  for (const ChunkRef& chunk : layout_.chunks())
    chunk_capacity_ = std::max(chunk_capacity_, chunk.length);
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  stream_ = stream;
  for (void** event : {&caller_ready_, &access_done_}) {
    cudaEvent_t created = nullptr;
    check(cudaEventCreateWithFlags(&created, cudaEventDisableTiming), "cudaEventCreate");
    *event = created;
  }
  workspace_ = std::make_unique<kernels::cuda::DeviceWorkspace>(chunk_capacity_);
  gate_offsets_ = device_alloc<std::uint32_t>(chunk_capacity_, "cudaMalloc (gate offsets)");
  chunk_values_ = device_alloc<float>(chunk_capacity_, "cudaMalloc (chunk values)");
  const bool keeps_start = keeps_global_state_ && options_.overlap == Overlap::eager;
  if (keeps_start) {
    momentum_copy_ = device_alloc<float>(chunk_capacity_, "cudaMalloc (momentum copy)");
  }
  const std::size_t chunk_count = std::max<std::size_t>(layout_.chunks().size(), 1);
  gate_slots_ = device_alloc<kernels::cuda::GateSlot>(chunk_count, "cudaMalloc (gate slots)");
  check(cudaMallocHost(reinterpret_cast<void**>(&host_gate_slots_),
                       chunk_count * sizeof(kernels::cuda::GateSlot)),
        "cudaMallocHost (gate slots)");
  gate_cursor_ = device_alloc<unsigned long long>(1, "cudaMalloc (gate cursor)");
  bad_entry_min_ = device_alloc<unsigned long long>(1, "cudaMalloc (entry check)");
  check(cudaMallocHost(reinterpret_cast<void**>(&host_bad_entry_min_), sizeof(unsigned long long)),
        "cudaMallocHost (entry check)");
  check(cudaMemsetAsync(bad_entry_min_, 0xFF, sizeof(unsigned long long), as_stream(stream_)),
        "cudaMemsetAsync (entry check)");
  // One chunk's entries (offsets and values), or one chunk of fp32 values twice over.
  staging_bytes_ = std::max<std::size_t>(chunk_capacity_ * 8, 4096);
  void* staging = nullptr;
  check(cudaMallocHost(&staging, staging_bytes_), "cudaMallocHost (state staging)");
  staging_ = static_cast<std::byte*>(staging);

  tensors_.resize(tensors.locals.size());
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    TensorState& state = tensors_[t];
    state.local = tensors.locals[t];
    if (!keeps_global_state_) continue;
    const std::uint64_t n = state.local.numel;
    const std::string& name = layout_.tensors()[t].name;
    state.global = state_alloc(n, "θ_g", name);
    state.momentum = state_alloc(n, "m", name);
    state.residual = state_alloc(n, "e", name);
    if (keeps_start) state.start = state_alloc(n, "S", name);
    for (float* buffer : {state.global, state.momentum, state.residual, state.start}) {
      if (n > 0 && buffer != nullptr) {
        check(cudaMemsetAsync(buffer, 0, n * sizeof(float), as_stream(stream_)),
              "cudaMemsetAsync (state = 0)");
      }
    }
  }
  synchronize("cudaStreamSynchronize (state allocation)");
}

CudaStateMemory::~CudaStateMemory() {
  release();
}

void CudaStateMemory::release() noexcept {
  // Nothing can be reported from here; the calls fail only when the context is gone.
  cudaSetDevice(device_);
  if (stream_ != nullptr) cudaStreamSynchronize(as_stream(stream_));
  for (TensorState& state : tensors_) {
    cudaFree(state.global);
    cudaFree(state.momentum);
    cudaFree(state.residual);
    cudaFree(state.start);
    cudaFree(state.sent_bits);
  }
  for (RankEntries& entries : rank_entries_) {
    cudaFree(entries.offsets);
    cudaFree(entries.values);
  }
  cudaFree(gate_offsets_);
  cudaFree(chunk_values_);
  cudaFree(momentum_copy_);
  cudaFree(patch_values_);
  cudaFreeHost(staging_);
  cudaFreeHost(packed_offsets_);
  cudaFreeHost(packed_values_);
  cudaFree(gate_slots_);
  cudaFreeHost(host_gate_slots_);
  cudaFree(gate_cursor_);
  cudaFreeHost(entry_arena_);
  cudaFree(bad_entry_min_);
  cudaFreeHost(host_bad_entry_min_);
  workspace_.reset();
  if (caller_ready_ != nullptr) cudaEventDestroy(as_event(caller_ready_));
  if (access_done_ != nullptr) cudaEventDestroy(as_event(access_done_));
  if (stream_ != nullptr) cudaStreamDestroy(as_stream(stream_));
  tensors_.clear();
  rank_entries_.clear();
  gate_offsets_ = nullptr;
  chunk_values_ = nullptr;
  momentum_copy_ = nullptr;
  patch_values_ = nullptr;
  staging_ = nullptr;
  packed_offsets_ = nullptr;
  packed_values_ = nullptr;
  packed_capacity_ = 0;
  gate_slots_ = host_gate_slots_ = nullptr;
  gate_cursor_ = nullptr;
  entry_arena_ = nullptr;
  entry_arena_bytes_ = entry_arena_used_ = 0;
  bad_entry_min_ = host_bad_entry_min_ = nullptr;
  caller_ready_ = access_done_ = stream_ = nullptr;
  cudaGetLastError();  // a failure here must not surface in a later, unrelated launch check
}

std::string CudaStateMemory::location() const {
  return fmt::format("cuda:{}", device_);
}

void CudaStateMemory::synchronize(const char* what) {
  check(cudaStreamSynchronize(as_stream(stream_)), what);
  entry_arena_used_ = 0;  // the stream has passed every entry staged there
}

void CudaStateMemory::to_host(void* host, const void* device, std::size_t bytes) {
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t piece = std::min(staging_bytes_, bytes - done);
    check(cudaMemcpyAsync(staging_, static_cast<const std::byte*>(device) + done, piece,
                          cudaMemcpyDeviceToHost, as_stream(stream_)),
          "cudaMemcpyAsync (device to host)");
    synchronize("cudaStreamSynchronize (device to host)");
    std::memcpy(static_cast<std::byte*>(host) + done, staging_, piece);
    done += piece;
  }
}

void CudaStateMemory::to_device(void* device, const void* host, std::size_t bytes) {
  for (std::size_t done = 0; done < bytes;) {
    const std::size_t piece = std::min(staging_bytes_, bytes - done);
    std::memcpy(staging_, static_cast<const std::byte*>(host) + done, piece);
    check(cudaMemcpyAsync(static_cast<std::byte*>(device) + done, staging_, piece,
                          cudaMemcpyHostToDevice, as_stream(stream_)),
          "cudaMemcpyAsync (host to device)");
    // The staging is reused by the next piece (and the next call).
    synchronize("cudaStreamSynchronize (host to device)");
    done += piece;
  }
}

std::byte* CudaStateMemory::local_at(const ChunkRef& chunk) const {
  const TensorView& local = tensors_[chunk.tensor].local;
  return static_cast<std::byte*>(local.data) + chunk.begin * dtype_size(local.dtype);
}

kernels::GateChunk CudaStateMemory::gate_chunk(const ChunkRef& chunk) const {
  const TensorState& state = tensors_[chunk.tensor];
  // Δ is measured against the point θ_l started from: S when kept, θ_g otherwise.
  const float* base = state.start != nullptr ? state.start : state.global;
  return kernels::GateChunk{
      .global = base + chunk.begin,
      .local = local_at(chunk),
      .local_dtype = state.local.dtype,
      .residual = state.residual + chunk.begin,
      .count = chunk.length,
      .bf16_delta = options_.bf16_delta,
  };
}

std::size_t CudaStateMemory::chunk_index(const ChunkRef& chunk) const {
  const auto& chunks = layout_.chunks();
  const auto found = std::lower_bound(
      chunks.begin(), chunks.end(), chunk, [](const ChunkRef& a, const ChunkRef& b) {
        return std::pair(a.tensor, a.begin) < std::pair(b.tensor, b.begin);
      });
  if (found == chunks.end() || found->tensor != chunk.tensor || found->begin != chunk.begin ||
      found->length != chunk.length) {
    throw InvalidArgument(fmt::format("internal: tensor {} [{}, +{}) is not a chunk of the layout",
                                      chunk.tensor, chunk.begin, chunk.length));
  }
  return static_cast<std::size_t>(found - chunks.begin());
}

void CudaStateMemory::reserve_packed_gate(std::uint64_t entries) {
  if (entries <= packed_capacity_) return;
  synchronize("cudaStreamSynchronize (before growing the gate's output)");
  check(cudaFreeHost(packed_offsets_), "cudaFreeHost (gate offsets)");
  packed_offsets_ = nullptr;
  check(cudaFreeHost(packed_values_), "cudaFreeHost (gate values)");
  packed_values_ = nullptr;
  packed_capacity_ = 0;
  void* offsets = nullptr;
  void* values = nullptr;
  check(cudaHostAlloc(&offsets, entries * sizeof(std::uint32_t), cudaHostAllocMapped),
        "cudaHostAlloc (gate offsets)");
  packed_offsets_ = static_cast<std::uint32_t*>(offsets);
  check(cudaHostAlloc(&values, entries * sizeof(float), cudaHostAllocMapped),
        "cudaHostAlloc (gate values)");
  packed_values_ = static_cast<float*>(values);
  packed_capacity_ = entries;
}

// Every chunk's gate on the stream, its entries written by the kernels into mapped pinned host
// memory, and one synchronisation. The first window, or one that fires more than the output
// holds, runs a second time into an output of the right size: the gate changes no state.
void CudaStateMemory::begin_gate() {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  const auto& chunks = layout_.chunks();
  for (int pass = 0;; ++pass) {
    kernels::cuda::PackedGateOutput out{
        .capacity = packed_capacity_, .cursor = gate_cursor_, .slots = gate_slots_};
    if (packed_capacity_ > 0) {
      check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&out.offsets), packed_offsets_, 0),
            "cudaHostGetDevicePointer (gate offsets)");
      check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&out.values), packed_values_, 0),
            "cudaHostGetDevicePointer (gate values)");
    }
    kernels::cuda::begin_packed_gate(out, chunks.size(), stream_);
    for (std::size_t c = 0; c < chunks.size(); ++c)
      kernels::cuda::enqueue_gate(gate_chunk(chunks[c]), c, out, *workspace_, stream_);
    if (!chunks.empty()) {
      check(cudaMemcpyAsync(host_gate_slots_, gate_slots_,
                            chunks.size() * sizeof(kernels::cuda::GateSlot), cudaMemcpyDeviceToHost,
                            as_stream(stream_)),
            "cudaMemcpyAsync (gate slots)");
    }
    synchronize("cudaStreamSynchronize (gate)");
    std::uint64_t total = 0;
    for (std::size_t c = 0; c < chunks.size(); ++c)
      total += static_cast<std::uint64_t>(host_gate_slots_[c].fired);
    if (total <= packed_capacity_) break;
    if (pass > 0) {
      throw IoError(
          fmt::format("internal: the gate fired {} entries on its second pass, more "
                      "than the {} of its first",
                      total, packed_capacity_));
    }
    // Room for this window and some growth: the next windows rarely run twice.
    reserve_packed_gate(total + total / 4);
  }
  gated_ = true;
}

kernels::GateResult CudaStateMemory::gate(const ChunkRef& chunk, std::uint32_t* offsets,
                                          float* values) {
  // begin_gate() wrote the slots and entries and returned before the caller's gate() calls
  // started; they only read them (in parallel, without the lock).
  if (!gated_) throw InvalidArgument("internal: gate() without begin_gate() since the last change");
  const kernels::cuda::GateSlot& slot = host_gate_slots_[chunk_index(chunk)];
  if (slot.non_finite_min != ~0ull) {
    return kernels::GateResult{.fired = 0, .non_finite_offset = slot.non_finite_min};
  }
  const auto fired = static_cast<std::uint64_t>(slot.fired);
  if (fired > 0) {  // (the output is still unallocated when no window has fired yet)
    std::memcpy(offsets, packed_offsets_ + slot.first, fired * sizeof(std::uint32_t));
    std::memcpy(values, packed_values_ + slot.first, fired * sizeof(float));
  }
  return kernels::GateResult{.fired = fired, .non_finite_offset = std::nullopt};
}

std::byte* CudaStateMemory::reserve_entry_arena(std::size_t bytes) {
  if (entry_arena_used_ + bytes > entry_arena_bytes_) {
    // The kernels enqueued so far may still read the arena: wait for them before reusing it.
    synchronize("cudaStreamSynchronize (before reusing the entry staging)");
    // Doubled: within a few windows it holds a whole window's entries, and the apply waits
    // only in end_apply().
    const std::size_t size = std::max({bytes, staging_bytes_, entry_arena_bytes_ * 2});
    check(cudaFreeHost(entry_arena_), "cudaFreeHost (entry staging)");
    entry_arena_ = nullptr;
    entry_arena_bytes_ = 0;
    void* arena = nullptr;
    check(cudaMallocHost(&arena, size), "cudaMallocHost (entry staging)");
    entry_arena_ = static_cast<std::byte*>(arena);
    entry_arena_bytes_ = size;
  }
  std::byte* at = entry_arena_ + entry_arena_used_;
  entry_arena_used_ += bytes;
  return at;
}

void CudaStateMemory::end_apply() {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  check(cudaMemcpyAsync(host_bad_entry_min_, bad_entry_min_, sizeof(unsigned long long),
                        cudaMemcpyDeviceToHost, as_stream(stream_)),
        "cudaMemcpyAsync (entry check)");
  synchronize("cudaStreamSynchronize (window apply)");
  const unsigned long long bad = *host_bad_entry_min_;
  if (bad == ~0ull) return;
  check(cudaMemsetAsync(bad_entry_min_, 0xFF, sizeof(unsigned long long), as_stream(stream_)),
        "cudaMemsetAsync (entry check)");
  // The codec validated every entry before the apply: this is a broken invariant, not bad input.
  throw InvalidArgument(fmt::format("internal: the device found entry {} of rank {} breaking the "
                                    "rule that offsets are strictly ascending within a chunk",
                                    bad & 0xFFFFFFFFull, bad >> 32),
                        {.peer = static_cast<int>(bad >> 32)});
}

float* CudaStateMemory::aggregate_on_device(
    const ChunkRef& chunk, std::span<const kernels::SparseEntries> ranks_in_order) {
  if (rank_entries_.size() < ranks_in_order.size()) rank_entries_.resize(ranks_in_order.size());
  std::vector<kernels::SparseEntries> on_device(ranks_in_order.size());
  for (std::size_t r = 0; r < ranks_in_order.size(); ++r) {
    const kernels::SparseEntries& host = ranks_in_order[r];
    RankEntries& entries = rank_entries_[r];
    const std::uint64_t count = host.offsets.size();
    if (count > chunk.length || host.values.size() != count) {
      // The codec validated the entries; this guards the staging against a caller's mistake.
      throw InvalidArgument(
          fmt::format("rank {} has {} entries for a chunk of {} elements", r, count, chunk.length),
          {.peer = static_cast<int>(r)});
    }
    if (entries.capacity < count) {
      // Grown to the largest chunk at once: a rank never sends more entries than that.
      synchronize("cudaStreamSynchronize (before growing entry buffers)");
      cudaFree(entries.offsets);
      cudaFree(entries.values);
      entries = {};
      entries.offsets = device_alloc<std::uint32_t>(chunk_capacity_, "cudaMalloc (entries)");
      entries.values = device_alloc<float>(chunk_capacity_, "cudaMalloc (entries)");
      entries.capacity = chunk_capacity_;
    }
    // The copies are enqueued, not awaited: the arena keeps the bytes until the stream has
    // passed them.
    const std::size_t offset_bytes = count * sizeof(std::uint32_t);
    if (count > 0) {
      std::byte* staged = reserve_entry_arena(offset_bytes + count * sizeof(float));
      std::memcpy(staged, host.offsets.data(), offset_bytes);
      std::memcpy(staged + offset_bytes, host.values.data(), count * sizeof(float));
      check(cudaMemcpyAsync(entries.offsets, staged, offset_bytes, cudaMemcpyHostToDevice,
                            as_stream(stream_)),
            "cudaMemcpyAsync (entry offsets)");
      check(cudaMemcpyAsync(entries.values, staged + offset_bytes, count * sizeof(float),
                            cudaMemcpyHostToDevice, as_stream(stream_)),
            "cudaMemcpyAsync (entry values)");
    }
    on_device[r] = {std::span<const std::uint32_t>(entries.offsets, count),
                    std::span<const float>(entries.values, count)};
  }
  gated_ = false;  // the state is about to change
  float* g = chunk_values_;
  kernels::cuda::enqueue_aggregate(on_device, g, chunk.length, bad_entry_min_, stream_);
  return g;
}

void CudaStateMemory::aggregate_and_commit(const ChunkRef& chunk,
                                           std::span<const kernels::SparseEntries> ranks_in_order,
                                           const kernels::OuterStepParams& params) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  const float* g = aggregate_on_device(chunk, ranks_in_order);
  TensorState& state = tensors_[chunk.tensor];
  kernels::cuda::commit_and_outer_step(
      kernels::WindowChunk{
          .global = state.global + chunk.begin,
          .momentum = state.momentum + chunk.begin,
          .residual = state.residual + chunk.begin,
          .local = local_at(chunk),
          .local_dtype = state.local.dtype,
          .count = chunk.length,
          .bf16_delta = options_.bf16_delta,
      },
      g, params, stream_);
}

void CudaStateMemory::start_from_global(const ChunkRef& chunk) {
  const TensorState& state = tensors_[chunk.tensor];
  if (state.start == nullptr || chunk.length == 0) return;
  check(cudaMemcpyAsync(state.start + chunk.begin, state.global + chunk.begin,
                        chunk.length * sizeof(float), cudaMemcpyDeviceToDevice, as_stream(stream_)),
        "cudaMemcpyAsync (S = θ_g)");
}

// The overlapped windows' operations, as HostStateMemory's (docs/algorithm.md, "Overlapped
// windows"), with the same kernels on the device.
void CudaStateMemory::aggregate_and_step(const ChunkRef& chunk,
                                         std::span<const kernels::SparseEntries> ranks_in_order,
                                         const kernels::OuterStepParams& params) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  const float* g = aggregate_on_device(chunk, ranks_in_order);
  TensorState& state = tensors_[chunk.tensor];
  kernels::cuda::outer_step(state.global + chunk.begin, state.momentum + chunk.begin, g,
                            local_at(chunk), state.local.dtype, chunk.length, params, stream_);
  start_from_global(chunk);
}

void CudaStateMemory::start_from_own(const ChunkRef& chunk, const kernels::SparseEntries& own,
                                     const kernels::OuterStepParams& params) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  TensorState& state = tensors_[chunk.tensor];
  if (state.start == nullptr)
    throw InvalidArgument("internal: no start point kept (overlap eager)");
  // m is not changed: the step runs on a copy of it.
  if (chunk.length > 0) {
    check(
        cudaMemcpyAsync(momentum_copy_, state.momentum + chunk.begin, chunk.length * sizeof(float),
                        cudaMemcpyDeviceToDevice, as_stream(stream_)),
        "cudaMemcpyAsync (momentum copy)");
  }
  // One rank's entries: the aggregate divides by 1, so g holds them as they are.
  const float* g = aggregate_on_device(chunk, std::span(&own, 1));
  start_from_global(chunk);
  kernels::cuda::outer_step(state.start + chunk.begin, momentum_copy_, g, local_at(chunk),
                            state.local.dtype, chunk.length, params, stream_);
}

void CudaStateMemory::local_from_start(ThreadPool& /*pool*/) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  gated_ = false;  // the state changes
  for (const ChunkRef& chunk : layout_.chunks()) {
    const TensorState& state = tensors_[chunk.tensor];
    if (state.start == nullptr) continue;
    kernels::cuda::reset_local(state.start + chunk.begin, local_at(chunk), state.local.dtype,
                               chunk.length, stream_);
  }
  synchronize("cudaStreamSynchronize (θ_l = cast(S))");
}

// A dropped window's entries back into e (a failure path): the chunk of e crosses to the host
// and back, with the entries written into it there.
void CudaStateMemory::restore_residual(const ChunkRef& chunk, const kernels::SparseEntries& own) {
  std::size_t next = 0;
  update_host(StateBuffer::residual, chunk.tensor, Range{chunk.begin, chunk.length},
              [&](std::uint64_t offset, std::span<std::byte> piece) {
                const std::uint64_t first = offset / sizeof(float);
                const std::uint64_t end = first + piece.size() / sizeof(float);
                for (; next < own.offsets.size() && own.offsets[next] < end; ++next) {
                  const float value = own.values[next];
                  std::memcpy(piece.data() + (own.offsets[next] - first) * sizeof(float), &value,
                              sizeof(float));
                }
              });
}

Bucket CudaStateMemory::allocate_bucket(std::uint64_t elements) {
  const DeviceGuard guard(device_);
  Bucket bucket;
  bucket.values = {device_alloc<float>(elements, "cudaMalloc (dense bucket)"),
                   [](float* values) { cudaFree(values); }};
  bucket.capacity = elements;
  bucket.where = BucketMemory::state;
  return bucket;
}

// Dense buckets in host memory cross through the staging; buckets on the device are written
// and read by the kernels directly. A call on a device bucket returns once its work is complete,
// since the transport reads and writes the buckets on a stream of its own.
std::optional<std::uint64_t> CudaStateMemory::pseudo_gradient(const ChunkRef& chunk, float* delta,
                                                              BucketMemory where) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  const TensorState& state = tensors_[chunk.tensor];
  float* out = where == BucketMemory::state ? delta : chunk_values_;
  kernels::cuda::pseudo_gradient(state.global + chunk.begin, local_at(chunk), state.local.dtype,
                                 options_.bf16_delta, out, chunk.length, stream_);
  const std::optional<std::uint64_t> non_finite =
      kernels::cuda::first_non_finite(out, chunk.length, *workspace_, stream_);
  if (where == BucketMemory::host && !non_finite) {
    to_host(delta, chunk_values_, chunk.length * sizeof(float));
  }
  return non_finite;
}

void CudaStateMemory::hold_dense_sum(const ChunkRef& chunk, const float* sum, BucketMemory where) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  gated_ = false;  // the state changes
  float* held = tensors_[chunk.tensor].residual + chunk.begin;
  const std::size_t bytes = chunk.length * sizeof(float);
  if (where == BucketMemory::host) {
    to_device(held, sum, bytes);
    return;
  }
  if (bytes > 0) {
    check(cudaMemcpyAsync(held, sum, bytes, cudaMemcpyDeviceToDevice, as_stream(stream_)),
          "cudaMemcpyAsync (held sum)");
  }
  synchronize("cudaStreamSynchronize (held sum)");
}

void CudaStateMemory::load_gradient(const ChunkRef& chunk, const TensorView& gradient,
                                    float* bucket, BucketMemory where) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  float* out = where == BucketMemory::state ? bucket : chunk_values_;
  const std::byte* in =
      static_cast<const std::byte*>(gradient.data) + chunk.begin * dtype_size(gradient.dtype);
  if (gradient.dtype == DType::float32) {
    if (chunk.length > 0) {
      check(cudaMemcpyAsync(out, in, chunk.length * sizeof(float), cudaMemcpyDeviceToDevice,
                            as_stream(stream_)),
            "cudaMemcpyAsync (gradient to bucket)");
    }
  } else {
    widen_bf16(reinterpret_cast<const std::uint16_t*>(in), out, chunk.length, stream_);
  }
  if (where == BucketMemory::host) {
    to_host(bucket, chunk_values_, chunk.length * sizeof(float));
  } else {
    synchronize("cudaStreamSynchronize (gradient to bucket)");
  }
}

void CudaStateMemory::store_average(const ChunkRef& chunk, float* sum, float divisor,
                                    const TensorView& gradient, BucketMemory where) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  float* average = sum;
  if (where == BucketMemory::host) {
    to_device(chunk_values_, sum, chunk.length * sizeof(float));
    average = chunk_values_;
  }
  kernels::cuda::divide(average, chunk.length, divisor, stream_);
  // cast_local of the average: a copy for fp32, round-to-nearest-even to bf16 (as float_to_bf16).
  std::byte* out =
      static_cast<std::byte*>(gradient.data) + chunk.begin * dtype_size(gradient.dtype);
  kernels::cuda::reset_local(average, out, gradient.dtype, chunk.length, stream_);
  synchronize("cudaStreamSynchronize (averaged gradient)");
}

void CudaStateMemory::apply_dense_average(const ChunkRef& chunk, float divisor,
                                          const kernels::OuterStepParams& params) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  gated_ = false;  // the state changes
  TensorState& state = tensors_[chunk.tensor];
  float* g = state.residual + chunk.begin;
  kernels::cuda::divide(g, chunk.length, divisor, stream_);
  kernels::cuda::outer_step(state.global + chunk.begin, state.momentum + chunk.begin, g,
                            local_at(chunk), state.local.dtype, chunk.length, params, stream_);
  check(cudaMemsetAsync(g, 0, chunk.length * sizeof(float), as_stream(stream_)),
        "cudaMemsetAsync (held sum)");
}

// The whole-state operations enqueue chunk by chunk on the one stream (the pool would only
// contend for it) and return once the device is done.
void CudaStateMemory::global_from_local(ThreadPool& /*pool*/) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  gated_ = false;  // the state changes
  for (const ChunkRef& chunk : layout_.chunks()) {
    TensorState& state = tensors_[chunk.tensor];
    float* global = state.global + chunk.begin;
    if (state.local.dtype == DType::float32) {
      check(cudaMemcpyAsync(global, local_at(chunk), chunk.length * sizeof(float),
                            cudaMemcpyDeviceToDevice, as_stream(stream_)),
            "cudaMemcpyAsync (θ_g = θ_l)");
    } else {
      widen_bf16(reinterpret_cast<const std::uint16_t*>(local_at(chunk)), global, chunk.length,
                 stream_);
    }
    start_from_global(chunk);
  }
  synchronize("cudaStreamSynchronize (θ_g = θ_l)");
}

void CudaStateMemory::reset_local(ThreadPool& /*pool*/) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  gated_ = false;  // the state changes
  for (const ChunkRef& chunk : layout_.chunks()) {
    const TensorState& state = tensors_[chunk.tensor];
    kernels::cuda::reset_local(state.global + chunk.begin, local_at(chunk), state.local.dtype,
                               chunk.length, stream_);
    start_from_global(chunk);
  }
  synchronize("cudaStreamSynchronize (reset)");
}

void CudaStateMemory::commit_residual(ThreadPool& /*pool*/) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  gated_ = false;  // the state changes
  for (const ChunkRef& chunk : layout_.chunks()) {
    kernels::cuda::commit_residual(gate_chunk(chunk), tensors_[chunk.tensor].residual + chunk.begin,
                                   stream_);
  }
  synchronize("cudaStreamSynchronize (residual commit)");
}

void CudaStateMemory::zero_residual() {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  gated_ = false;  // the state changes
  for (TensorState& state : tensors_) {
    if (state.residual == nullptr) continue;
    check(cudaMemsetAsync(state.residual, 0, state.local.numel * sizeof(float), as_stream(stream_)),
          "cudaMemsetAsync (e = 0)");
  }
  synchronize("cudaStreamSynchronize (e = 0)");
}

Digest CudaStateMemory::digest(ThreadPool& /*pool*/) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  // The same parts, combined the same way, as HostStateMemory::digest: the bytes are the same.
  // Every buffer is hashed before the one synchronisation.
  std::vector<kernels::cuda::DeviceRange> buffers;
  buffers.reserve(tensors_.size() * 2);
  for (const TensorState& state : tensors_) {
    if (!keeps_global_state_) {
      buffers.push_back({state.local.data, state.local.bytes()});
      continue;
    }
    const std::size_t bytes = state.local.numel * sizeof(float);
    buffers.push_back({state.global, bytes});
    buffers.push_back({state.momentum, bytes});
  }
  const std::vector<Digest> digests = kernels::cuda::buffer_digests(buffers, *workspace_, stream_);
  if (keeps_global_state_) return combine_digests(digests);
  std::vector<Digest> parts(tensors_.size() * 2, 0);  // mode ddp: {θ_l, 0} per tensor
  for (std::size_t t = 0; t < tensors_.size(); ++t)
    parts[2 * t] = digests[t];
  return combine_digests(parts);
}

std::byte* CudaStateMemory::device_bytes(StateBuffer buffer, std::size_t tensor,
                                         Range range) const {
  const TensorState& state = tensors_[tensor];
  if (buffer == StateBuffer::local) {
    return static_cast<std::byte*>(state.local.data) + range.begin * dtype_size(state.local.dtype);
  }
  // Asked of the kept S, not of its storage: an empty tensor keeps an empty S.
  if (buffer == StateBuffer::start &&
      !(keeps_global_state_ && options_.overlap == Overlap::eager)) {
    throw InvalidArgument("no start point is kept (overlap eager only)");
  }
  float* values = buffer == StateBuffer::global     ? state.global
                  : buffer == StateBuffer::momentum ? state.momentum
                  : buffer == StateBuffer::start    ? state.start
                                                    : state.residual;
  return reinterpret_cast<std::byte*>(values + range.begin);
}

namespace {
std::size_t element_bytes(StateBuffer buffer, DType local_dtype) {
  return buffer == StateBuffer::local ? dtype_size(local_dtype) : sizeof(float);
}
}  // namespace

void CudaStateMemory::read_host(StateBuffer buffer, std::size_t tensor, Range range,
                                const ReadPiece& read) {
  transfer(buffer, tensor, range, /*write_back=*/false,
           [&](std::uint64_t offset, std::span<std::byte> piece) { read(offset, piece); });
}

void CudaStateMemory::update_host(StateBuffer buffer, std::size_t tensor, Range range,
                                  const WritePiece& write) {
  transfer(buffer, tensor, range, /*write_back=*/true, write);
}

void CudaStateMemory::transfer(StateBuffer buffer, std::size_t tensor, Range range, bool write_back,
                               const WritePiece& visit) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  if (write_back) gated_ = false;  // the state changes
  std::byte* device = device_bytes(buffer, tensor, range);
  const std::size_t bytes = range.count * element_bytes(buffer, tensors_[tensor].local.dtype);
  for (std::size_t offset = 0; offset < bytes; offset += staging_bytes_) {
    const std::size_t piece = std::min(staging_bytes_, bytes - offset);
    // The piece starts as the buffer's content (`visit` may leave parts of it as they are).
    check(cudaMemcpyAsync(staging_, device + offset, piece, cudaMemcpyDeviceToHost,
                          as_stream(stream_)),
          "cudaMemcpyAsync (state to host)");
    synchronize("cudaStreamSynchronize (state to host)");
    visit(offset, std::span<std::byte>(staging_, piece));
    if (!write_back) continue;
    check(cudaMemcpyAsync(device + offset, staging_, piece, cudaMemcpyHostToDevice,
                          as_stream(stream_)),
          "cudaMemcpyAsync (host to state)");
    synchronize("cudaStreamSynchronize (host to state)");
  }
}

// The patch kernel compares bf16(θ_g) with the bits sent last time (+0 before the first call, so
// that the first call sends every element that is not +0) and updates them; only the changed
// entries, 6 bytes each, cross to the host.
std::uint64_t CudaStateMemory::update_bf16_mirror(std::vector<std::vector<std::uint16_t>>& mirror) {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  if (!keeps_global_state_) throw InvalidArgument("mode ddp keeps no θ_g to publish");
  if (patch_values_ == nullptr) {
    patch_values_ = device_alloc<std::uint16_t>(chunk_capacity_, "cudaMalloc (patch values)");
  }
  mirror.resize(tensors_.size());
  for (std::size_t t = 0; t < tensors_.size(); ++t) {
    TensorState& state = tensors_[t];
    const std::uint64_t n = state.local.numel;
    if (state.sent_bits == nullptr && n > 0) {
      state.sent_bits = device_alloc<std::uint16_t>(n, "cudaMalloc (published bits)");
      check(cudaMemsetAsync(state.sent_bits, 0, n * sizeof(std::uint16_t), as_stream(stream_)),
            "cudaMemsetAsync (published bits = +0)");
      mirror[t].assign(n, 0);
    }
    mirror[t].resize(n);
  }
  std::uint64_t changed = 0;
  for (const ChunkRef& chunk : layout_.chunks()) {
    TensorState& state = tensors_[chunk.tensor];
    const kernels::PatchResult result = kernels::cuda::extract_patch(
        kernels::PatchChunk{.snapshot = state.sent_bits + chunk.begin,
                            .current = state.global + chunk.begin,
                            .current_dtype = DType::float32,
                            .count = chunk.length},
        kernels::PatchOutput{.offsets = gate_offsets_, .values = patch_values_}, *workspace_,
        stream_);
    kernels::check_patch_finite(result, layout_.tensors()[chunk.tensor].name, chunk.begin);
    if (result.changed == 0) continue;
    // Offsets then values, together at most 6 bytes per chunk element: within the staging.
    const std::size_t offset_bytes = result.changed * sizeof(std::uint32_t);
    check(cudaMemcpyAsync(staging_, gate_offsets_, offset_bytes, cudaMemcpyDeviceToHost,
                          as_stream(stream_)),
          "cudaMemcpyAsync (patch offsets)");
    check(cudaMemcpyAsync(staging_ + offset_bytes, patch_values_,
                          result.changed * sizeof(std::uint16_t), cudaMemcpyDeviceToHost,
                          as_stream(stream_)),
          "cudaMemcpyAsync (patch values)");
    synchronize("cudaStreamSynchronize (patch entries)");
    std::uint16_t* bits = mirror[chunk.tensor].data() + chunk.begin;
    for (std::uint64_t k = 0; k < result.changed; ++k) {
      std::uint32_t offset = 0;
      std::uint16_t value = 0;
      std::memcpy(&offset, staging_ + k * sizeof(std::uint32_t), sizeof offset);
      std::memcpy(&value, staging_ + offset_bytes + k * sizeof(std::uint16_t), sizeof value);
      bits[offset] = value;
    }
    changed += result.changed;
  }
  return changed;
}

void CudaStateMemory::set_caller_stream(void* stream) {
  const std::scoped_lock lock(mutex_);
  caller_stream_ = stream;
}

void CudaStateMemory::begin_access() {
  const std::scoped_lock lock(mutex_);
  const DeviceGuard guard(device_);
  gated_ = false;  // the caller may have changed θ_l
  check(cudaEventRecord(as_event(caller_ready_), as_stream(caller_stream_)),
        "cudaEventRecord (caller's stream)");
  check(cudaStreamWaitEvent(as_stream(stream_), as_event(caller_ready_), 0),
        "cudaStreamWaitEvent (engine after caller)");
}

void CudaStateMemory::end_access() noexcept {
  const std::scoped_lock lock(mutex_);
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device_);
  cudaError_t status = cudaEventRecord(as_event(access_done_), as_stream(stream_));
  if (status == cudaSuccess) {
    status = cudaStreamWaitEvent(as_stream(caller_stream_), as_event(access_done_), 0);
  }
  if (status != cudaSuccess) {
    // The caller's next kernels may then start before the window's last ones: wait here.
    logger().warn("cannot order the caller's stream after the engine's ({}); synchronising",
                  cudaGetErrorString(status));
    cudaStreamSynchronize(as_stream(stream_));
  }
  cudaSetDevice(previous);
}

}  // namespace pulseloco::engine_detail
