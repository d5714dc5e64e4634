// Window traces: with EngineOptions::trace_dir set, every rank writes, for every window,
// `window-NNNNNN/rank-NNNNN.in.safetensors` (θ_g, m, e, θ_l before the window) and
// `rank-NNNNN.out.safetensors` (θ_g, m, e, θ_l after it). `pulseloco replay` re-runs a traced
// window offline from the inputs and checks the outputs bit for bit (engine/replay.h).
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/engine_impl.h>
#include <pulseloco/engine/state_files.h>

namespace pulseloco {
namespace {

void write_state_file(const Engine::Impl& impl, const std::filesystem::path& path,
                      io::Metadata metadata) {
  std::error_code error;
  std::filesystem::create_directories(path.parent_path(), error);
  if (error) {
    throw IoError(fmt::format("cannot create trace directory {}: {}", path.parent_path().string(),
                              error.message()),
                  {.rank = impl.rank});
  }
  std::vector<io::TensorSpec> specs;
  for (std::size_t t = 0; t < impl.tensors.size(); ++t) {
    const auto& state = impl.tensors[t];
    const std::string& name = impl.layout.tensors()[t].name;
    for (auto prefix : {state_files::kGlobal, state_files::kMomentum, state_files::kResidual}) {
      specs.push_back({std::string(prefix) + name, io::TensorDType::f32, state.shape});
    }
    specs.push_back({std::string(state_files::kLocal) + name,
                     io::to_tensor_dtype(state.local.dtype), state.shape});
  }
  io::SafetensorsWriter writer(path, metadata, specs);
  for (std::size_t t = 0; t < impl.tensors.size(); ++t) {
    const auto& state = impl.tensors[t];
    const std::string& name = impl.layout.tensors()[t].name;
    writer.write(std::string(state_files::kGlobal) + name, std::span<const float>(state.global));
    writer.write(std::string(state_files::kMomentum) + name,
                 std::span<const float>(state.momentum));
    writer.write(std::string(state_files::kResidual) + name,
                 std::span<const float>(state.residual));
    writer.write(std::string(state_files::kLocal) + name,
                 std::span(static_cast<const std::byte*>(state.local.data), state.local.bytes()));
  }
  writer.finish();
}

io::Metadata trace_metadata(const Engine::Impl& impl, std::string_view stage) {
  return io::Metadata{
      {"format", std::string(state_files::kTraceFormat)},
      {"format_version", std::string(state_files::kFormatVersion)},
      {"stage", std::string(stage)},
      {"window", std::to_string(impl.window)},
      {"rank", std::to_string(impl.rank)},
      {"world_size", std::to_string(impl.world)},
      {"generation", std::to_string(impl.group.generation)},
      {"momentum_initialised", impl.momentum_initialised ? "true" : "false"},
      {"options", to_json(impl.options).dump()},
      {"table_digest", digest_hex(impl.layout.table_digest())},
  };
}

}  // namespace

void Engine::Impl::write_trace_inputs() const {
  if (options.mode != Mode::pulse) {
    throw InvalidArgument("window traces are recorded for mode pulse only");
  }
  write_state_file(*this, state_files::trace_file(options.trace_dir, window, rank, true),
                   trace_metadata(*this, "inputs"));
}

void Engine::Impl::write_trace_outputs(const WindowReport& report) const {
  // Called after the window committed: `window` already counts it.
  io::Metadata metadata = trace_metadata(*this, "outputs");
  metadata["window"] = std::to_string(report.window);
  metadata["state_digest"] = digest_hex(report.digest);
  metadata["report"] = to_json(report).dump();
  write_state_file(*this, state_files::trace_file(options.trace_dir, report.window, rank, false),
                   metadata);
}

void Engine::Impl::load_trace_inputs(const std::filesystem::path& file) {
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
  expect("table_digest", digest_hex(layout.table_digest()));
  const std::uint64_t traced_window = state_files::require_u64(meta, "window", file);
  const std::string& initialised = state_files::require(meta, "momentum_initialised", file);
  // Validate every tensor's declaration before reading any of them.
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const std::string& name = layout.tensors()[t].name;
    for (auto prefix : {state_files::kGlobal, state_files::kMomentum, state_files::kResidual,
                        state_files::kLocal}) {
      const std::string key = std::string(prefix) + name;
      const io::TensorDType dtype = prefix == state_files::kLocal
                                        ? io::to_tensor_dtype(tensors[t].local.dtype)
                                        : io::TensorDType::f32;
      if (!reader.contains(key) || reader.tensor(key).spec.dtype != dtype ||
          reader.tensor(key).spec.shape != tensors[t].shape) {
        throw ProtocolError(fmt::format("{}: tensor '{}' is missing or has the wrong dtype/shape",
                                        file.string(), key));
      }
    }
  }
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const std::string& name = layout.tensors()[t].name;
    TensorState& state = tensors[t];
    reader.read(std::string(state_files::kGlobal) + name,
                std::as_writable_bytes(std::span(state.global)));
    reader.read(std::string(state_files::kMomentum) + name,
                std::as_writable_bytes(std::span(state.momentum)));
    reader.read(std::string(state_files::kResidual) + name,
                std::as_writable_bytes(std::span(state.residual)));
    reader.read(std::string(state_files::kLocal) + name,
                std::span(static_cast<std::byte*>(state.local.data), state.local.bytes()));
  }
  window = traced_window;
  momentum_initialised = initialised == "true";
  steps_in_window = 0;
  accepted_window.reset();
  has_state = true;
}

}  // namespace pulseloco
