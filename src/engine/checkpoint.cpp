#include <pulseloco/engine/checkpoint.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/log_lines.h>
#include <pulseloco/engine/checkpoint_commit.h>
#include <pulseloco/engine/in_flight_file.h>
#include <pulseloco/engine/state_files.h>
#include <pulseloco/io/atomic_file.h>

namespace pulseloco::engine_detail {
namespace {

using state_files::DigestDefinition;
using state_files::require;
using state_files::require_bool;
using state_files::require_u64;

constexpr std::uint64_t kIoChunkBytes = std::uint64_t{16} << 20;

io::TensorSpec spec_of(std::string_view prefix, const std::string& name, io::TensorDType dtype,
                       const std::vector<std::uint64_t>& shape) {
  return io::TensorSpec{std::string(prefix) + name, dtype, shape};
}

// The digest of a tensor's bytes in a file, as the file's definition computes it, read in
// bounded parts (a multiple of the digest's pieces, so that whole pieces are hashed in place).
Digest file_tensor_digest(const io::SafetensorsReader& reader, const std::string& name,
                          DigestDefinition definition, ThreadPool& pool,
                          std::vector<std::byte>& buffer) {
  static_assert(kIoChunkBytes % kBufferDigestPieceBytes == 0);
  const io::TensorInfo& info = reader.tensor(name);
  DigestStream whole;
  BufferDigestStream pieces(&pool);
  for (std::uint64_t at = 0; at < info.byte_size(); at += kIoChunkBytes) {
    const std::uint64_t n = std::min(kIoChunkBytes, info.byte_size() - at);
    buffer.resize(n);
    reader.read_range(name, at, buffer);
    if (definition == DigestDefinition::whole_buffer) {
      whole.update(buffer);
    } else {
      pieces.update(buffer);
    }
  }
  return definition == DigestDefinition::whole_buffer ? whole.finish() : pieces.finish();
}

void check_tensor(const io::SafetensorsReader& reader, const io::TensorSpec& expected) {
  if (!reader.contains(expected.name)) {
    throw ProtocolError(
        fmt::format("{}: tensor '{}' is missing", reader.path().string(), expected.name));
  }
  const io::TensorSpec& found = reader.tensor(expected.name).spec;
  if (found.dtype != expected.dtype || found.shape != expected.shape) {
    throw ProtocolError(fmt::format(
        "{}: tensor '{}' is {} {}, this model needs {} {}", reader.path().string(), expected.name,
        io::tensor_dtype_name(found.dtype), nlohmann::json(found.shape).dump(),
        io::tensor_dtype_name(expected.dtype), nlohmann::json(expected.shape).dump()));
  }
}

void check_equal(const io::Metadata& metadata, const std::string& key, const std::string& expected,
                 const std::filesystem::path& file) {
  const std::string& found = require(metadata, key, file);
  if (found != expected) {
    throw ProtocolError(
        fmt::format("{}: '{}' is '{}', expected '{}'", file.string(), key, found, expected));
  }
}

void create_directories(const std::filesystem::path& dir, std::string_view what, int rank) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    throw IoError(fmt::format("cannot create {}{}: {}", what, dir.string(), error.message()),
                  {.rank = rank});
  }
}

// Writes one tensor's `buffer` as the file's tensor `prefix` + its name.
void write_buffer(io::SafetensorsWriter& writer, const ReplicatedState& state,
                  std::string_view prefix, StateBuffer buffer, std::size_t tensor) {
  const std::string key = std::string(prefix) + state.name(tensor);
  state.read_host(
      buffer, tensor, state.whole(tensor),
      [&](std::uint64_t, std::span<const std::byte> piece) { writer.write(key, piece); });
}

void read_buffer(const io::SafetensorsReader& reader, ReplicatedState& state,
                 std::string_view prefix, StateBuffer buffer, std::size_t tensor) {
  const std::string key = std::string(prefix) + state.name(tensor);
  state.update_host(buffer, tensor, state.whole(tensor),
                    [&](std::uint64_t offset, std::span<std::byte> piece) {
                      reader.read_range(key, offset, piece);
                    });
}

// The checkpoint global file's tensors: θ_g and m (mode ddp: θ_l).
std::vector<io::TensorSpec> global_file_specs(const ReplicatedState& state) {
  std::vector<io::TensorSpec> specs;
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    if (!state.keeps_global_state()) {
      specs.push_back(spec_of(state_files::kLocal, state.name(t),
                              io::to_tensor_dtype(state.local_dtype(t)), state.shape(t)));
    } else {
      for (auto prefix : {state_files::kGlobal, state_files::kMomentum}) {
        specs.push_back(spec_of(prefix, state.name(t), io::TensorDType::f32, state.shape(t)));
      }
    }
  }
  return specs;
}

// The directory of a save that has not committed: removed when it goes out of scope, unless
// released (committed).
class UncommittedDir {
 public:
  explicit UncommittedDir(std::filesystem::path path) : path_(std::move(path)) {}
  ~UncommittedDir() {
    if (!path_.empty()) remove_uncommitted(path_);
  }
  UncommittedDir(const UncommittedDir&) = delete;
  UncommittedDir& operator=(const UncommittedDir&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  void release() noexcept { path_.clear(); }

 private:
  std::filesystem::path path_;
};

void check_save_arguments(const CheckpointSave& save) {
  if (save.keep < 1) throw InvalidArgument("CheckpointSave::keep must be at least 1");
  std::set<std::string_view> names;
  for (const CheckpointFile& file : save.files) {
    const bool plain = std::all_of(file.name.begin(), file.name.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '.' || c == '_' || c == '-';
    });
    if (file.name.empty() || !plain || file.name == "safetensors") {
      throw InvalidArgument(
          fmt::format("checkpoint file name '{}' must be letters, digits, '.', '_' and '-' (not "
                      "'safetensors')",
                      file.name));
    }
    if (!names.insert(file.name).second) {
      throw InvalidArgument(fmt::format("checkpoint file name '{}' is given twice", file.name));
    }
  }
}

CheckpointFileRecord record_of(const io::SafetensorsWriter& writer, int rank) {
  return {writer.path().filename().string(), rank, writer.file_size(), writer.file_digest()};
}

// Rank 0's file: θ_g and m (mode ddp: θ_l), the window counter and the options.
CheckpointFileRecord write_global_file(const ReplicatedState& state, const EngineOptions& options,
                                       const AttachedGroup& group, ThreadPool& pool,
                                       const std::filesystem::path& dir) {
  io::Metadata metadata{
      {"format", std::string(state_files::kCheckpointFormat)},
      {"format_version", std::string(state_files::kFormatVersion)},
      {"window", std::to_string(state.committed_windows())},
      {"world_size", std::to_string(group.world())},
      {"mode", std::string(mode_name(options.mode))},
      {"momentum_initialised", state.momentum_initialised() ? "true" : "false"},
      {"options", to_json(options).dump()},
      {"table_digest", digest_hex(state.layout().table_digest())},
      {std::string(state_files::kDigestKey), std::string(kBufferDigestName)},
      {"state_digest", digest_hex(state.digest(pool))},
      // What tells this directory, while it has no manifest, from one of the flat layout.
      {std::string(kCommittedByKey), std::string(kManifestFile)},
  };
  // Overlapped windows: the window numbers dropped so far (absent: none).
  if (options.overlap != Overlap::blocking) {
    metadata["windows_dropped"] = std::to_string(state.windows_dropped());
  }
  io::SafetensorsWriter writer(state_files::checkpoint_global_file(dir), metadata,
                               global_file_specs(state));
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    if (!state.keeps_global_state()) {
      write_buffer(writer, state, state_files::kLocal, StateBuffer::local, t);
    } else {
      write_buffer(writer, state, state_files::kGlobal, StateBuffer::global, t);
      write_buffer(writer, state, state_files::kMomentum, StateBuffer::momentum, t);
    }
  }
  writer.finish();
  return record_of(writer, group.rank());
}

// The buffers of every rank's file, with their prefixes: its residual e (mode pulse), and the
// eager start point S of overlapped windows.
std::vector<std::pair<std::string_view, StateBuffer>> rank_buffers(const ReplicatedState& state,
                                                                   const EngineOptions& options) {
  std::vector<std::pair<std::string_view, StateBuffer>> buffers;
  if (options.mode == Mode::pulse)
    buffers.emplace_back(state_files::kResidual, StateBuffer::residual);
  if (state.keeps_start()) buffers.emplace_back(state_files::kStart, StateBuffer::start);
  return buffers;
}

// The metadata key of a rank-file buffer's combined digest: "residual_digest", "start_digest".
std::string rank_digest_key(std::string_view prefix) {
  return fmt::format("{}_digest", prefix.substr(0, prefix.size() - 1));
}

// Every rank's file: its residual e (mode pulse; otherwise no tensors), S with overlap eager,
// and the message in flight of overlapped windows.
CheckpointFileRecord write_rank_file(const ReplicatedState& state, const EngineOptions& options,
                                     const AttachedGroup& group, ThreadPool& pool,
                                     const std::filesystem::path& dir) {
  const auto buffers = rank_buffers(state, options);
  std::vector<io::TensorSpec> specs;
  io::Metadata metadata{
      {"format", std::string(state_files::kCheckpointRankFormat)},
      {"format_version", std::string(state_files::kFormatVersion)},
      {"window", std::to_string(state.committed_windows())},
      {"rank", std::to_string(group.rank())},
      {"world_size", std::to_string(group.world())},
      {"table_digest", digest_hex(state.layout().table_digest())},
      {std::string(state_files::kDigestKey), std::string(kBufferDigestName)},
      {"state_digest", digest_hex(state.digest(pool))},
      // Present (the digest of no tensors) in every mode, as files have always had it.
      {"residual_digest", digest_hex(combine_digests({}))},
  };
  for (const auto& [prefix, buffer] : buffers) {
    std::vector<Digest> digests;
    for (std::size_t t = 0; t < state.tensor_count(); ++t) {
      specs.push_back(spec_of(prefix, state.name(t), io::TensorDType::f32, state.shape(t)));
      BufferDigestStream digest(&pool);
      state.read_host(
          buffer, t, state.whole(t),
          [&](std::uint64_t, std::span<const std::byte> piece) { digest.update(piece); });
      digests.push_back(digest.finish());
    }
    metadata[rank_digest_key(prefix)] = digest_hex(combine_digests(digests));
  }
  // Overlapped windows: the message in flight, which the residual already excludes.
  describe_in_flight(state, specs, metadata);
  io::SafetensorsWriter writer(state_files::checkpoint_rank_file(dir, group.rank()), metadata,
                               specs);
  // Fault injection (PULSELOCO_FAULT phase=checkpoint): the temporary file exists, nothing of
  // this rank's files is renamed yet.
  group.reached(WindowPhase::checkpoint, state.committed_windows());
  for (const auto& [prefix, buffer] : buffers) {
    for (std::size_t t = 0; t < state.tensor_count(); ++t)
      write_buffer(writer, state, prefix, buffer, t);
  }
  write_in_flight(writer, state);
  writer.finish();
  return record_of(writer, group.rank());
}

}  // namespace

std::filesystem::path save_checkpoint(const ReplicatedState& state, const EngineOptions& options,
                                      const AttachedGroup& group, ThreadPool& pool,
                                      const std::filesystem::path& root, bool root_is_this_runs,
                                      const CheckpointSave& save) {
  const int rank = group.rank();
  const std::uint64_t window = state.committed_windows();
  const std::string what =
      fmt::format("the checkpoint of window {} under {} was not saved", window, root.string());
  constexpr std::string_view unchanged = "; the committed checkpoints are unchanged";

  // 1. Every rank checks its arguments and says whether its run resumed from or saved into
  //    `root` (a root that is not shared is each rank's own).
  std::exception_ptr error;
  try {
    check_save_arguments(save);
  } catch (...) {
    error = std::current_exception();
  }
  const auto owners = agree(group, error, root_is_this_runs, what, unchanged);
  const bool ours = std::any_of(owners.begin(), owners.end(),
                                [](const nlohmann::json& owner) { return owner.get<bool>(); });

  // 2. Rank 0 creates the new directory, in a root that holds no other run's checkpoints.
  std::optional<UncommittedDir> created;  // rank 0: removed unless it commits
  std::uint64_t sequence = 0;             // rank 0: its manifest's
  try {
    if (rank == 0) {
      if (const auto foreign = ours ? std::nullopt : newest_committed_checkpoint(root)) {
        throw InvalidArgument(fmt::format(
            "{} holds checkpoints (newest: {}) that this run neither resumed from nor saved: "
            "resume from them (load_checkpoint), or save into another directory",
            root.string(), foreign->filename().string()));
      }
      NewCheckpointDir new_dir = create_checkpoint_dir(root, window);
      sequence = new_dir.sequence;
      created.emplace(std::move(new_dir.path));
    }
  } catch (...) {
    error = std::current_exception();
  }
  const auto names =
      agree(group, error, created ? created->path().filename().string() : "", what, unchanged);
  const std::filesystem::path dir = root / names[0].get<std::string>();

  // 3. Every rank writes its files (temporary names, fsync, rename).
  nlohmann::json written = nlohmann::json::array();
  try {
    create_directories(dir, "checkpoint directory ", rank);  // a root that is not shared
    if (rank == 0) written.push_back(to_json(write_global_file(state, options, group, pool, dir)));
    written.push_back(to_json(write_rank_file(state, options, group, pool, dir)));
    for (const CheckpointFile& file : save.files) {
      const auto path = state_files::checkpoint_user_file(dir, rank, file.name);
      const Digest xxh3 = io::write_file_atomically(path, file.bytes);
      written.push_back(to_json(
          {path.filename().string(), rank, static_cast<std::uint64_t>(file.bytes.size()), xxh3}));
    }
  } catch (...) {
    error = std::current_exception();
  }
  const auto reports = agree(group, error, written, what, unchanged);

  // 4. Every rank succeeded: rank 0 commits the directory with its manifest.
  try {
    if (rank == 0) {
      Manifest manifest{sequence, window, group.world(), {}};
      for (int r = 0; r < group.world(); ++r) {
        for (const auto& record : reports[static_cast<std::size_t>(r)])
          manifest.files.push_back(file_record_from_json(record, fmt::format("rank {}", r)));
      }
      write_manifest(dir, manifest);
      created->release();
    }
  } catch (...) {
    error = std::current_exception();
  }
  (void)agree(group, error, nullptr, what, unchanged);
  if (rank == 0) remove_old_checkpoints(root, dir, save.keep);
  logger().log(shared_line_level(rank), "checkpoint of window {} committed in {} (state digest {})",
               window, dir.string(), digest_hex(state.digest(pool)));
  return dir;
}

void save_global_weights(const ReplicatedState& state, const EngineOptions& options, int rank,
                         ThreadPool& pool, const std::filesystem::path& file) {
  if (options.mode == Mode::ddp) {
    throw InvalidArgument("mode ddp keeps no global weights; save the model's own weights");
  }
  if (file.has_parent_path()) create_directories(file.parent_path(), "", rank);
  const io::Metadata metadata{
      {"format", "pulseloco-global-weights"},
      {"format_version", std::string(state_files::kFormatVersion)},
      {"window", std::to_string(state.committed_windows())},
      {std::string(state_files::kDigestKey), std::string(kBufferDigestName)},
      {"state_digest", digest_hex(state.digest(pool))},
  };
  std::vector<io::TensorSpec> specs;
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    specs.push_back(
        spec_of(state_files::kGlobal, state.name(t), io::TensorDType::f32, state.shape(t)));
  }
  io::SafetensorsWriter writer(file, metadata, specs);
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    write_buffer(writer, state, state_files::kGlobal, StateBuffer::global, t);
  }
  writer.finish();
}

LoadedCheckpoint load_checkpoint(ReplicatedState& state, const EngineOptions& options,
                                 const AttachedGroup& group, ThreadPool& pool,
                                 const std::filesystem::path& path,
                                 std::span<const std::string> required_files) {
  const int rank = group.rank();
  const int world = group.world();
  const bool pulse = options.mode == Mode::pulse;
  LoadedCheckpoint loaded;

  // Phase 1: validate everything this rank will read, without touching the state.
  std::exception_ptr local_error;
  std::uint64_t loaded_window = 0;
  Digest loaded_digest = 0;
  bool loaded_momentum_initialised = false;
  std::uint64_t loaded_dropped = 0;
  std::optional<io::SafetensorsReader> global_file;
  std::optional<io::SafetensorsReader> rank_file;
  std::optional<OutgoingMessage> in_flight;
  std::filesystem::path global_path;
  std::filesystem::path rank_path;
  try {
    const ResolvedCheckpoint resolved = resolve_checkpoint_dir(path);
    loaded.dir = resolved.dir;
    global_path = state_files::checkpoint_global_file(loaded.dir);
    rank_path = state_files::checkpoint_rank_file(loaded.dir, rank);
    std::optional<Manifest> manifest;
    if (resolved.flat) {
      if (rank == 0) {
        logger().warn(
            "{} is a checkpoint of the flat layout (no {}): its files are verified by "
            "the digests they record",
            loaded.dir.string(), kManifestFile);
      }
    } else {
      manifest = read_manifest(loaded.dir);
      if (manifest->world_size != world) {
        throw InvalidArgument(fmt::format("{} was written by {} ranks; this group has {}",
                                          loaded.dir.string(), manifest->world_size, world));
      }
      // Every file this rank reads is checked against the manifest first.
      for (const auto& file : {global_path, rank_path})
        verify_file(loaded.dir, manifest->file(loaded.dir, file.filename().string()));
      const std::string own_prefix = state_files::checkpoint_user_file({}, rank, "").string();
      for (const CheckpointFileRecord& record : manifest->files) {
        if (record.rank != rank || !record.name.starts_with(own_prefix) ||
            record.name == rank_path.filename().string()) {
          continue;
        }
        loaded.files.push_back(
            {record.name.substr(own_prefix.size()), read_verified_file(loaded.dir, record)});
      }
    }
    for (const std::string& name : required_files) {
      if (std::none_of(loaded.files.begin(), loaded.files.end(),
                       [&](const CheckpointFile& file) { return file.name == name; })) {
        throw InvalidArgument(
            fmt::format("{} holds no file '{}' of rank {}", loaded.dir.string(), name, rank));
      }
    }

    global_file.emplace(global_path);
    const io::Metadata& meta = global_file->metadata();
    check_equal(meta, "format", std::string(state_files::kCheckpointFormat), global_path);
    check_equal(meta, "format_version", std::string(state_files::kFormatVersion), global_path);
    check_equal(meta, "world_size", std::to_string(world), global_path);
    check_equal(meta, "mode", std::string(mode_name(options.mode)), global_path);
    check_equal(meta, "table_digest", digest_hex(state.layout().table_digest()), global_path);
    const EngineOptions saved = state_files::recorded_options(meta, global_path);
    if (const auto differing = options_that_change_the_state(saved, options); !differing.empty()) {
      const nlohmann::json was = to_json(saved);
      const nlohmann::json is = to_json(options);
      std::vector<std::string> described;
      for (const std::string& key : differing)
        described.push_back(
            fmt::format("{} {} (this run: {})", key, was.at(key).dump(), is.at(key).dump()));
      throw InvalidArgument(fmt::format(
          "{}: the checkpoint was written with other options that the state depends on: {}",
          global_path.string(), fmt::join(described, ", ")));
    }
    loaded_window = require_u64(meta, "window", global_path);
    if (manifest && loaded_window != manifest->window) {
      throw ProtocolError(fmt::format("{}: window {}, the manifest's is {}", global_path.string(),
                                      loaded_window, manifest->window));
    }
    loaded_momentum_initialised = require_bool(meta, "momentum_initialised", global_path);
    if (meta.contains("windows_dropped")) {
      loaded_dropped = require_u64(meta, "windows_dropped", global_path);
    }
    const std::string& state_hex = require(meta, "state_digest", global_path);
    const DigestDefinition global_definition = state_files::digest_definition(meta, global_path);

    std::vector<std::byte> buffer;
    std::vector<Digest> parts;
    for (const io::TensorSpec& spec : global_file_specs(state)) {
      check_tensor(*global_file, spec);
      parts.push_back(file_tensor_digest(*global_file, spec.name, global_definition, pool, buffer));
      if (!state.keeps_global_state()) parts.push_back(0);
    }
    loaded_digest = combine_digests(parts);
    if (digest_hex(loaded_digest) != state_hex) {
      throw ProtocolError(fmt::format("{}: data digest {} does not match the recorded {}",
                                      global_path.string(), digest_hex(loaded_digest), state_hex));
    }

    rank_file.emplace(rank_path);
    const io::Metadata& rank_meta = rank_file->metadata();
    check_equal(rank_meta, "format", std::string(state_files::kCheckpointRankFormat), rank_path);
    check_equal(rank_meta, "format_version", std::string(state_files::kFormatVersion), rank_path);
    check_equal(rank_meta, "rank", std::to_string(rank), rank_path);
    check_equal(rank_meta, "world_size", std::to_string(world), rank_path);
    check_equal(rank_meta, "window", std::to_string(loaded_window), rank_path);
    check_equal(rank_meta, "state_digest", state_hex, rank_path);
    const DigestDefinition rank_definition = state_files::digest_definition(rank_meta, rank_path);
    for (const auto& [prefix, which] : rank_buffers(state, options)) {
      std::vector<Digest> parts_of_buffer;
      for (std::size_t t = 0; t < state.tensor_count(); ++t) {
        const auto spec = spec_of(prefix, state.name(t), io::TensorDType::f32, state.shape(t));
        check_tensor(*rank_file, spec);
        parts_of_buffer.push_back(
            file_tensor_digest(*rank_file, spec.name, rank_definition, pool, buffer));
      }
      check_equal(rank_meta, rank_digest_key(prefix), digest_hex(combine_digests(parts_of_buffer)),
                  rank_path);
    }
    in_flight =
        read_in_flight(*rank_file, *global_file, state, rank, loaded_window + loaded_dropped);
  } catch (...) {
    local_error = std::current_exception();
  }

  // Phase 2: every rank must have validated the same checkpoint.
  const std::string token = fmt::format("{} {} {}", loaded.dir.filename().string(), loaded_window,
                                        digest_hex(loaded_digest));
  const auto tokens =
      agree(group, local_error, token, fmt::format("checkpoint {} was not loaded", path.string()),
            "; nothing changed");
  std::vector<int> disagreeing;
  for (int r = 0; r < world; ++r) {
    if (tokens[static_cast<std::size_t>(r)] != token) disagreeing.push_back(r);
  }
  if (!disagreeing.empty()) {
    throw InvalidArgument(fmt::format("checkpoint {} could not be loaded consistently: these "
                                      "ranks read a different checkpoint or state; nothing "
                                      "changed",
                                      path.string()),
                          {.rank = rank, .ranks = disagreeing});
  }

  // Phase 3: load.
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    if (!state.keeps_global_state()) {
      read_buffer(*global_file, state, state_files::kLocal, StateBuffer::local, t);
      continue;
    }
    read_buffer(*global_file, state, state_files::kGlobal, StateBuffer::global, t);
    read_buffer(*global_file, state, state_files::kMomentum, StateBuffer::momentum, t);
    if (pulse) read_buffer(*rank_file, state, state_files::kResidual, StateBuffer::residual, t);
  }
  if (!pulse) state.zero_residual();
  state.clear_in_flight();
  if (in_flight) state.set_in_flight(std::move(*in_flight));
  state.clear_accepted_window();
  if (state.keeps_global_state()) state.reset_local(pool);
  if (state.keeps_start()) {
    // Overlapped eager windows: θ_l restarts from the start point the rank had.
    for (std::size_t t = 0; t < state.tensor_count(); ++t)
      read_buffer(*rank_file, state, state_files::kStart, StateBuffer::start, t);
    state.local_from_start(pool);
  }
  state.set_progress(loaded_window, loaded_momentum_initialised);
  state.set_windows_dropped(loaded_dropped);
  logger().log(shared_line_level(rank),
               "resumed from {}: {} windows committed, the next is window {} (state digest {})",
               loaded.dir.string(), state.committed_windows(), state.next_window(),
               digest_hex(loaded_digest));
  loaded.window = loaded_window;
  loaded.next_window = state.next_window();
  loaded.next_step = loaded.next_window * options.steps_per_window;
  return loaded;
}

}  // namespace pulseloco::engine_detail
