#include <pulseloco/engine/replay.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <regex>
#include <thread>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/state_files.h>
#include <pulseloco/io/safetensors.h>
#include <pulseloco/transport/inproc/inproc.h>

namespace pulseloco {
namespace {

struct TracedTensor {
  std::string name;
  DType dtype = DType::float32;
  std::vector<std::uint64_t> shape;
  std::uint64_t numel = 0;
};

// The model's tensors in order, from the "local.<name>" entries (files list tensors in the order
// they were written, which is the model's order).
std::vector<TracedTensor> traced_tensors(const io::SafetensorsReader& reader) {
  std::vector<TracedTensor> result;
  const std::string prefix(state_files::kLocal);
  for (const io::TensorInfo& info : reader.tensors()) {
    if (info.spec.name.rfind(prefix, 0) != 0) continue;
    const auto dtype = io::to_core_dtype(info.spec.dtype);
    if (!dtype) {
      throw ProtocolError(fmt::format("{}: '{}' has dtype {}, expected F32 or BF16",
                                      reader.path().string(), info.spec.name,
                                      io::tensor_dtype_name(info.spec.dtype)));
    }
    result.push_back(
        {info.spec.name.substr(prefix.size()), *dtype, info.spec.shape, info.spec.numel()});
  }
  return result;
}

void compare(const io::SafetensorsReader& expected, const std::string& key,
             std::span<const std::byte> actual, int rank, ReplayResult& result) {
  std::vector<std::byte> bytes(expected.tensor(key).byte_size());
  if (bytes.size() != actual.size()) {
    result.differences.push_back({rank, key, 0, actual.size()});
    return;
  }
  expected.read(key, bytes);
  const std::size_t element = io::tensor_dtype_size(expected.tensor(key).spec.dtype);
  ReplayDifference difference{rank, key, 0, 0};
  for (std::size_t i = 0; i < bytes.size(); i += element) {
    if (std::memcmp(bytes.data() + i, actual.data() + i, element) != 0) {
      if (difference.differing++ == 0) difference.first_index = i / element;
    }
  }
  if (difference.differing > 0) result.differences.push_back(difference);
  ++result.tensors_compared;
}

// Runs step(rank) for every rank of `world` on a thread each; then rethrows the error of the
// lowest rank that failed.
void on_every_rank(int world, const std::function<void(int)>& step) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        step(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads)
    thread.join();
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

}  // namespace

std::vector<std::uint64_t> traced_windows(const std::filesystem::path& trace_dir) {
  if (!std::filesystem::is_directory(trace_dir)) {
    throw InvalidArgument(fmt::format("{} is not a directory", trace_dir.string()));
  }
  const std::regex pattern(R"(window-(\d{6}))");
  std::vector<std::uint64_t> windows;
  for (const auto& entry : std::filesystem::directory_iterator(trace_dir)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && std::regex_match(name, match, pattern)) {
      windows.push_back(std::stoull(match[1].str()));
    }
  }
  std::sort(windows.begin(), windows.end());
  return windows;
}

ReplayResult replay_window(const std::filesystem::path& trace_dir, std::uint64_t window) {
  const auto window_dir = state_files::trace_window_dir(trace_dir, window);
  if (!std::filesystem::is_directory(window_dir)) {
    throw InvalidArgument(fmt::format("no trace of window {} in {}", window, trace_dir.string()));
  }
  // The committed attempt of the window is the one that wrote outputs: in an elastic run a window
  // may have been attempted by an earlier group that failed (docs/elastic.md), whose input files
  // stay behind. Outputs name their group's generation; inputs of other generations are ignored.
  const std::regex out_pattern(R"(rank-(\d{5})\.out\.safetensors)");
  std::vector<int> output_ranks;
  for (const auto& entry : std::filesystem::directory_iterator(window_dir)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, match, out_pattern)) output_ranks.push_back(std::stoi(match[1]));
  }
  std::sort(output_ranks.begin(), output_ranks.end());
  if (output_ranks.empty()) {
    throw InvalidArgument(
        fmt::format("{}: no rank-*.out.safetensors (the window did not commit on any traced rank)",
                    window_dir.string()));
  }
  const auto first = io::SafetensorsReader(
      state_files::trace_file(trace_dir, window, output_ranks.front(), false));
  const io::Metadata& meta = first.metadata();
  const std::uint64_t world_size = state_files::require_u64(meta, "world_size", first.path());
  if (world_size <= static_cast<std::uint64_t>(output_ranks.back())) {
    throw InvalidArgument(fmt::format("{}: world_size {}, but rank {} recorded outputs",
                                      first.path().string(), world_size, output_ranks.back()));
  }
  const auto generation_of = [](const io::Metadata& m) {
    const auto it = m.find("generation");
    return it == m.end() ? std::string("0") : it->second;
  };
  const std::string generation = generation_of(meta);
  // Every rank of the world needs its input file (below), so a world_size beyond the files in
  // the directory fails there; ranks are ints.
  if (world_size > static_cast<std::uint64_t>(std::numeric_limits<int>::max())) {
    throw InvalidArgument(fmt::format("{}: world_size {} is not a number of ranks",
                                      first.path().string(), world_size));
  }
  const auto world = static_cast<int>(world_size);
  for (int r : output_ranks) {
    const io::SafetensorsReader out(state_files::trace_file(trace_dir, window, r, false));
    if (state_files::require_u64(out.metadata(), "world_size", out.path()) !=
            static_cast<std::uint64_t>(world) ||
        generation_of(out.metadata()) != generation) {
      throw InvalidArgument(fmt::format(
          "{}: outputs of different groups (world size or generation differ from rank {}'s)",
          out.path().string(), output_ranks.front()));
    }
  }
  for (int r = 0; r < world; ++r) {
    const auto path = state_files::trace_file(trace_dir, window, r, true);
    if (!std::filesystem::exists(path)) {
      throw InvalidArgument(fmt::format("trace file {} is missing", path.string()));
    }
    const io::SafetensorsReader in(path);
    if (generation_of(in.metadata()) != generation) {
      throw InvalidArgument(
          fmt::format("{} is from group generation {}, the committed attempt was generation {}",
                      path.string(), generation_of(in.metadata()), generation));
    }
  }
  // The recorded options, but a replay writes nothing: no trace of itself, no weights published
  // into the run's publishing directory.
  EngineOptions options = state_files::recorded_options(meta, first.path());
  options.trace_dir.clear();
  options.publish_dir.clear();
  options.threads =
      std::max(1u, std::thread::hardware_concurrency() / static_cast<unsigned>(world));
  const std::vector<TracedTensor> tensors = traced_tensors(first);

  // Each rank's θ_l lives in buffers owned here; the engines see views of them. Every rank
  // loads its inputs before any runs the window, so that a bad input file is the error, not the
  // other ranks' wait for the rank that could not start.
  std::vector<std::vector<std::vector<std::byte>>> locals(static_cast<std::size_t>(world));
  auto transports = transport::inproc::make_group(world);
  std::vector<std::unique_ptr<Engine>> engines(static_cast<std::size_t>(world));
  on_every_rank(world, [&](int r) {
    const auto index = static_cast<std::size_t>(r);
    std::vector<NamedTensor> parameters;
    for (const TracedTensor& t : tensors) {
      auto& buffer = locals[index].emplace_back(t.numel * dtype_size(t.dtype));
      parameters.push_back(
          {t.name, TensorView{buffer.data(), t.numel, t.dtype, Device{}}, t.shape});
    }
    try {
      engines[index] =
          std::make_unique<Engine>(std::move(parameters), options, std::move(transports[index]));
    } catch (const InvalidArgument& e) {
      throw InvalidArgument(
          fmt::format("{}: the options and tensors it recorded make no engine: {}",
                      first.path().string(), e.message()),
          e.context());
    }
    engines[index]->load_trace_inputs(state_files::trace_file(trace_dir, window, r, true));
  });
  on_every_rank(world, [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); });

  ReplayResult result;
  result.window = window;
  result.world_size = world;
  for (int r = 0; r < world; ++r) {
    if (!std::binary_search(output_ranks.begin(), output_ranks.end(), r)) {
      result.ranks_without_outputs.push_back(r);
    }
  }
  for (int r : output_ranks) {
    const auto index = static_cast<std::size_t>(r);
    const io::SafetensorsReader expected(state_files::trace_file(trace_dir, window, r, false));
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const std::string& name = tensors[t].name;
      compare(expected, std::string(state_files::kGlobal) + name,
              std::as_bytes(engines[index]->global_weights(t)), r, result);
      compare(expected, std::string(state_files::kMomentum) + name,
              std::as_bytes(engines[index]->momentum(t)), r, result);
      compare(expected, std::string(state_files::kResidual) + name,
              std::as_bytes(engines[index]->residual(t)), r, result);
      compare(expected, std::string(state_files::kLocal) + name, locals[index][t], r, result);
    }
  }
  return result;
}

}  // namespace pulseloco
