// Offline replay of a traced window: re-runs it from the recorded inputs with an in-process group
// of the traced world size and compares every output tensor bit for bit. For debugging
// divergence: `pulseloco replay TRACE_DIR`.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace pulseloco {

struct ReplayDifference {
  int rank = 0;
  std::string tensor;             // e.g. "global.layers.0.weight"
  std::uint64_t first_index = 0;  // first differing element
  std::uint64_t differing = 0;    // number of differing elements
};

struct ReplayResult {
  std::uint64_t window = 0;
  int world_size = 0;
  std::uint64_t tensors_compared = 0;
  // Ranks whose outputs are not in the trace: in an elastic run, a worker lost after the window
  // committed elsewhere (its inputs took part; there is nothing of its own to compare).
  std::vector<int> ranks_without_outputs;
  std::vector<ReplayDifference> differences;  // empty: the replay is bit-identical

  [[nodiscard]] bool identical() const noexcept { return differences.empty(); }
};

// The windows recorded under `trace_dir`, ascending.
[[nodiscard]] std::vector<std::uint64_t> traced_windows(const std::filesystem::path& trace_dir);

// Replays `window`: the attempt that committed (the generation named by its .out files), from
// the .in files of every rank of that group. Throws InvalidArgument / ProtocolError when the
// trace is incomplete or malformed (no outputs at all, an input of the committed group missing).
[[nodiscard]] ReplayResult replay_window(const std::filesystem::path& trace_dir,
                                         std::uint64_t window);

}  // namespace pulseloco
