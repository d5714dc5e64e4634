#include <pulseloco/engine/checkpoint_commit.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <optional>
#include <tuple>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/state_files.h>
#include <pulseloco/io/atomic_file.h>
#include <pulseloco/io/safetensors.h>

namespace pulseloco::engine_detail {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr std::string_view kManifestFormat = "pulseloco-checkpoint-manifest";
constexpr std::string_view kManifestVersion = "2";
// Version 1 manifests carry no sequence (read as 0: older than every version 2 checkpoint) and no
// checksum of their own.
constexpr std::string_view kFirstManifestVersion = "1";
constexpr std::string_view kChecksumName = "xxh3-64";
constexpr std::string_view kSelfChecksumKey = "manifest_xxh3-64";
// A manifest lists a few files per rank; a larger file is not one.
constexpr std::uint64_t kMaxManifestBytes = std::uint64_t{64} << 20;

// The place of a checkpoint directory among its root's: window-NNNNNN[.K].
struct DirName {
  std::uint64_t window = 0;
  std::uint64_t suffix = 0;
  auto operator<=>(const DirName&) const = default;
};

std::optional<std::uint64_t> parse_digits(std::string_view text) {
  std::uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || error != std::errc{} || end != text.data() + text.size()) {
    return std::nullopt;
  }
  return value;
}

std::optional<DirName> parse_dir_name(std::string_view name) {
  constexpr std::string_view prefix = "window-";
  if (!name.starts_with(prefix)) return std::nullopt;
  name.remove_prefix(prefix.size());
  const std::size_t dot = name.find('.');
  const auto window = parse_digits(name.substr(0, dot));
  if (!window) return std::nullopt;
  if (dot == std::string_view::npos) return DirName{*window, 0};
  const auto suffix = parse_digits(name.substr(dot + 1));
  if (!suffix || *suffix == 0) return std::nullopt;
  return DirName{*window, *suffix};
}

std::string dir_name(const DirName& name) {
  return name.suffix == 0 ? fmt::format("window-{:06}", name.window)
                          : fmt::format("window-{:06}.{}", name.window, name.suffix);
}

struct FoundDir {
  DirName name;
  fs::path path;
  bool committed = false;
  std::uint64_t sequence = 0;           // committed: its manifest's
  std::optional<ErrorKind> unreadable;  // committed, but its manifest cannot be read:
  std::string why;                      // the error's kind and text
  auto order() const { return std::tie(sequence, name); }
};

// The checkpoint directories under `root`, oldest first (by commit sequence, then name); other
// entries are not ours.
std::vector<FoundDir> checkpoint_dirs(const fs::path& root) {
  std::vector<FoundDir> found;
  std::error_code error;
  for (fs::directory_iterator it(root, error), end; !error && it != end; it.increment(error)) {
    const auto name = parse_dir_name(it->path().filename().string());
    std::error_code type_error;
    if (!name || !it->is_directory(type_error)) continue;
    FoundDir dir{*name, it->path(), has_manifest(it->path())};
    try {
      if (dir.committed) dir.sequence = read_manifest(dir.path).sequence;
    } catch (const Error& e) {
      dir.unreadable = e.kind();
      dir.why = e.what();
    }
    found.push_back(std::move(dir));
  }
  if (error) {
    throw IoError(
        fmt::format("cannot list checkpoint root '{}': {}", root.string(), error.message()));
  }
  std::sort(found.begin(), found.end(),
            [](const FoundDir& a, const FoundDir& b) { return a.order() < b.order(); });
  return found;
}

// The manifest's own checksum: xxh3-64 of its JSON without that key, dumped compactly.
Digest manifest_checksum(const Json& json) {
  const std::string text = json.dump(-1, ' ', false, Json::error_handler_t::replace);
  return digest_bytes(std::as_bytes(std::span(text.data(), text.size())));
}

// A file name the manifest may list: one plain entry of the checkpoint directory.
bool plain_file_name(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

[[noreturn]] void throw_of_kind(ErrorKind kind, const std::string& message, ErrorContext context) {
  switch (kind) {
    case ErrorKind::invalid_argument:
      throw InvalidArgument(message, std::move(context));
    case ErrorKind::protocol:
      throw ProtocolError(message, std::move(context));
    default:
      throw IoError(message, std::move(context));
  }
}

Json failure_record(const std::exception_ptr& error) {
  ErrorKind kind = ErrorKind::io;
  std::string text = "unknown error";
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    kind = e.kind();
    text = e.what();
  } catch (const std::exception& e) {
    text = e.what();
  } catch (...) {
  }
  return {{"ok", false}, {"kind", static_cast<int>(kind)}, {"error", text}};
}

}  // namespace

const CheckpointFileRecord& Manifest::file(const fs::path& dir, std::string_view name) const {
  const auto found = std::find_if(files.begin(), files.end(),
                                  [&](const CheckpointFileRecord& f) { return f.name == name; });
  if (found == files.end()) {
    throw ProtocolError(fmt::format("{}: lists no file '{}' (written by {} ranks)",
                                    (dir / kManifestFile).string(), name, world_size));
  }
  return *found;
}

Json to_json(const CheckpointFileRecord& record) {
  return {{"name", record.name},
          {"rank", record.rank},
          {"size", record.size},
          {std::string(kChecksumName), digest_hex(record.xxh3)}};
}

CheckpointFileRecord file_record_from_json(const Json& json, std::string_view source) {
  try {
    CheckpointFileRecord record;
    record.name = json.at("name").get<std::string>();
    record.rank = json.at("rank").get<int>();
    record.size = json.at("size").get<std::uint64_t>();
    const std::string hex = json.at(std::string(kChecksumName)).get<std::string>();
    std::uint64_t value = 0;
    const auto [end, error] = std::from_chars(hex.data(), hex.data() + hex.size(), value, 16);
    if (hex.size() != 16 || error != std::errc{} || end != hex.data() + hex.size()) {
      throw ProtocolError(fmt::format("{}: '{}' is not a 16-digit hex xxh3-64", source, hex));
    }
    record.xxh3 = value;
    if (!plain_file_name(record.name) || record.rank < 0) {
      throw ProtocolError(fmt::format("{}: file '{}' of rank {} is not a plain file name and rank",
                                      source, record.name, record.rank));
    }
    return record;
  } catch (const Json::exception& error) {
    throw ProtocolError(fmt::format("{}: a file record is malformed: {}", source, error.what()));
  }
}

NewCheckpointDir create_checkpoint_dir(const fs::path& root, std::uint64_t window) {
  std::error_code error;
  fs::create_directories(root, error);
  if (error) {
    throw IoError(
        fmt::format("cannot create checkpoint root '{}': {}", root.string(), error.message()));
  }
  std::uint64_t sequence = 1;
  for (const FoundDir& found : checkpoint_dirs(root)) {
    if (found.unreadable) logger().warn("checkpoint ordering ignores {}", found.why);
    sequence = std::max(sequence, found.sequence + 1);
  }
  for (DirName name{window, 0};; ++name.suffix) {
    const fs::path dir = root / dir_name(name);
    if (fs::create_directory(dir, error)) {
      io::fsync_directory(root);
      return {dir, sequence};
    }
    if (error) {
      throw IoError(fmt::format("cannot create checkpoint directory '{}': {}", dir.string(),
                                error.message()));
    }
  }
}

std::optional<fs::path> newest_committed_checkpoint(const fs::path& root) {
  std::error_code error;
  const fs::file_status status = fs::status(root, error);
  if (status.type() == fs::file_type::not_found) return std::nullopt;
  if (error) {
    throw IoError(
        fmt::format("cannot read checkpoint root '{}': {}", root.string(), error.message()));
  }
  if (!fs::is_directory(status)) {
    throw IoError(fmt::format("checkpoint root '{}' is not a directory", root.string()));
  }
  // Unreadable manifests order first (sequence 0): the last committed is the newest readable
  // one, or an unreadable one when no other exists.
  const std::vector<FoundDir> found = checkpoint_dirs(root);
  for (auto it = found.rbegin(); it != found.rend(); ++it) {
    if (it->committed) return it->path;
  }
  return std::nullopt;
}

bool has_manifest(const fs::path& dir) {
  std::error_code error;
  return fs::is_regular_file(dir / kManifestFile, error);
}

namespace {

// The last component of `path`, also when it ends in a separator.
std::string last_name(const fs::path& path) {
  return (path.has_filename() ? path : path.parent_path()).filename().string();
}

// `dir` (no manifest, not a save's directory, no committed checkpoint under it) as a checkpoint
// of the flat layout, which predates manifests: what only that layout has is a global file
// without kCommittedByKey and every rank's file beside it (checkpoint_commit.h).
void check_flat_layout(const fs::path& dir) {
  const fs::path global = state_files::checkpoint_global_file(dir);
  const io::SafetensorsReader reader(global);
  const io::Metadata& metadata = reader.metadata();
  if (const auto format = metadata.find("format");
      format == metadata.end() || format->second != state_files::kCheckpointFormat) {
    throw ProtocolError(fmt::format("{}: not a checkpoint's global file (format '{}', expected {})",
                                    global.string(), format == metadata.end() ? "" : format->second,
                                    state_files::kCheckpointFormat));
  }
  if (metadata.contains(std::string(kCommittedByKey))) {
    throw IoError(fmt::format(
        "'{}' holds no {}, and its global.safetensors was written by a save that commits with "
        "one: that save did not commit (it was interrupted or failed), so it is no checkpoint; "
        "load a committed checkpoint (a directory with {}) or its root",
        dir.string(), kManifestFile, kManifestFile));
  }
  const std::uint64_t world = state_files::require_u64(metadata, "world_size", global);
  for (std::uint64_t r = 0; r < world; ++r) {
    const fs::path rank_file = state_files::checkpoint_rank_file(dir, static_cast<int>(r));
    std::error_code error;
    if (!fs::is_regular_file(rank_file, error)) {
      throw IoError(fmt::format(
          "'{}' is no checkpoint: it holds no {}, and as a checkpoint of the flat layout (from "
          "before manifests) it lacks {}, the file of rank {} of its {} ranks",
          dir.string(), kManifestFile, rank_file.filename().string(), r, world));
    }
  }
}

}  // namespace

ResolvedCheckpoint resolve_checkpoint_dir(const fs::path& path) {
  if (has_manifest(path)) return {path, false};
  std::error_code error;
  if (!fs::is_directory(path, error)) {
    throw IoError(
        fmt::format("checkpoint '{}' does not exist or is not a directory", path.string()));
  }
  const std::vector<FoundDir> found = checkpoint_dirs(path);
  for (const FoundDir& dir : found) {
    if (dir.unreadable) {
      throw_of_kind(*dir.unreadable,
                    fmt::format("cannot tell which checkpoint under '{}' is the newest: {}; load "
                                "a checkpoint directory by its name, or remove that one",
                                path.string(), dir.why),
                    {});
    }
  }
  const auto newest =
      std::find_if(found.rbegin(), found.rend(), [](const FoundDir& dir) { return dir.committed; });
  if (newest != found.rend()) return {newest->path, false};
  if (parse_dir_name(last_name(path))) {
    throw IoError(fmt::format(
        "'{}' holds no {}: its save did not commit (it was interrupted or failed), so it is no "
        "checkpoint and never loads; load its root to resume from the newest committed "
        "checkpoint, or a committed window-NNNNNN directory by its name",
        path.string(), kManifestFile));
  }
  if (fs::exists(state_files::checkpoint_global_file(path), error)) {
    check_flat_layout(path);
    return {path, true};
  }
  throw IoError(fmt::format(
      "'{}' holds no committed checkpoint (a window-NNNNNN directory with {}; {} without one)",
      path.string(), kManifestFile, found.size()));
}

void write_manifest(const fs::path& dir, const Manifest& manifest) {
  Json files = Json::array();
  for (const CheckpointFileRecord& record : manifest.files)
    files.push_back(to_json(record));
  Json json{{"format", kManifestFormat},         {"format_version", kManifestVersion},
            {"sequence", manifest.sequence},     {"window", manifest.window},
            {"world_size", manifest.world_size}, {"checksum", kChecksumName},
            {"files", std::move(files)}};
  json[std::string(kSelfChecksumKey)] = digest_hex(manifest_checksum(json));
  const std::string text = json.dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
  (void)io::write_file_atomically(dir / kManifestFile,
                                  std::as_bytes(std::span(text.data(), text.size())));
}

Manifest read_manifest(const fs::path& dir) {
  const fs::path file = dir / kManifestFile;
  const std::vector<std::byte> bytes = io::read_file(file, kMaxManifestBytes);
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  const std::string source = file.string();
  try {
    Json json = Json::parse(text);
    const bool current = json.at("format_version") == kManifestVersion;
    if (json.at("format") != kManifestFormat ||
        (!current && json.at("format_version") != kFirstManifestVersion) ||
        json.at("checksum") != kChecksumName) {
      throw ProtocolError(fmt::format("{}: not a manifest of format {} version {} with {}", source,
                                      kManifestFormat, kManifestVersion, kChecksumName));
    }
    Manifest manifest;
    if (current) {
      const std::string recorded = json.at(std::string(kSelfChecksumKey)).get<std::string>();
      json.erase(std::string(kSelfChecksumKey));
      if (const std::string found = digest_hex(manifest_checksum(json)); found != recorded) {
        throw ProtocolError(
            fmt::format("{}: the manifest is damaged: its content's xxh3-64 is {}, it records {}",
                        source, found, recorded));
      }
      manifest.sequence = json.at("sequence").get<std::uint64_t>();
    }
    manifest.window = json.at("window").get<std::uint64_t>();
    manifest.world_size = json.at("world_size").get<int>();
    for (const Json& record : json.at("files"))
      manifest.files.push_back(file_record_from_json(record, source));
    return manifest;
  } catch (const Json::exception& error) {
    throw ProtocolError(fmt::format("{}: not a valid manifest: {}", source, error.what()));
  }
}

namespace {

[[noreturn]] void throw_damaged(const fs::path& file, const io::FileChecksum& found,
                                const CheckpointFileRecord& record) {
  if (found.size != record.size) {
    throw ProtocolError(fmt::format("{}: the file is damaged: {} bytes, the manifest records {}",
                                    file.string(), found.size, record.size));
  }
  throw ProtocolError(
      fmt::format("{}: the file is damaged: its xxh3-64 is {}, the manifest records {}",
                  file.string(), digest_hex(found.digest), digest_hex(record.xxh3)));
}

}  // namespace

void verify_file(const fs::path& dir, const CheckpointFileRecord& record) {
  const fs::path file = dir / record.name;
  const io::FileChecksum found = io::file_checksum(file);
  if (found.size != record.size || found.digest != record.xxh3) throw_damaged(file, found, record);
}

std::vector<std::byte> read_verified_file(const fs::path& dir, const CheckpointFileRecord& record) {
  const fs::path file = dir / record.name;
  std::error_code error;
  if (const auto size = fs::file_size(file, error); !error && size != record.size) {
    throw_damaged(file, {size, 0}, record);
  }
  std::vector<std::byte> bytes = io::read_file(file, record.size);
  const io::FileChecksum found{bytes.size(), digest_bytes(bytes)};
  if (found.size != record.size || found.digest != record.xxh3) throw_damaged(file, found, record);
  return bytes;
}

void remove_uncommitted(const fs::path& dir) noexcept {
  std::error_code error;
  fs::remove_all(dir, error);
  if (error) {
    logger().warn("could not remove the uncommitted checkpoint directory {}: {}", dir.string(),
                  error.message());
  }
}

void remove_old_checkpoints(const fs::path& root, const fs::path& committed,
                            std::uint32_t keep) noexcept {
  try {
    const std::vector<FoundDir> found = checkpoint_dirs(root);
    std::uint32_t kept = 1;  // `committed` itself
    for (auto it = found.rbegin(); it != found.rend(); ++it) {
      if (it->path == committed) continue;
      if (it->unreadable) {
        logger().warn("kept checkpoint {}: {}", it->path.string(), it->why);
        continue;
      }
      if (it->committed && kept < keep) {
        ++kept;
        continue;
      }
      // The manifest goes first: a removal cut short leaves no checkpoint with missing files.
      std::error_code error;
      fs::remove(it->path / kManifestFile, error);
      if (!error && it->committed) io::fsync_directory(it->path);
      remove_uncommitted(it->path);
    }
  } catch (const std::exception& error) {
    logger().warn("could not remove old checkpoints under {}: {}", root.string(), error.what());
  }
}

std::vector<Json> agree(const AttachedGroup& group, const std::exception_ptr& error,
                        const Json& payload, std::string_view what, std::string_view consequence) {
  const Json mine = error ? failure_record(error) : Json{{"ok", true}, {"payload", payload}};
  const std::string text = mine.dump(-1, ' ', false, Json::error_handler_t::replace);
  const auto records = collectives::sparse_allgather(
      group.transport(), std::as_bytes(std::span(text.data(), text.size())), group.collective());
  std::vector<Json> payloads;
  std::vector<int> failed;
  std::vector<std::string> failures;
  std::optional<ErrorKind> kind;
  for (int r = 0; r < group.world(); ++r) {
    const auto& bytes = records[static_cast<std::size_t>(r)];
    const Json record =
        Json::parse(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                    nullptr, /*allow_exceptions=*/false);
    if (record.is_object() && record.value("ok", false) && record.contains("payload")) {
      payloads.push_back(record["payload"]);
      continue;
    }
    failed.push_back(r);
    const bool readable = record.is_object() && record.contains("error") &&
                          record["error"].is_string() && record.contains("kind") &&
                          record["kind"].is_number_integer();
    failures.push_back(fmt::format(
        "rank {}: {}", r,
        readable ? record["error"].get<std::string>() : std::string("an unreadable report")));
    if (!kind) {
      kind = readable ? static_cast<ErrorKind>(record["kind"].get<int>()) : ErrorKind::protocol;
    }
  }
  if (!failed.empty()) {
    throw_of_kind(*kind, fmt::format("{}: {}{}", what, fmt::join(failures, "; "), consequence),
                  {.rank = group.rank(), .ranks = failed});
  }
  return payloads;
}

}  // namespace pulseloco::engine_detail
