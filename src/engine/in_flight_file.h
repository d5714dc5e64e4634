// Internal: the message in flight (overlapped windows) inside a state file: a checkpoint's rank
// file and a trace's input and output files carry it as the U8 tensor `in_flight_message` with
// the metadata `in_flight_window` and `in_flight_entries`; a file without them has none.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <pulseloco/engine/replicated_state.h>
#include <pulseloco/io/safetensors.h>

namespace pulseloco::engine_detail {

// Adds the tensor and the metadata of `state`'s message in flight, if any.
void describe_in_flight(const ReplicatedState& state, std::vector<io::TensorSpec>& specs,
                        io::Metadata& metadata);
// Writes the message in flight's bytes (after describe_in_flight; nothing when none).
void write_in_flight(io::SafetensorsWriter& writer, const ReplicatedState& state);
// The message in flight a file holds, checked against this model: window `window` (the
// state's committed_windows() + windows_dropped()), sent by `rank`, frames covering the layout's
// chunks, every frame decodable; context-coded frames decode against the θ_g that
// `global_reader` holds (`global.<tensor>`, F32: the θ_g they were coded against, which the
// state has not loaded yet). Throws ProtocolError naming the file.
[[nodiscard]] std::optional<OutgoingMessage> read_in_flight(
    const io::SafetensorsReader& reader, const io::SafetensorsReader& global_reader,
    const ReplicatedState& state, int rank, std::uint64_t window);

}  // namespace pulseloco::engine_detail
