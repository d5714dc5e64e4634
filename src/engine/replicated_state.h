// Internal: the state the engine replicates, and where it lives. For every parameter tensor: θ_l
// (the user's tensor), θ_g and m (identical on every rank) and this rank's residual e; for the
// whole model: the layout in chunks and buckets, the window counter and where this rank stands
// in the group's commit protocol.
//
// Every computation on the buffers goes through this class: the window's steps chunk by chunk
// (the window strategies call them, in parallel across chunks), the whole-state operations of
// start-up and resume, the digest, and host access for files and state transfer. Where the
// buffers live and which kernels run there is its StateMemory's business (state_memory.h: host
// memory, or a CUDA device); the strategies, files and transfers see only these calls, except
// the dense modes' bucket operations, which the strategies call on memory() (DenseBuckets).
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
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/layout.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/state_memory.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::engine_detail {

// This rank's contribution to a PULSELoCo window.
struct OutgoingMessage {
  std::uint64_t window = 0;      // the window it was gated for
  std::vector<std::byte> bytes;  // the encoded message (docs/wire-format.md)
  std::uint64_t entries = 0;     // elements the gate fired
};

class ReplicatedState {
 public:
  using MemoryFactory = std::function<std::unique_ptr<StateMemory>(StateTensors)>;

  // No tensors: the state of an engine whose parameters were refused.
  ReplicatedState();
  // Validates the parameter table (dtype, device, data, shape, unique names) and lays it out;
  // allocates θ_g, m and e as zeros (mode ddp keeps none: its replicas' state is θ_l itself)
  // where options.state_location says (make_state_memory), or in the memory `memory` makes
  // (tests). Throws InvalidArgument naming the tensor.
  ReplicatedState(std::vector<NamedTensor> parameters, const EngineOptions& options,
                  const MemoryFactory& memory = make_state_memory);

  [[nodiscard]] const Layout& layout() const noexcept { return layout_; }
  [[nodiscard]] std::size_t tensor_count() const noexcept { return tensors_.size(); }
  [[nodiscard]] const std::string& name(std::size_t tensor) const {
    return layout_.tensors()[tensor].name;
  }
  // The shape recorded in files ({numel} when the caller gave none).
  [[nodiscard]] const std::vector<std::uint64_t>& shape(std::size_t tensor) const {
    return tensors_[tensor].shape;
  }
  [[nodiscard]] DType local_dtype(std::size_t tensor) const { return tensors_[tensor].local_dtype; }
  // False in mode ddp: no θ_g, m or e.
  [[nodiscard]] bool keeps_global_state() const noexcept { return keeps_global_state_; }
  // Where θ_g, m and e live: "host" or "cuda:<ordinal>".
  [[nodiscard]] std::string location() const { return memory_->location(); }
  // The memory itself, for the calls that bracket the engine's work (begin_access, ...).
  [[nodiscard]] StateMemory& memory() const noexcept { return *memory_; }

  // --- where this rank stands --------------------------------------------------------------

  // Windows committed (outer steps applied). Not a window number once a window was dropped:
  // messages, reports and logs number windows as next_window() does.
  [[nodiscard]] std::uint64_t committed_windows() const noexcept { return committed_windows_; }
  // Overlapped windows: windows dropped so far (a rejected vote, a regroup). Window numbers are
  // never reused, so the next window's number is committed_windows() + windows_dropped(), plus
  // one while a window is in flight (whose number is committed_windows() + windows_dropped()).
  [[nodiscard]] std::uint64_t windows_dropped() const noexcept { return windows_dropped_; }
  void set_windows_dropped(std::uint64_t dropped) noexcept { windows_dropped_ = dropped; }
  [[nodiscard]] std::uint64_t next_window() const noexcept {
    return committed_windows_ + windows_dropped_ + (in_flight_ ? 1 : 0);
  }
  // False until the first outer step (which sets m = g).
  [[nodiscard]] bool momentum_initialised() const noexcept { return momentum_initialised_; }
  // False until the first attach() completes, and again while state is being received: a state
  // without contents takes the group's in the next attach().
  [[nodiscard]] bool has_contents() const noexcept { return has_contents_; }
  void set_has_contents(bool has) noexcept { has_contents_ = has; }
  // Set when this rank validated every message of a window and voted to commit it, to the
  // windows committed before it, until the window commits here (a failed vote round leaves it
  // set: attach() then learns whether the others committed).
  [[nodiscard]] std::optional<std::uint64_t> accepted_after() const noexcept {
    return accepted_after_;
  }
  void accept_window() noexcept { accepted_after_ = committed_windows_; }
  void clear_accepted_window() noexcept { accepted_after_.reset(); }
  // Overlapped windows: this rank's message of the window in flight (sent, its outer step not
  // applied yet; its residual already committed), docs/algorithm.md "Overlapped windows".
  [[nodiscard]] const std::optional<OutgoingMessage>& in_flight() const noexcept {
    return in_flight_;
  }
  void set_in_flight(OutgoingMessage message) { in_flight_ = std::move(message); }
  void clear_in_flight() noexcept { in_flight_.reset(); }
  // After the state was replaced (received, loaded from a file, or set up afresh).
  void set_progress(std::uint64_t committed_windows, bool momentum_initialised) noexcept;
  // The window has committed on this rank: θ_g, m, e and θ_l hold its results.
  void commit_window() noexcept;

  // --- one window, chunk by chunk (docs/algorithm.md) ---------------------------------------
  // Each call touches only its chunk; callers run chunks in parallel.

  // The phases around the per-chunk calls (StateMemory): begin_gate() before a window's gate()
  // calls, end_apply() after its aggregate_and_commit / aggregate_and_step / start_from_own
  // calls.
  void begin_gate() { memory_->begin_gate(); }
  void end_apply() { memory_->end_apply(); }
  // Steps 1-5 without the state change: writes the fired (offset, s) entries into host buffers
  // with room for chunk.length entries.
  [[nodiscard]] kernels::GateResult gate(const ChunkRef& chunk, std::uint32_t* offsets,
                                         float* values) const {
    return memory_->gate(chunk, offsets, values);
  }
  // Steps 7 (the ranks' entries added in rank order, divided by their count), 5's state change,
  // 8 and 9: commits the window on this chunk.
  void aggregate_and_commit(const ChunkRef& chunk,
                            std::span<const kernels::SparseEntries> ranks_in_order,
                            const kernels::OuterStepParams& params) {
    memory_->aggregate_and_commit(chunk, ranks_in_order, params);
  }
  // Mode diloco: g = held sum / divisor, then steps 8 and 9; the held sum is cleared.
  void apply_dense_average(const ChunkRef& chunk, float divisor,
                           const kernels::OuterStepParams& params) {
    memory_->apply_dense_average(chunk, divisor, params);
  }

  // Overlapped windows (StateMemory): steps 7 and 8 without the residual commit; the eager
  // start point; a dropped window's entries back into e.
  void aggregate_and_step(const ChunkRef& chunk,
                          std::span<const kernels::SparseEntries> ranks_in_order,
                          const kernels::OuterStepParams& params) {
    memory_->aggregate_and_step(chunk, ranks_in_order, params);
  }
  void start_from_own(const ChunkRef& chunk, const kernels::SparseEntries& own,
                      const kernels::OuterStepParams& params) {
    memory_->start_from_own(chunk, own, params);
  }
  void local_from_start(ThreadPool& pool) { memory_->local_from_start(pool); }
  // True when the eager start point S is part of the state (overlap = eager).
  [[nodiscard]] bool keeps_start() const noexcept { return keeps_start_; }
  void restore_residual(const ChunkRef& chunk, const kernels::SparseEntries& own) {
    memory_->restore_residual(chunk, own);
  }

  // --- the whole state ----------------------------------------------------------------------

  // θ_g = float(θ_l) (rank 0's weights after the initial broadcast).
  void global_from_local(ThreadPool& pool) { memory_->global_from_local(pool); }
  // θ_l = cast_local(θ_g) (after the state was received or loaded).
  void reset_local(ThreadPool& pool) { memory_->reset_local(pool); }
  // Step 5's state change alone: the residual of the window this rank accepted (θ_l must not
  // have been reset since).
  void commit_residual(ThreadPool& pool) { memory_->commit_residual(pool); }
  void zero_residual() { memory_->zero_residual(); }
  // Step 10's digest: every tensor's θ_g and m (mode ddp: θ_l).
  [[nodiscard]] Digest digest(ThreadPool& pool) const { return memory_->digest(pool); }

  // --- host access (files, state transfer, tests) --------------------------------------------

  [[nodiscard]] Range whole(std::size_t tensor) const { return {0, numels_[tensor]}; }

  // Calls `read` with consecutive host pieces of `range` (of any size; see StateMemory).
  void read_host(StateBuffer buffer, std::size_t tensor, Range range, const ReadPiece& read) const {
    memory_->read_host(buffer, tensor, range, read);
  }
  // Calls `write` with consecutive host pieces of `range`; what it leaves there is the buffer's
  // new content.
  void update_host(StateBuffer buffer, std::size_t tensor, Range range, const WritePiece& write) {
    memory_->update_host(buffer, tensor, range, write);
  }
  // The fp32 buffer itself, for Engine's read accessors (host state only).
  [[nodiscard]] std::span<const float> host_values(StateBuffer buffer, std::size_t tensor) const {
    return memory_->host_values(buffer, tensor);
  }
  // A copy of one tensor's fp32 buffer (θ_g, m or e), wherever it lives (tests and tools).
  [[nodiscard]] std::vector<float> copy_values(StateBuffer buffer, std::size_t tensor) const;

 private:
  struct TensorFacts {
    DType local_dtype = DType::float32;
    std::vector<std::uint64_t> shape;
  };

  Layout layout_;
  std::vector<TensorFacts> tensors_;
  std::vector<std::uint64_t> numels_;
  bool keeps_global_state_ = true;
  std::uint64_t committed_windows_ = 0;
  std::uint64_t windows_dropped_ = 0;
  bool keeps_start_ = false;
  bool momentum_initialised_ = false;
  bool has_contents_ = false;
  std::optional<std::uint64_t> accepted_after_;
  std::optional<OutgoingMessage> in_flight_;
  std::unique_ptr<StateMemory> memory_;
};

// Brackets the engine's work on the state (a window, an attach, a file): a device memory orders
// it after the caller's stream and the caller's later work after it (StateMemory).
class StateAccess {
 public:
  explicit StateAccess(const ReplicatedState& state) : memory_(&state.memory()) {
    memory_->begin_access();
  }
  ~StateAccess() { memory_->end_access(); }
  StateAccess(const StateAccess&) = delete;
  StateAccess& operator=(const StateAccess&) = delete;

 private:
  StateMemory* memory_;
};

}  // namespace pulseloco::engine_detail
