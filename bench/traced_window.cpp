#include "traced_window.h"

#include <nlohmann/json.hpp>

#include <algorithm>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/state_files.h>
#include <pulseloco/io/safetensors.h>

namespace pulseloco::bench {

kernels::GateChunk TracedWindow::gate_chunk(std::size_t c) const {
  const TracedChunk& chunk = chunks[c];
  const std::size_t element = dtype_size(local_dtypes[chunk.tensor]);
  return {.global = global[chunk.tensor].data() + chunk.begin,
          .local = local[chunk.tensor].data() + chunk.begin * element,
          .local_dtype = local_dtypes[chunk.tensor],
          .residual = residual[chunk.tensor].data() + chunk.begin,
          .count = chunk.length,
          .bf16_delta = options.bf16_delta};
}

std::span<const float> TracedWindow::global_of(std::size_t c) const {
  const TracedChunk& chunk = chunks[c];
  return std::span(global[chunk.tensor]).subspan(chunk.begin, chunk.length);
}

codec::FrameEntries TracedWindow::frame_entries(std::size_t c,
                                                std::span<const std::uint32_t> offsets,
                                                std::span<const float> values) const {
  const TracedChunk& chunk = chunks[c];
  return {.tensor = static_cast<std::uint32_t>(chunk.tensor),
          .begin = chunk.begin,
          .length = chunk.length,
          .offsets = offsets,
          .values = values,
          .context = global_of(c)};
}

TracedWindow load_traced_window(const std::filesystem::path& trace_dir, std::uint64_t window,
                                int rank) {
  const io::SafetensorsReader in(state_files::trace_file(trace_dir, window, rank, true));
  TracedWindow traced;
  traced.options = options_from_json(
      nlohmann::json::parse(state_files::require(in.metadata(), "options", in.path())));
  const std::string local_prefix(state_files::kLocal);
  for (const io::TensorInfo& info : in.tensors()) {
    if (info.spec.name.rfind(local_prefix, 0) != 0) continue;
    const auto dtype = io::to_core_dtype(info.spec.dtype);
    if (!dtype) throw ProtocolError(in.path().string() + ": local tensor of unsupported dtype");
    traced.names.push_back(info.spec.name.substr(local_prefix.size()));
    traced.local_dtypes.push_back(*dtype);
    traced.numels.push_back(info.spec.numel());
  }
  const std::size_t tensors = traced.names.size();
  traced.global.resize(tensors);
  traced.residual.resize(tensors);
  traced.local.resize(tensors);
  const std::uint64_t chunk_elements = traced.options.chunk_elements;
  for (std::size_t t = 0; t < tensors; ++t) {
    const std::uint64_t numel = traced.numels[t];
    traced.global[t].resize(numel);
    traced.residual[t].resize(numel);
    traced.local[t].resize(numel * dtype_size(traced.local_dtypes[t]));
    in.read_as(std::string(state_files::kGlobal) + traced.names[t], std::span(traced.global[t]));
    in.read_as(std::string(state_files::kResidual) + traced.names[t],
               std::span(traced.residual[t]));
    in.read(local_prefix + traced.names[t], traced.local[t]);
    for (std::uint64_t begin = 0; begin < numel; begin += chunk_elements) {
      traced.chunks.push_back({t, begin, std::min(chunk_elements, numel - begin)});
    }
  }
  return traced;
}

}  // namespace pulseloco::bench
