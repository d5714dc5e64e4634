// Internal: window traces. With EngineOptions::trace_dir set, every rank writes, for every
// window, `window-NNNNNN/rank-NNNNN.in.safetensors` (θ_g, m, e, θ_l before the window) and
// `rank-NNNNN.out.safetensors` (the same after it), and the encoded message it sent,
// `rank-NNNNN.message`. `pulseloco replay` re-runs a traced window offline from the inputs and
// checks the outputs bit for bit (engine/replay.h); `pulseloco inspect` shows a message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>

#include <pulseloco/engine/attached_group.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/replicated_state.h>
#include <pulseloco/engine/report.h>

namespace pulseloco::engine_detail {

// The inputs of the boundary of window `window` about to run (mode pulse only:
// InvalidArgument otherwise), with the message in flight of overlapped windows.
void write_trace_inputs(const ReplicatedState& state, const EngineOptions& options,
                        const AttachedGroup& group, std::uint64_t window);
// The message this rank sends in window `window`, as it goes on the wire (written to a temporary
// name first, so that a file under the final name is always whole).
void write_trace_message(const EngineOptions& options, int rank, std::uint64_t window,
                         std::span<const std::byte> message);
// The outputs of the window `report` describes, just committed (the state's window counter
// already counts it).
void write_trace_outputs(const ReplicatedState& state, const EngineOptions& options,
                         const AttachedGroup& group, const WindowReport& report);
// Replaces θ_g, m, e, θ_l and the window counter with a traced window's inputs (not
// collective). Validates the file before changing anything.
void load_trace_inputs(ReplicatedState& state, int rank, int world,
                       const std::filesystem::path& file);

}  // namespace pulseloco::engine_detail
