// Internal: the state the engine replicates, and where it lives. For every parameter tensor: θ_l
// (the user's tensor), θ_g and m (identical on every rank) and this rank's residual e; for the
// whole model: the layout in chunks and buckets, the window counter and where this rank stands
// in the group's commit protocol.
//
// Every computation on the buffers goes through this class: the window's steps chunk by chunk
// (the window strategies call them, in parallel across chunks), the whole-state operations of
// start-up and resume, the digest, and host access for files and state transfer. The buffers
// live in host memory and the kernels are kernels/window_kernels.h; state kept on a device
// would change this class alone (its strategies, files and transfers see only these calls).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/tensor_view.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/layout.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/scratch_pool.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::engine_detail {

// A tensor's buffers: θ_g, m and e are fp32; θ_l is in the model's dtype.
enum class StateBuffer : std::uint8_t { global, momentum, residual, local };

class ReplicatedState {
 public:
  // No tensors: the state of an engine whose parameters were refused.
  ReplicatedState() = default;
  // Validates the parameter table (dtype, device, data, shape, unique names) and lays it out;
  // allocates θ_g, m and e as zeros (mode ddp keeps none: its replicas' state is θ_l itself).
  // Throws InvalidArgument naming the tensor.
  ReplicatedState(std::vector<NamedTensor> parameters, const EngineOptions& options);

  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }
  [[nodiscard]] std::size_t tensor_count() const noexcept { return tensors_.size(); }
  [[nodiscard]] const std::string& name(std::size_t tensor) const {
    return layout_.tensors()[tensor].name;
  }
  // The shape recorded in files ({numel} when the caller gave none).
  [[nodiscard]] const std::vector<std::uint64_t>& shape(std::size_t tensor) const {
    return tensors_[tensor].shape;
  }
  [[nodiscard]] DType local_dtype(std::size_t tensor) const { return tensors_[tensor].local.dtype; }
  // False in mode ddp: no θ_g, m or e.
  [[nodiscard]] bool keeps_global_state() const noexcept { return keeps_global_state_; }

  // --- where this rank stands --------------------------------------------------------------

  [[nodiscard]] std::uint64_t window() const noexcept { return window_; }  // windows committed
  // False until the first outer step (which sets m = g).
  [[nodiscard]] bool momentum_initialised() const noexcept { return momentum_initialised_; }
  // False until the first attach() completes, and again while state is being received: a state
  // without contents takes the group's in the next attach().
  [[nodiscard]] bool has_contents() const noexcept { return has_contents_; }
  void set_has_contents(bool has) noexcept { has_contents_ = has; }
  // Set when this rank validated every message of window `*accepted_window()` and voted to
  // commit it, until the window commits here (a failed vote round leaves it set: attach() then
  // learns whether the others committed).
  [[nodiscard]] std::optional<std::uint64_t> accepted_window() const noexcept {
    return accepted_window_;
  }
  void accept_window() noexcept { accepted_window_ = window_; }
  void clear_accepted_window() noexcept { accepted_window_.reset(); }
  // After the state was replaced (received, loaded from a file, or set up afresh).
  void set_progress(std::uint64_t window, bool momentum_initialised) noexcept;
  // The window has committed on this rank: θ_g, m, e and θ_l hold its results.
  void commit_window() noexcept;

  // --- one window, chunk by chunk (docs/algorithm.md) ---------------------------------------
  // Each call touches only its chunk; callers run chunks in parallel.

  // Steps 1-5 without the state change: writes the fired (offset, s) entries into host buffers
  // with room for chunk.length entries.
  [[nodiscard]] kernels::GateResult gate(const ChunkRef& chunk, std::uint32_t* offsets,
                                         float* values) const;
  // Steps 7 (the ranks' entries added in rank order, divided by their count), 5's state change,
  // 8 and 9: commits the window on this chunk.
  void aggregate_and_commit(const ChunkRef& chunk,
                            std::span<const kernels::SparseEntries> ranks_in_order,
                            const kernels::OuterStepParams& params);
  // Dense modes: Δ of step 1 for every element, into a host buffer of chunk.length.
  void pseudo_gradient(const ChunkRef& chunk, float* delta) const;
  // Mode diloco: keeps the ranks' summed Δ of this chunk until the window commits (in e's
  // storage, which diloco does not otherwise use).
  void hold_dense_sum(const ChunkRef& chunk, const float* sum);
  // Mode diloco: g = held sum / divisor, then steps 8 and 9; the held sum is cleared.
  void apply_dense_average(const ChunkRef& chunk, float divisor,
                           const kernels::OuterStepParams& params);

  // --- the whole state ----------------------------------------------------------------------

  // θ_g = float(θ_l) (rank 0's weights after the initial broadcast).
  void global_from_local(ThreadPool& pool);
  // θ_l = cast_local(θ_g) (after the state was received or loaded).
  void reset_local(ThreadPool& pool);
  // Step 5's state change alone: the residual of the window this rank accepted (θ_l must not
  // have been reset since).
  void commit_residual(ThreadPool& pool);
  void zero_residual();
  // Step 10's digest: every tensor's θ_g and m (mode ddp: θ_l).
  [[nodiscard]] Digest digest(ThreadPool& pool) const;

  // --- host access (files, state transfer, tests) --------------------------------------------

  // Elements of one tensor's buffer.
  struct Range {
    std::uint64_t begin = 0;
    std::uint64_t count = 0;
  };
  [[nodiscard]] Range whole(std::size_t tensor) const { return {0, tensors_[tensor].local.numel}; }

  // Calls fn(std::span<const std::byte>) with the bytes of `range` in host memory.
  template <typename Fn>
  void read_host(StateBuffer buffer, std::size_t tensor, Range range, Fn&& fn) const {
    fn(host_bytes(buffer, tensor, range));
  }
  // Calls fn(std::span<std::byte>) with the bytes of `range` in host memory; what fn leaves
  // there is the buffer's new content.
  template <typename Fn>
  void update_host(StateBuffer buffer, std::size_t tensor, Range range, Fn&& fn) {
    fn(host_bytes(buffer, tensor, range));
  }
  // The fp32 buffer itself, for Engine's read accessors (host state only).
  [[nodiscard]] std::span<const float> host_values(StateBuffer buffer, std::size_t tensor) const;

 private:
  struct TensorState {
    TensorView local;
    std::vector<std::uint64_t> shape;
    std::vector<float> global;
    std::vector<float> momentum;
    // pulse: the residual e. diloco: the window's summed pseudo-gradient until it commits.
    std::vector<float> residual;
  };

  [[nodiscard]] std::span<const std::byte> host_bytes(StateBuffer buffer, std::size_t tensor,
                                                      Range range) const;
  [[nodiscard]] std::span<std::byte> host_bytes(StateBuffer buffer, std::size_t tensor,
                                                Range range);
  [[nodiscard]] kernels::GateChunk gate_chunk(const ChunkRef& chunk) const;
  [[nodiscard]] std::byte* local_at(const ChunkRef& chunk) const;

  Layout layout_;
  std::vector<TensorState> tensors_;
  bool keeps_global_state_ = true;
  kernels::Bf16Delta bf16_delta_ = kernels::Bf16Delta::exact;  // step 1 for bf16 local weights
  std::uint64_t window_ = 0;
  bool momentum_initialised_ = false;
  bool has_contents_ = false;
  std::optional<std::uint64_t> accepted_window_;
  // The aggregate g of one chunk, per chunk in flight.
  std::unique_ptr<ScratchPool<std::vector<float>>> aggregate_scratch_ =
      std::make_unique<ScratchPool<std::vector<float>>>();
};

}  // namespace pulseloco::engine_detail
