// Internal: the state on the parameters' CUDA device (state_memory.h). θ_g, m and e are
// cudaMalloc'd next to θ_l; every step runs the CUDA kernels (kernels/cuda/window_kernels_cuda.h)
// on a stream of the memory's own, so a device rank holds the same bits as a host rank. Only the
// fired entries, the decoded entries of the other ranks, dense buckets (diloco) and file or
// transfer pieces cross PCIe, through pinned buffers sized by what crosses (a chunk's for
// buckets and files, a window's entries for the gate and the apply); no model-sized host buffer
// exists. Overlapped windows keep their start point S (overlap = eager) on the device too.
//
// The engine's thread pool calls the per-chunk operations in parallel: they are serialised here
// (one stream, one workspace), and the device is set for the calling thread on each call. A
// window needs the host once per phase, not once per chunk: begin_gate() enqueues every
// chunk's gate and synchronises once, the kernels writing the fired entries straight into
// mapped pinned host memory that gate() then reads; the per-chunk aggregates and outer steps
// are enqueued without waiting (the ranks' entries cross through a pinned arena that is reused
// only once the stream has passed them), and end_apply() synchronises once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <pulseloco/engine/state_memory.h>
#include <pulseloco/kernels/cuda/window_kernels_cuda.h>

namespace pulseloco::engine_detail {

class CudaStateMemory final : public StateMemory {
 public:
  // Every θ_l is on CUDA device `tensors.locals[0].device.index` (make_state_memory checked).
  explicit CudaStateMemory(StateTensors tensors);
  ~CudaStateMemory() override;
  CudaStateMemory(const CudaStateMemory&) = delete;
  CudaStateMemory& operator=(const CudaStateMemory&) = delete;

  [[nodiscard]] std::string location() const override;
  [[nodiscard]] Device device() const noexcept override {
    return Device{DeviceKind::cuda, device_};
  }

  void begin_gate() override;
  [[nodiscard]] kernels::GateResult gate(const ChunkRef& chunk, std::uint32_t* offsets,
                                         float* values) override;
  void end_apply() override;
  void aggregate_and_commit(const ChunkRef& chunk,
                            std::span<const kernels::SparseEntries> ranks_in_order,
                            const kernels::OuterStepParams& params) override;
  void aggregate_and_step(const ChunkRef& chunk,
                          std::span<const kernels::SparseEntries> ranks_in_order,
                          const kernels::OuterStepParams& params) override;
  void start_from_own(const ChunkRef& chunk, const kernels::SparseEntries& own,
                      const kernels::OuterStepParams& params) override;
  void local_from_start(ThreadPool& pool) override;
  void restore_residual(const ChunkRef& chunk, const kernels::SparseEntries& own) override;
  [[nodiscard]] Bucket allocate_bucket(std::uint64_t elements) override;
  [[nodiscard]] std::optional<std::uint64_t> pseudo_gradient(const ChunkRef& chunk, float* delta,
                                                             BucketMemory where) override;
  void hold_dense_sum(const ChunkRef& chunk, const float* sum, BucketMemory where) override;
  void load_gradient(const ChunkRef& chunk, const TensorView& gradient, float* bucket,
                     BucketMemory where) override;
  void store_average(const ChunkRef& chunk, float* sum, float divisor, const TensorView& gradient,
                     BucketMemory where) override;
  void apply_dense_average(const ChunkRef& chunk, float divisor,
                           const kernels::OuterStepParams& params) override;

  void global_from_local(ThreadPool& pool) override;
  void reset_local(ThreadPool& pool) override;
  void commit_residual(ThreadPool& pool) override;
  void zero_residual() override;
  [[nodiscard]] Digest digest(ThreadPool& pool) override;

  void read_host(StateBuffer buffer, std::size_t tensor, Range range,
                 const ReadPiece& read) override;
  void update_host(StateBuffer buffer, std::size_t tensor, Range range,
                   const WritePiece& write) override;
  std::uint64_t update_bf16_mirror(std::vector<std::vector<std::uint16_t>>& mirror) override;

  void set_caller_stream(void* stream) override;
  void begin_access() override;
  void end_access() noexcept override;

 private:
  struct TensorState {
    TensorView local;         // the caller's tensor, on the device
    float* global = nullptr;  // device
    float* momentum = nullptr;
    float* residual = nullptr;           // pulse: e; diloco: the held sum
    float* start = nullptr;              // overlap = eager: the start point S; else none
    std::uint16_t* sent_bits = nullptr;  // publishing: the bf16 bits of θ_g last mirrored
  };
  // Device buffers for one rank's entries of a chunk (aggregate).
  struct RankEntries {
    std::uint32_t* offsets = nullptr;
    float* values = nullptr;
    std::uint64_t capacity = 0;
  };
  class DeviceGuard;

  void allocate(const StateTensors& tensors);
  void release() noexcept;

  [[nodiscard]] kernels::GateChunk gate_chunk(const ChunkRef& chunk) const;
  // The index of `chunk` in the layout; throws InvalidArgument for a chunk not in it.
  [[nodiscard]] std::size_t chunk_index(const ChunkRef& chunk) const;
  // Room for `entries` packed gate entries (mapped pinned host memory). Hold mutex_.
  void reserve_packed_gate(std::uint64_t entries);
  // Room for `bytes` more in the entry arena, reusing it once the stream has passed what it
  // holds. Returns where they start. Hold mutex_.
  std::byte* reserve_entry_arena(std::size_t bytes);
  // The ranks' host entries of a chunk copied to the device (rank_entries_), and g = their
  // aggregate in chunk_values_. Hold mutex_.
  float* aggregate_on_device(const ChunkRef& chunk,
                             std::span<const kernels::SparseEntries> ranks_in_order);
  // S = θ_g over the chunk, when S is kept. Hold mutex_.
  void start_from_global(const ChunkRef& chunk);
  [[nodiscard]] std::byte* local_at(const ChunkRef& chunk) const;
  [[nodiscard]] std::byte* device_bytes(StateBuffer buffer, std::size_t tensor, Range range) const;
  // Device <-> host copies through the pinned staging, in pieces; each returns once the copy is
  // complete. Hold mutex_.
  void to_host(void* host, const void* device, std::size_t bytes);
  void to_device(void* device, const void* host, std::size_t bytes);
  void synchronize(const char* what);
  // read_host and update_host: `visit` sees each piece in the staging; with `write_back` the
  // piece then goes back to the device.
  void transfer(StateBuffer buffer, std::size_t tensor, Range range, bool write_back,
                const WritePiece& visit);

  Layout layout_;
  // The options the kernels' calls are built from (one place to read them, for every call).
  EngineOptions options_;
  std::vector<TensorState> tensors_;
  bool keeps_global_state_;
  int device_;
  std::uint64_t chunk_capacity_;  // elements of the largest chunk

  std::mutex mutex_;               // one stream and one workspace: one operation at a time
  void* stream_ = nullptr;         // cudaStream_t of the memory's own
  void* caller_stream_ = nullptr;  // cudaStream_t whose work the accesses are ordered with
  void* caller_ready_ = nullptr;   // cudaEvent_t recorded on caller_stream_
  void* access_done_ = nullptr;    // cudaEvent_t recorded on stream_
  std::unique_ptr<kernels::cuda::DeviceWorkspace> workspace_;
  std::uint32_t* gate_offsets_ = nullptr;  // device, chunk_capacity_
  float* chunk_values_ = nullptr;          // device, chunk_capacity_: gate values, g, Δ
  float* momentum_copy_ = nullptr;         // device, chunk_capacity_ (overlap = eager)
  std::uint16_t* patch_values_ = nullptr;  // device, chunk_capacity_ (publishing)
  std::vector<RankEntries> rank_entries_;
  std::byte* staging_ = nullptr;  // pinned host memory
  std::size_t staging_bytes_ = 0;

  // The window's gate (begin_gate): the packed entries in mapped pinned host memory, one slot
  // per chunk (device, with a pinned mirror), and the device cursor of the packing.
  std::uint32_t* packed_offsets_ = nullptr;  // pinned, mapped
  float* packed_values_ = nullptr;           // pinned, mapped
  std::uint64_t packed_capacity_ = 0;
  kernels::cuda::GateSlot* gate_slots_ = nullptr;       // device, one per chunk
  kernels::cuda::GateSlot* host_gate_slots_ = nullptr;  // pinned
  unsigned long long* gate_cursor_ = nullptr;           // device
  bool gated_ = false;  // the slots describe the current state (cleared by every change)

  // The ranks' entries of the chunks being applied, on their way to the device (pinned).
  std::byte* entry_arena_ = nullptr;
  std::size_t entry_arena_bytes_ = 0;
  std::size_t entry_arena_used_ = 0;
  // The first entry the device found breaking the offset rule since the last end_apply().
  unsigned long long* bad_entry_min_ = nullptr;       // device
  unsigned long long* host_bad_entry_min_ = nullptr;  // pinned
};

// Widens bf16 θ_l to fp32 θ_g on the device (float bits = bf16 bits << 16, as base/bf16.h).
void widen_bf16(const std::uint16_t* local, float* global, std::uint64_t count, void* stream);

}  // namespace pulseloco::engine_detail
