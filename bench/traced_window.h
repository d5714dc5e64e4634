// One rank's inputs of one traced window (pulseloco_train --trace-dir): the run's options, its
// tensors, θ_g, e and θ_l, and the engine's chunks, so that a benchmark can run the gate exactly
// as the engine did and encode what it fired (bench_payload.cpp, bench_context.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <pulseloco/base/tensor_view.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::bench {

struct TracedChunk {
  std::size_t tensor = 0;
  std::uint64_t begin = 0;
  std::uint64_t length = 0;
};

struct TracedWindow {
  EngineOptions options;
  std::vector<std::string> names;
  std::vector<DType> local_dtypes;
  std::vector<std::uint64_t> numels;
  std::vector<TracedChunk> chunks;  // the engine's chunks, in (tensor, begin) order
  std::vector<std::vector<float>> global;
  std::vector<std::vector<float>> residual;
  std::vector<std::vector<std::byte>> local;

  // The gate's view of chunk c.
  [[nodiscard]] kernels::GateChunk gate_chunk(std::size_t c) const;
  // θ_g of chunk c.
  [[nodiscard]] std::span<const float> global_of(std::size_t c) const;
  // Chunk c's fired entries as a frame's, with θ_g as their context.
  [[nodiscard]] codec::FrameEntries frame_entries(std::size_t c,
                                                  std::span<const std::uint32_t> offsets,
                                                  std::span<const float> values) const;
};

// Reads rank `rank`'s inputs of `window` from `trace_dir`. Throws ProtocolError for a file that
// does not hold them.
[[nodiscard]] TracedWindow load_traced_window(const std::filesystem::path& trace_dir,
                                              std::uint64_t window, int rank);

}  // namespace pulseloco::bench
