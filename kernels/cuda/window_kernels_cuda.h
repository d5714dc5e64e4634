// The window kernels on CUDA: the contract of kernels/window_kernels.h for device buffers, with
// the same bits as the CPU kernels (tests/gpu/window_kernels_cuda_test.cu compares them).
//
// Include without CUDA headers: streams are passed as `void* stream` (a cudaStream_t; nullptr is
// the legacy default stream). Every pointer in the arguments (chunks, outputs, SparseEntries
// spans) is device memory of the current device; the std::span objects themselves live on the
// host and are only used for their sizes and addresses. Kernels are enqueued on `stream` and
// run asynchronously, except where a result must reach the host (gate's count, aggregate's
// validation, digests): those functions synchronise `stream` before returning. A whole window
// needs the host only once per phase: enqueue_gate and enqueue_aggregate report through device
// memory, and buffer_digests hashes every buffer before its one synchronisation.
//
// Arithmetic uses explicitly rounded intrinsics (__fadd_rn, __fsub_rn, __fmul_rn, __fdiv_rn,
// __fmaf_rn, the last only for the two fused steps of step 8) and base/bf16.h's rounding, so a
// GPU replica and a CPU replica produce identical bits. Nothing depends on scheduling: the gate
// compacts with a stable CUB DeviceSelect, the aggregate adds one rank per launch in rank order
// (offsets are unique within a rank), and the only atomic (atomicMin of the first non-finite
// offset) has an order-independent result.
//
// Every CUDA failure becomes a pulseloco::IoError naming the call and the CUDA error; invalid
// arguments are InvalidArgument, as on the CPU. Only built when PULSELOCO_HAS_CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::kernels::cuda {

// Scratch for the CUDA kernels on one device, to be used by one stream at a time: CUB temporary
// storage for the gate (grown on demand), device counters with their pinned host mirror, and
// the scratch of buffer digests (bounded, grown on demand). Created on the current device; every
// call that takes it must run with that device current.
class DeviceWorkspace {
 public:
  // Reserves CUB storage for chunks of up to `expected_chunk_elements` (more is allocated when a
  // larger chunk comes; reserving avoids a cudaMalloc in the first window).
  explicit DeviceWorkspace(std::uint64_t expected_chunk_elements = 0);
  ~DeviceWorkspace();
  DeviceWorkspace(DeviceWorkspace&&) noexcept;
  DeviceWorkspace& operator=(DeviceWorkspace&&) noexcept;
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;

  [[nodiscard]] int device() const noexcept;

  struct Impl;
  [[nodiscard]] Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// Steps 1-5 for one chunk (see kernels::gate): writes the fired (offset, s) entries, offsets
// ascending, into device buffers with room for chunk.count entries, and returns the count (or
// the lowest non-finite offset, with fired = 0). Synchronises `stream`.
[[nodiscard]] GateResult gate(const GateChunk& chunk, std::uint32_t* out_offsets, float* out_values,
                              DeviceWorkspace& workspace, void* stream);

// ---- a whole window's gate with one synchronisation ------------------------------------------
// The chunks' gates are enqueued one after the other without waiting; their entries are packed
// into one output the host reads after a single synchronisation of the stream.

// What enqueue_gate reports for one chunk (device memory, read by the host after the stream is
// synchronised).
struct GateSlot {
  unsigned long long first = 0;  // index of the chunk's first entry in the packed output
  long long fired = 0;           // entries the chunk fired (counted even beyond the capacity)
  unsigned long long non_finite_min = ~0ull;  // lowest non-finite offset; ~0 when none
};

// Where enqueue_gate writes. `offsets` and `values` have room for `capacity` entries in memory
// the device writes (device memory, or mapped pinned host memory: the entries then cross to the
// host as the kernels write them). `cursor` is one device counter: the number of entries the
// chunks enqueued so far fired; `slots` (device memory) has one GateSlot per chunk.
struct PackedGateOutput {
  std::uint32_t* offsets = nullptr;
  float* values = nullptr;
  std::uint64_t capacity = 0;
  unsigned long long* cursor = nullptr;
  GateSlot* slots = nullptr;
};

// Sets the cursor to 0 and `slots` slots to "nothing fired, all finite".
void begin_packed_gate(const PackedGateOutput& out, std::size_t slots, void* stream);

// Steps 1-5 for one chunk, as gate() computes them, enqueued on `stream` without synchronising:
// the fired entries, offsets ascending, go to the packed output from its cursor on (entries
// beyond its capacity are counted but not written: the caller sees the total exceed the
// capacity and enqueues the window again into a larger output), and out.slots[slot] says where.
void enqueue_gate(const GateChunk& chunk, std::size_t slot, const PackedGateOutput& out,
                  DeviceWorkspace& workspace, void* stream);

// e = fire ? 0 : s, recomputed as gate() computes them (see kernels::commit_residual).
void commit_residual(const GateChunk& chunk, float* residual_out, void* stream);

// Step 7 as aggregate() computes it, enqueued without synchronising: for entries the host has
// already validated. The offsets are checked on the device all the same; an entry that breaks
// the rule writes nothing and records (rank << 32 | entry) in `bad_entry_min` (device memory,
// lowest wins), which the caller reads once the stream is synchronised.
void enqueue_aggregate(std::span<const SparseEntries> ranks_in_order, float* g, std::uint64_t count,
                       unsigned long long* bad_entry_min, void* stream);

// Step 7 (see kernels::aggregate). Validates every rank's offsets on the device (strictly
// ascending, below `count`) and synchronises `stream` before writing `g`; throws
// InvalidArgument naming the rank (peer) and entry index when they are not.
void aggregate(std::span<const SparseEntries> ranks_in_order, float* g, std::uint64_t count,
               DeviceWorkspace& workspace, void* stream);

// Steps 8 and 9 (see kernels::outer_step).
void outer_step(float* global, float* momentum, const float* g, void* local, DType local_dtype,
                std::uint64_t count, const OuterStepParams& params, void* stream);

// commit_residual then outer_step in one pass (see kernels::commit_and_outer_step).
void commit_and_outer_step(const WindowChunk& chunk, const float* g, const OuterStepParams& params,
                           void* stream);

// θ_l = cast_local(θ_g).
void reset_local(const float* global, void* local, DType local_dtype, std::uint64_t count,
                 void* stream);

// Δ of step 1 as `bf16_delta` defines it (see kernels::pseudo_gradient).
void pseudo_gradient(const float* global, const void* local, DType local_dtype,
                     Bf16Delta bf16_delta, float* delta, std::uint64_t count, void* stream);

// values[i] = values[i] / divisor (a true division).
void divide(float* values, std::uint64_t count, float divisor, void* stream);

// The lowest index of a non-finite value among `count` device floats (nullopt when all are
// finite), after the work already enqueued on `stream`. Synchronises `stream`.
[[nodiscard]] std::optional<std::uint64_t> first_non_finite(const float* values,
                                                            std::uint64_t count,
                                                            DeviceWorkspace& workspace,
                                                            void* stream);

// buffer_digest (base/digest.h) of `bytes` bytes of device memory: the same value as the CPU's
// for the same bytes. The pieces are hashed on the device; only their digests (8 bytes per
// 4 MiB) cross to the host, where they are combined. Synchronises `stream` (after the work
// already enqueued on it).
[[nodiscard]] Digest buffer_digest(const void* device_bytes, std::size_t bytes,
                                   DeviceWorkspace& workspace, void* stream);

// buffer_digest of several device buffers: every piece of every buffer is hashed before the
// one synchronisation of `stream`.
struct DeviceRange {
  const void* data = nullptr;
  std::size_t bytes = 0;
};
[[nodiscard]] std::vector<Digest> buffer_digests(std::span<const DeviceRange> buffers,
                                                 DeviceWorkspace& workspace, void* stream);

// kernels::state_digest of device buffers: the same value as the CPU's for the same bytes.
[[nodiscard]] Digest state_digest(std::span<const float> global, std::span<const float> momentum,
                                  DeviceWorkspace& workspace, void* stream);

}  // namespace pulseloco::kernels::cuda
