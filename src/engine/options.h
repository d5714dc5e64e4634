// Everything that configures a synchronisation run, validated before use and checked to be
// identical on every rank at start-up (the canonical JSON form is hashed and all-gathered).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <pulseloco/codec/message.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco {

struct WindowReport;  // engine/report.h

enum class Mode : std::uint8_t {
  pulse,   // PULSELoCo: sparse bf16-visible pseudo-gradient, error feedback, outer Nesterov step
  diloco,  // DiLoCo: dense all-reduce of the fp32 pseudo-gradient, same outer step
  ddp,     // data parallel: gradients all-reduced after every backward pass, no outer step
};

[[nodiscard]] std::string_view mode_name(Mode mode) noexcept;
[[nodiscard]] Mode parse_mode(std::string_view name);  // throws InvalidArgument

// Where a rank keeps θ_g, m and e (docs/operations.md, "Where the state lives").
enum class StateLocation : std::uint8_t {
  automatic,  // on the parameters' device when they are CUDA tensors, in host memory otherwise
  device,     // on the parameters' CUDA device (12 bytes per parameter there)
  host,       // in host memory (CUDA parameters must then be staged by the caller, as the
              // libtorch adapter does)
};

// When the exchange of a window runs (docs/algorithm.md, "Overlapped windows"). Mode pulse only.
enum class Overlap : std::uint8_t {
  blocking,  // the window's exchange and outer step run at its boundary; training waits
  delayed,   // the exchange runs in the background during the next window's inner steps; its
             // outer step is applied at the next boundary (one window stale)
  eager,     // as delayed, and each worker restarts its inner steps from θ_g moved by its own
             // pseudo-gradient of the window in flight (a local stand-in for the average)
};

[[nodiscard]] std::string_view overlap_name(Overlap overlap) noexcept;
[[nodiscard]] Overlap parse_overlap(std::string_view name);  // throws InvalidArgument

// How a PULSELoCo window combines the ranks' messages (docs/algorithm.md, "Exchange kinds").
// Every kind gives the same bits.
enum class Exchange : std::uint8_t {
  automatic,  // chosen per window from how much the ranks' sets overlapped in the previous
              // window (the same choice on every rank)
  allgather,  // every rank receives every rank's whole message
  reduction,  // owner reduction: each rank sums one range of the model, in rank order, from the
              // ranks' entries there; then every rank receives every range's sums
};

[[nodiscard]] std::string_view exchange_name(Exchange exchange) noexcept;
// "auto" (or "automatic"), "allgather", "reduction"; throws InvalidArgument.
[[nodiscard]] Exchange parse_exchange(std::string_view name);

[[nodiscard]] std::string_view state_location_name(StateLocation location) noexcept;
// "automatic" (or "auto"), "device", "host"; throws InvalidArgument.
[[nodiscard]] StateLocation parse_state_location(std::string_view name);

// "auto" (or "automatic"), "ring", "direct"; throws InvalidArgument.
[[nodiscard]] collectives::CollectiveAlgorithm parse_allgather(std::string_view name);
// A name codec::encoding_name gives; throws InvalidArgument.
[[nodiscard]] codec::Encoding parse_encoding(std::string_view name);

// True when this program can keep the state on a CUDA device: it links pulseloco_engine_cuda
// (package component `cuda`). Says nothing about whether a device is present.
[[nodiscard]] bool device_state_available() noexcept;

struct EngineOptions {
  Mode mode = Mode::pulse;
  std::uint32_t steps_per_window = 8;  // H: inner optimizer steps between windows (>= 1)
  float outer_lr = 0.7f;               // η of the outer Nesterov step
  float outer_momentum = 0.9f;         // μ
  // Elements per chunk: the unit of gating, encoding (one frame), aggregation and parallelism.
  // It bounds the engine's temporary memory (a few chunk-sized buffers per thread).
  std::uint64_t chunk_elements = std::uint64_t{1} << 20;
  // Elements per dense all-reduce bucket (diloco and ddp modes).
  std::uint64_t bucket_elements = std::uint64_t{1} << 24;
  std::uint32_t threads = 0;  // worker threads for gate/encode/decode/apply; 0 = all cores
  codec::EncodeOptions codec{};
  std::chrono::milliseconds timeout{60'000};  // every collective's deadline
  collectives::CollectiveAlgorithm allgather = collectives::CollectiveAlgorithm::automatic;
  // Pipelining granularity of the collectives (collectives::CollectiveOptions): a ring's
  // pipeline fills in world_size - 2 chunk times, which is long on a slow link. The engine is
  // for slow links, so its default is a quarter of the collectives' own, which brings pulse's
  // exchange closer to its bandwidth bound over slow links and costs nothing on fast ones
  // (docs/benchmarks.md, "End-to-end sync").
  std::uint64_t pipeline_chunk_bytes = std::uint64_t{256} << 10;
  // Step 1's Δ for bf16 local weights (kernels::Bf16Delta, docs/algorithm.md): `exact`, or
  // `authors` to reproduce the PULSE authors' code. No effect with fp32 local weights.
  kernels::Bf16Delta bf16_delta = kernels::Bf16Delta::exact;
  // Blocking windows, or windows whose exchange overlaps the next window's inner steps (mode
  // pulse, state in host memory). Shared by every rank and part of the state a checkpoint
  // records.
  Overlap overlap = Overlap::blocking;
  // How pulse windows combine the messages. Changes no bit of the state, so a run may resume
  // with another value; every rank must use the same.
  Exchange exchange = Exchange::automatic;
  // Pulse windows of a group that spans several nodes with several ranks on some node: each
  // message (and each reduced range) crosses into each other node once, not once per rank
  // there (collectives::sparse_allgather_nodes). A rank's node is GroupInfo::node. Changes no
  // bit of the state (a run may resume with another value); every rank must use the same.
  bool node_aware = true;
  bool verify_digests = true;  // step 10: exchange and compare θ_g/m digests every window
  std::string trace_dir;       // when set, write per-rank window traces (inputs and outputs)
  // Where this rank keeps its state. Local to the rank (a GPU rank and a CPU rank share a group
  // with identical bits) and not part of files or the shared options digest.
  StateLocation state_location = StateLocation::automatic;
  // Publishing θ_g as bf16 versions for inference servers (docs/patches.md): when publish_dir
  // is set, rank 0 publishes after every `publish_every`-th window, as version = the window
  // counter, with an anchor every `anchor_every` versions. Local to the rank like trace_dir
  // (only rank 0 writes; they change no bit of the state), so not part of the shared options
  // digest, and a run may resume from a checkpoint with other values.
  std::string publish_dir;
  std::uint64_t publish_every = 1;
  std::uint64_t anchor_every = 10;
  // Called with every report the engine returns (after_optimizer_step, run_window,
  // complete_in_flight), on the calling thread, before the call returns it: a metrics sink
  // (to_json(report) is the report as JSON). Local to the rank and not serialised; an exception
  // it throws propagates to the caller.
  std::function<void(const WindowReport&)> on_report;
  // A publish_dir that already holds versions when this run starts (not resumed from a
  // checkpoint) is refused unless this is set: then this run publishes after them. Local to the
  // rank like publish_dir, and not recorded in files.
  bool publish_continue = false;

  // Throws InvalidArgument naming the first option that is out of range.
  void validate() const;
};

// Canonical JSON (stable key order, exact float bits) used for hashing and checkpoints.
[[nodiscard]] nlohmann::json to_json(const EngineOptions& options);
[[nodiscard]] EngineOptions options_from_json(
    const nlohmann::json& json);  // throws InvalidArgument

// The options that must agree on every rank, as canonical JSON, and its digest: all but the
// thread count, the trace directory, the timeout and the weight publishing (publish_dir,
// publish_every, anchor_every), which each rank may set for itself.
[[nodiscard]] nlohmann::json shared_options(const EngineOptions& options);
[[nodiscard]] std::uint64_t shared_options_digest(const EngineOptions& options);

// The options a resumed run must share with its checkpoint: those the state's evolution
// depends on. How the bytes move (all-gather algorithm, pipeline chunk, message encoding and
// its zstd level) and whether digests are compared do not change a single bit of the state,
// so a job may resume with other values of them. Returns the names (canonical JSON keys) of
// the options that differ, empty when the checkpoint may be resumed with `now`.
[[nodiscard]] std::vector<std::string> options_that_change_the_state(const EngineOptions& saved,
                                                                     const EngineOptions& now);

}  // namespace pulseloco
