// Internal: where θ_g, m and e live and the kernels that run there. ReplicatedState keeps the
// bookkeeping (layout, window counter, commit protocol) and calls one StateMemory for every
// computation on the buffers, so the window strategies, files and state transfer have one code
// path whatever the memory:
//
//   HostStateMemory  (host_state_memory.h)       std::vector buffers, kernels/window_kernels.h
//   CudaStateMemory  (cuda/cuda_state_memory.h)  device buffers on the parameters' device, on a
//                                                stream of its own, kernels/cuda; registered by
//                                                pulseloco_engine_cuda when a program links it
//
// Every memory takes and gives host buffers at its interface (the codec and the collectives
// work on host bytes), except the dense modes' buckets, which may live in the memory's own
// storage (a Bucket) when the transport takes buffers there (NCCL on the state's device): the
// dense all-reduce then moves the payload without a host round trip. Every memory computes with
// the same kernels' contract, so a host rank and a device rank hold identical bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/tensor_view.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/engine/layout.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::engine_detail {

// A tensor's buffers: θ_g, m and e are fp32; θ_l is in the model's dtype; `start` is the eager
// start point S of overlapped windows (fp32, kept only with overlap = eager, beside θ_g).
enum class StateBuffer : std::uint8_t { global, momentum, residual, local, start };

// Elements of one tensor's buffer.
struct Range {
  std::uint64_t begin = 0;
  std::uint64_t count = 0;
};

// What a memory is created for: the layout, θ_l (the user's tensors, all on the memory's
// device) and whether θ_g, m and e exist (not in mode ddp).
struct StateTensors {
  Layout layout;
  std::vector<TensorView> locals;
  bool keeps_global_state = true;
  const EngineOptions* options = nullptr;
};

// Receives consecutive pieces of a range in host memory: `offset` is the piece's first byte
// within the range. Pieces cover the range in order.
using ReadPiece = std::function<void(std::uint64_t offset, std::span<const std::byte> piece)>;
// Fills consecutive pieces of a range in host memory; what it leaves there becomes the buffer's
// content.
using WritePiece = std::function<void(std::uint64_t offset, std::span<std::byte> piece)>;

// Where a dense bucket lives: host memory, or the state memory's own storage (its device for a
// CUDA memory; host memory for the host memory).
enum class BucketMemory : std::uint8_t { host, state };

// A dense exchange bucket: `capacity` floats in `where`'s memory.
struct Bucket {
  std::unique_ptr<float, void (*)(float*)> values{nullptr, nullptr};
  std::uint64_t capacity = 0;
  BucketMemory where = BucketMemory::host;
};

// `elements` floats of host memory.
[[nodiscard]] Bucket host_bucket(std::uint64_t elements);

class StateMemory {
 public:
  virtual ~StateMemory() = default;

  // "host", or "cuda:<ordinal>".
  [[nodiscard]] virtual std::string location() const = 0;
  // Where the buffers live (the CPU for host memory): a transport whose buffer_device() is this
  // device takes the memory's buckets as they are.
  [[nodiscard]] virtual Device device() const noexcept = 0;

  // --- one window, chunk by chunk (docs/algorithm.md); callers may run chunks in parallel ----
  // A window's phases bracket the per-chunk calls, so that a device memory needs the host once
  // per phase, not once per chunk: begin_gate() before a window's gate() calls, end_apply()
  // after its aggregate_and_commit, aggregate_and_step or start_from_own calls. A host memory
  // computes in the per-chunk calls and does nothing in these two.

  // Every chunk's gate at once (a device memory computes them here, with one synchronisation).
  virtual void begin_gate() {}
  // Steps 1-5 without the state change: the fired (offset, s) entries into host buffers with
  // room for chunk.length entries. A device memory hands out what begin_gate() computed, and
  // throws InvalidArgument when the state changed since.
  [[nodiscard]] virtual kernels::GateResult gate(const ChunkRef& chunk, std::uint32_t* offsets,
                                                 float* values) = 0;
  // Waits until the state changes the per-chunk calls enqueued are done (a device memory
  // enqueues them without waiting), and reports a failure among them.
  virtual void end_apply() {}
  // Step 7 from the ranks' decoded entries (host memory, validated), then step 5's state
  // change, 8 and 9.
  virtual void aggregate_and_commit(const ChunkRef& chunk,
                                    std::span<const kernels::SparseEntries> ranks_in_order,
                                    const kernels::OuterStepParams& params) = 0;
  // --- overlapped windows (docs/algorithm.md, "Overlapped windows") ---------------------------
  // With overlap = eager the memory keeps a start point S per element (gate and
  // commit_residual measure Δ against S instead of θ_g); every call that sets θ_l = cast(θ_g)
  // sets S = θ_g too.

  // Steps 7 and 8 without the residual commit, then θ_l = cast(θ_g) (and S = θ_g).
  virtual void aggregate_and_step(const ChunkRef& chunk,
                                  std::span<const kernels::SparseEntries> ranks_in_order,
                                  const kernels::OuterStepParams& params) = 0;
  // Eager start point: S = the outer step from θ_g and m with this rank's own entries as g (m
  // is not changed); then θ_l = cast(S).
  virtual void start_from_own(const ChunkRef& chunk, const kernels::SparseEntries& own,
                              const kernels::OuterStepParams& params) = 0;
  // θ_l = cast(S) everywhere (S was loaded from a checkpoint). No-op when S is not kept.
  virtual void local_from_start(ThreadPool& pool) = 0;
  // e[offset] = value for each entry: a dropped window's entries go back to the residual.
  virtual void restore_residual(const ChunkRef& chunk, const kernels::SparseEntries& own) = 0;

  // --- dense modes: buckets of chunk.length floats in `where` (host, or allocate_bucket's) ------

  // `elements` floats in the memory's own storage (BucketMemory::state).
  [[nodiscard]] virtual Bucket allocate_bucket(std::uint64_t elements) = 0;
  // Δ of every element into `delta`; returns the lowest index of a non-finite Δ, if any. A
  // bucket in the memory's storage is complete when this returns.
  [[nodiscard]] virtual std::optional<std::uint64_t> pseudo_gradient(const ChunkRef& chunk,
                                                                     float* delta,
                                                                     BucketMemory where) = 0;
  // Mode diloco: keeps the ranks' summed Δ until the window commits, in e's storage; `sum` may
  // be reused when this returns.
  virtual void hold_dense_sum(const ChunkRef& chunk, const float* sum, BucketMemory where) = 0;
  // Mode ddp: the chunk of `gradient` (a tensor like θ_l, in the memory's location) as fp32
  // into `bucket`, complete when this returns.
  virtual void load_gradient(const ChunkRef& chunk, const TensorView& gradient, float* bucket,
                             BucketMemory where) = 0;
  // Mode ddp: gradient = sum / divisor (true division, then cast to the gradient's dtype);
  // `sum` may be overwritten, and reused when this returns.
  virtual void store_average(const ChunkRef& chunk, float* sum, float divisor,
                             const TensorView& gradient, BucketMemory where) = 0;
  // Mode diloco: g = held sum / divisor, steps 8 and 9; the held sum is cleared.
  virtual void apply_dense_average(const ChunkRef& chunk, float divisor,
                                   const kernels::OuterStepParams& params) = 0;

  // --- the whole state ------------------------------------------------------------------------

  virtual void global_from_local(ThreadPool& pool) = 0;  // θ_g = float(θ_l)
  virtual void reset_local(ThreadPool& pool) = 0;        // θ_l = cast_local(θ_g)
  virtual void commit_residual(ThreadPool& pool) = 0;    // step 5's state change alone
  virtual void zero_residual() = 0;
  // Step 10: combine_digests over every tensor's {θ_g, m} digests (mode ddp: {θ_l, 0}).
  [[nodiscard]] virtual Digest digest(ThreadPool& pool) = 0;

  // --- host access (files, state transfer, tools) ---------------------------------------------
  // Pieces are bounded by the memory (a device memory stages through a pinned buffer of a
  // chunk's size); callers must accept any split.

  virtual void read_host(StateBuffer buffer, std::size_t tensor, Range range,
                         const ReadPiece& read) = 0;
  virtual void update_host(StateBuffer buffer, std::size_t tensor, Range range,
                           const WritePiece& write) = 0;

  // The fp32 buffer (θ_g, m or e) itself, when it is in host memory; a device memory throws
  // InvalidArgument (copy it with read_host).
  [[nodiscard]] virtual std::span<const float> host_values(StateBuffer buffer, std::size_t tensor);

  // Publishing from a device memory: brings `mirror` (one vector of bf16 bits per tensor, sized
  // here on first use) to bf16(θ_g), moving only the elements whose bits changed since the
  // previous call (the memory keeps its own copy of the bits it sent). Returns how many changed.
  // A NaN in θ_g throws NonFiniteError naming the tensor and element; the chunks before it are
  // already in the mirror, so the mirror and the memory's copy still agree. A host memory
  // throws InvalidArgument (publishing reads its θ_g in place, host_values).
  virtual std::uint64_t update_bf16_mirror(std::vector<std::vector<std::uint16_t>>& mirror);

  // --- ordering with the caller's own device work (device memories only) -----------------------

  // The window's device work runs after what `stream` (a cudaStream_t of the parameters'
  // device; nullptr: the legacy default stream) holds when it starts, and `stream`'s later work
  // after the window. Host memories ignore it.
  virtual void set_caller_stream(void* /*stream*/) {}
  // Called before and after the engine touches the state (a window, an attach, a file).
  virtual void begin_access() {}
  virtual void end_access() noexcept {}
};

// The memory for `tensors` in the location `options.state_location` selects (automatic: the
// device memory for CUDA tensors, the host memory otherwise). Throws InvalidArgument naming the
// tensor when the tensors are on several devices, when CUDA tensors reach a program without
// pulseloco_engine_cuda, or when state_location=device gets CPU tensors.
[[nodiscard]] std::unique_ptr<StateMemory> make_state_memory(StateTensors tensors);

// How pulseloco_engine_cuda makes its memory (registered before main()).
using DeviceStateMemoryFactory = std::unique_ptr<StateMemory> (*)(StateTensors tensors);
void register_device_state_memory(DeviceStateMemoryFactory factory) noexcept;

}  // namespace pulseloco::engine_detail
