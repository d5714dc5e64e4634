#include <pulseloco/engine/trace.h>

#include <fmt/format.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <utility>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/in_flight_file.h>
#include <pulseloco/engine/state_files.h>

namespace pulseloco::engine_detail {
namespace {

// Every traced buffer with its prefix in the file, in the order they are written: θ_g, m, e,
// θ_l, and the eager start point S where the state keeps one.
std::vector<std::pair<std::string_view, StateBuffer>> traced_buffers(const ReplicatedState& state) {
  std::vector<std::pair<std::string_view, StateBuffer>> buffers{
      {state_files::kGlobal, StateBuffer::global},
      {state_files::kMomentum, StateBuffer::momentum},
      {state_files::kResidual, StateBuffer::residual},
      {state_files::kLocal, StateBuffer::local},
  };
  if (state.keeps_start()) buffers.emplace_back(state_files::kStart, StateBuffer::start);
  return buffers;
}

io::TensorDType file_dtype(const ReplicatedState& state, StateBuffer buffer, std::size_t tensor) {
  return buffer == StateBuffer::local ? io::to_tensor_dtype(state.local_dtype(tensor))
                                      : io::TensorDType::f32;
}

void write_state_file(const ReplicatedState& state, int rank, const std::filesystem::path& path,
                      const io::Metadata& metadata) {
  std::error_code error;
  std::filesystem::create_directories(path.parent_path(), error);
  if (error) {
    throw IoError(fmt::format("cannot create trace directory {}: {}", path.parent_path().string(),
                              error.message()),
                  {.rank = rank});
  }
  std::vector<io::TensorSpec> specs;
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    for (const auto& [prefix, buffer] : traced_buffers(state)) {
      specs.push_back(
          {std::string(prefix) + state.name(t), file_dtype(state, buffer, t), state.shape(t)});
    }
  }
  io::Metadata with_in_flight = metadata;
  describe_in_flight(state, specs, with_in_flight);
  io::SafetensorsWriter writer(path, with_in_flight, specs);
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    for (const auto& [prefix, buffer] : traced_buffers(state)) {
      const std::string key = std::string(prefix) + state.name(t);
      state.read_host(
          buffer, t, state.whole(t),
          [&](std::uint64_t, std::span<const std::byte> piece) { writer.write(key, piece); });
    }
  }
  write_in_flight(writer, state);
  writer.finish();
}

io::Metadata trace_metadata(const ReplicatedState& state, const EngineOptions& options,
                            const AttachedGroup& group, std::string_view stage) {
  io::Metadata metadata{
      {"format", std::string(state_files::kTraceFormat)},
      {"format_version", std::string(state_files::kFormatVersion)},
      {"stage", std::string(stage)},
      {"window", std::to_string(state.committed_windows())},
      {"rank", std::to_string(group.rank())},
      {"world_size", std::to_string(group.world())},
      {"generation", std::to_string(group.generation())},
      {"momentum_initialised", state.momentum_initialised() ? "true" : "false"},
      {"options", to_json(options).dump()},
      {"table_digest", digest_hex(state.layout().table_digest())},
  };
  // Overlapped windows: the window numbers dropped so far (absent: none).
  if (options.overlap != Overlap::blocking) {
    metadata["windows_dropped"] = std::to_string(state.windows_dropped());
  }
  return metadata;
}

}  // namespace

void write_trace_inputs(const ReplicatedState& state, const EngineOptions& options,
                        const AttachedGroup& group, std::uint64_t window) {
  if (options.mode != Mode::pulse) {
    throw InvalidArgument("window traces are recorded for mode pulse only");
  }
  write_state_file(state, group.rank(),
                   state_files::trace_file(options.trace_dir, window, group.rank(), true),
                   trace_metadata(state, options, group, "inputs"));
}

void write_trace_message(const EngineOptions& options, int rank, std::uint64_t window,
                         std::span<const std::byte> message) {
  const std::filesystem::path path =
      state_files::trace_message_file(options.trace_dir, window, rank);
  std::filesystem::path partial = path;
  partial += ".partial";
  std::error_code error;
  std::filesystem::create_directories(path.parent_path(), error);
  {
    std::ofstream file(partial, std::ios::binary | std::ios::trunc);
    file.write(reinterpret_cast<const char*>(message.data()),
               static_cast<std::streamsize>(message.size()));
    file.close();
    if (error || !file) {
      throw IoError(fmt::format("cannot write the traced message {}", partial.string()),
                    {.rank = rank});
    }
  }
  std::filesystem::rename(partial, path, error);
  if (error) {
    throw IoError(
        fmt::format("cannot rename {} to {}: {}", partial.string(), path.string(), error.message()),
        {.rank = rank});
  }
}

void write_trace_outputs(const ReplicatedState& state, const EngineOptions& options,
                         const AttachedGroup& group, const WindowReport& report) {
  io::Metadata metadata = trace_metadata(state, options, group, "outputs");
  metadata["window"] = std::to_string(report.window);
  metadata[std::string(state_files::kDigestKey)] = std::string(kBufferDigestName);
  metadata["state_digest"] = digest_hex(report.digest);
  metadata["report"] = to_json(report).dump();
  write_state_file(state, group.rank(),
                   state_files::trace_file(options.trace_dir, report.window, group.rank(), false),
                   metadata);
}

void load_trace_inputs(ReplicatedState& state, int rank, int world,
                       const std::filesystem::path& file) {
  const io::SafetensorsReader reader(file);
  const io::Metadata& meta = reader.metadata();
  auto expect = [&](const std::string& key, const std::string& value) {
    if (state_files::require(meta, key, file) != value) {
      throw ProtocolError(
          fmt::format("{}: '{}' is '{}', expected '{}'", file.string(), key, meta.at(key), value));
    }
  };
  expect("format", std::string(state_files::kTraceFormat));
  expect("format_version", std::string(state_files::kFormatVersion));
  expect("stage", "inputs");
  expect("rank", std::to_string(rank));
  expect("world_size", std::to_string(world));
  expect("table_digest", digest_hex(state.layout().table_digest()));
  const std::uint64_t traced_window = state_files::require_u64(meta, "window", file);
  const bool momentum_initialised = state_files::require_bool(meta, "momentum_initialised", file);
  const std::uint64_t dropped = meta.contains("windows_dropped")
                                    ? state_files::require_u64(meta, "windows_dropped", file)
                                    : 0;
  std::optional<OutgoingMessage> in_flight =
      read_in_flight(reader, reader, state, rank, traced_window + dropped);
  // Validate every tensor's declaration before reading any of them.
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    for (const auto& [prefix, buffer] : traced_buffers(state)) {
      const std::string key = std::string(prefix) + state.name(t);
      if (!reader.contains(key) || reader.tensor(key).spec.dtype != file_dtype(state, buffer, t) ||
          reader.tensor(key).spec.shape != state.shape(t)) {
        throw ProtocolError(fmt::format("{}: tensor '{}' is missing or has the wrong dtype/shape",
                                        file.string(), key));
      }
    }
  }
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    for (const auto& [prefix, buffer] : traced_buffers(state)) {
      const std::string key = std::string(prefix) + state.name(t);
      state.update_host(buffer, t, state.whole(t),
                        [&](std::uint64_t offset, std::span<std::byte> piece) {
                          reader.read_range(key, offset, piece);
                        });
    }
  }
  state.set_progress(traced_window, momentum_initialised);
  state.set_windows_dropped(dropped);
  state.clear_in_flight();
  if (in_flight) state.set_in_flight(std::move(*in_flight));
  state.clear_accepted_window();
  state.set_has_contents(true);
}

}  // namespace pulseloco::engine_detail
