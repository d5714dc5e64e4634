// Internal: the engine's state and the declarations shared by engine.cpp (windows),
// checkpoint.cpp (checkpoints) and trace.cpp (window traces). Not installed for users.
#pragma once

#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <pulseloco/base/thread_pool.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/fault_injection.h>
#include <pulseloco/engine/layout.h>
#include <pulseloco/engine/scratch_pool.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco {
namespace engine_detail {

// Gate output of one chunk.
struct GateScratch {
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
};

// Decoded entries of every rank for one chunk, plus the chunk's aggregate.
struct ApplyScratch {
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
  std::vector<float> aggregate;
  codec::DecodeScratch decode;
};

// Validation decodes into throw-away buffers.
struct ValidateScratch {
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
  codec::DecodeScratch decode;
};

// Dense all-reduce staging for one bucket.
struct BucketScratch {
  std::vector<float> input;
  std::vector<float> output;
};

}  // namespace engine_detail

struct Engine::Impl {
  struct TensorState {
    TensorView local;                  // θ_l: the user's tensor
    std::vector<std::uint64_t> shape;  // for files; {numel} when the caller gave none
    std::vector<float> global;         // θ_g
    std::vector<float> momentum;       // m
    // pulse: the residual e. diloco: the window's averaged pseudo-gradient (no residual there).
    std::vector<float> residual;
  };

  EngineOptions options;
  std::unique_ptr<transport::Transport> transport;
  int rank = 0;
  int world = 1;
  Layout layout;
  std::vector<TensorState> tensors;
  ThreadPool pool;
  ScratchPool<engine_detail::GateScratch> gate_scratch;
  ScratchPool<engine_detail::ApplyScratch> apply_scratch;
  ScratchPool<engine_detail::ValidateScratch> validate_scratch;
  ScratchPool<engine_detail::BucketScratch> bucket_scratch;

  std::uint64_t window = 0;           // windows committed
  bool momentum_initialised = false;  // false until the first outer step (m = g)
  // False until the first attach() completes, and again while state is being received: an
  // engine without state takes the group's state in the next attach().
  bool has_state = false;
  // Set when this rank validated every message of window `*accepted_window` and voted to
  // commit it, until the window commits here (a failed vote round leaves it set: attach() then
  // learns whether the others committed).
  std::optional<std::uint64_t> accepted_window;
  // An invalid parameter table found by the constructor, reported in the first attach's
  // agreement round so that every rank fails at once.
  std::exception_ptr setup_error;
  GroupInfo group;
  std::optional<WindowReport> committed_report;  // see Engine::take_committed_report()
  std::optional<FaultPlan> fault;                // PULSELOCO_FAULT (engine/fault_injection.h)
  std::uint64_t steps_in_window = 0;             // optimizer steps since the last window
  // ddp: what the gradient all-reduces of the current window moved.
  std::uint64_t ddp_payload_bytes = 0;
  double ddp_exchange_seconds = 0;
  transport::TransportStats stats_at_window_start{};

  Impl(EngineOptions opts, std::unique_ptr<transport::Transport> t)
      : options(std::move(opts)), transport(std::move(t)), pool(options.threads) {}

  collectives::CollectiveOptions next_collective() const;

  // --- start-up ---------------------------------------------------------------------------

  void check_agreement(std::uint64_t mine, const char* what, const std::exception_ptr& local_error);

  void broadcast_initial_weights();

  // Validates the parameters and allocates the state (records the error in setup_error).
  void prepare(std::vector<NamedTensor> parameters);
  void attach(std::unique_ptr<transport::Transport> replacement, GroupInfo info);
  // attach() with state somewhere in the group: brings every member to the state of the most
  // advanced ones (engine.h).
  void synchronise_members();
  // Sends θ_g and m from `source` to every rank (collective), bucket by bucket.
  void broadcast_state(int source);
  [[nodiscard]] transport::Transport& require_transport() const;
  // Runs the fault PULSELOCO_FAULT asks for at this point of the window, if any.
  void inject_fault(FaultPhase phase);

  // --- pulse window -----------------------------------------------------------------------

  kernels::GateChunk gate_input(const ChunkRef& chunk) const;

  [[noreturn]] void throw_non_finite(const ChunkRef& chunk, std::uint64_t offset) const;

  // Steps 1-5 (without the state change) and encoding: this rank's message.
  std::vector<std::byte> gate_and_encode(std::uint64_t& entries);

  // Parses rank `sender`'s message and checks everything about it, frame by frame, so that the
  // apply phase cannot fail. Throws ProtocolError naming the sender.
  codec::MessageView validate_message(int sender, std::span<const std::byte> bytes);

  // Every rank says whether it accepted every message; commit only when all did. A rank that
  // rejected (or could not exchange) makes every rank keep its state.
  void agree_to_commit(bool accepted, const std::exception_ptr& local_error);

  // Steps 6-9 on every chunk, from validated messages.
  void apply_pulse(const std::vector<codec::MessageView>& views);

  void run_pulse(WindowReport& report);

  // --- diloco window ----------------------------------------------------------------------

  void run_diloco(WindowReport& report);

  // --- ddp --------------------------------------------------------------------------------

  void average_gradients(std::span<const TensorView> gradients);

  // --- verification -----------------------------------------------------------------------

  static Digest digest_floats(const std::vector<float>& values) { return digest_of<float>(values); }

  Digest compute_state_digest();

  void verify(WindowReport& report);

  // --- one window -------------------------------------------------------------------------

  WindowReport run_window();

  // --- files (checkpoint.cpp, trace.cpp) --------------------------------------------------

  void save_checkpoint(const std::filesystem::path& dir);
  void load_checkpoint(const std::filesystem::path& dir);
  void save_global_weights(const std::filesystem::path& file);
  // Writes this rank's trace of the window about to run (inputs) or just committed (outputs).
  void write_trace_inputs() const;
  void write_trace_outputs(const WindowReport& report) const;
  // Replaces the state (θ_g, m, e, θ_l, window counter) with a traced window's inputs.
  void load_trace_inputs(const std::filesystem::path& file);
};

}  // namespace pulseloco
