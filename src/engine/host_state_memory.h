// Internal: the state in host memory, computed by the CPU kernels (kernels/window_kernels.h).
// θ_l is the caller's host tensor; θ_g, m and e are std::vector buffers (none in mode ddp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <pulseloco/engine/scratch_pool.h>
#include <pulseloco/engine/state_memory.h>

namespace pulseloco::engine_detail {

class HostStateMemory final : public StateMemory {
 public:
  // `piece_bytes` bounds the pieces of read_host/update_host (0: a range comes whole); only
  // tests bound it, to run the piecewise path of files and transfers without a device.
  explicit HostStateMemory(StateTensors tensors, std::uint64_t piece_bytes = 0);

  [[nodiscard]] std::string location() const override { return "host"; }
  [[nodiscard]] Device device() const noexcept override { return Device{}; }

  [[nodiscard]] kernels::GateResult gate(const ChunkRef& chunk, std::uint32_t* offsets,
                                         float* values) override;
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
  [[nodiscard]] std::span<const float> host_values(StateBuffer buffer, std::size_t tensor) override;

 private:
  struct TensorState {
    TensorView local;
    std::vector<float> global;
    std::vector<float> momentum;
    // pulse: the residual e. diloco: the window's summed pseudo-gradient until it commits.
    std::vector<float> residual;
    // overlap = eager: the start point S of θ_l's inner steps (empty otherwise: S is θ_g).
    std::vector<float> start;
  };

  [[nodiscard]] std::span<std::byte> bytes_of(StateBuffer buffer, std::size_t tensor, Range range);
  [[nodiscard]] kernels::GateChunk gate_chunk(const ChunkRef& chunk) const;
  [[nodiscard]] std::byte* local_at(const ChunkRef& chunk) const;
  // S = θ_g on the chunk (when S is kept).
  void start_from_global(const ChunkRef& chunk);

  Layout layout_;
  // The options the kernels' calls are built from (one place to read them, for every call).
  EngineOptions options_;
  std::vector<TensorState> tensors_;
  bool keeps_global_state_;
  std::uint64_t piece_bytes_;
  // The aggregate g of one chunk, per chunk in flight.
  ScratchPool<std::vector<float>> aggregate_scratch_;
  // The momentum copy of an eager start point, per chunk in flight.
  ScratchPool<std::vector<float>> momentum_scratch_;
};

}  // namespace pulseloco::engine_detail
