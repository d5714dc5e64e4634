#include <pulseloco/engine/state_files.h>

#include <fmt/format.h>

#include <charconv>
#include <nlohmann/json.hpp>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::state_files {

std::filesystem::path checkpoint_global_file(const std::filesystem::path& dir) {
  return dir / "global.safetensors";
}

std::filesystem::path checkpoint_rank_file(const std::filesystem::path& dir, int rank) {
  return dir / fmt::format("rank-{:05}.safetensors", rank);
}

std::filesystem::path checkpoint_user_file(const std::filesystem::path& dir, int rank,
                                           std::string_view name) {
  return dir / fmt::format("rank-{:05}.{}", rank, name);
}

std::filesystem::path trace_window_dir(const std::filesystem::path& dir, std::uint64_t window) {
  return dir / fmt::format("window-{:06}", window);
}

std::filesystem::path trace_file(const std::filesystem::path& dir, std::uint64_t window, int rank,
                                 bool inputs) {
  return trace_window_dir(dir, window) /
         fmt::format("rank-{:05}.{}.safetensors", rank, inputs ? "in" : "out");
}

std::filesystem::path trace_message_file(const std::filesystem::path& dir, std::uint64_t window,
                                         int rank) {
  return trace_window_dir(dir, window) / fmt::format("rank-{:05}.message", rank);
}

const std::string& require(const io::Metadata& metadata, const std::string& key,
                           const std::filesystem::path& file) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) {
    throw ProtocolError(fmt::format("{}: metadata has no '{}'", file.string(), key));
  }
  return it->second;
}

DigestDefinition digest_definition(const io::Metadata& metadata,
                                   const std::filesystem::path& file) {
  const auto found = metadata.find(std::string(kDigestKey));
  if (found == metadata.end()) return DigestDefinition::whole_buffer;
  if (found->second == kBufferDigestName) return DigestDefinition::pieces;
  throw ProtocolError(fmt::format("{}: metadata '{}' = '{}' is not a digest this build knows ({})",
                                  file.string(), kDigestKey, found->second, kBufferDigestName));
}

std::uint64_t require_u64(const io::Metadata& metadata, const std::string& key,
                          const std::filesystem::path& file) {
  const std::string& text = require(metadata, key, file);
  std::uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) {
    throw ProtocolError(fmt::format("{}: metadata '{}' = '{}' is not an unsigned integer",
                                    file.string(), key, text));
  }
  return value;
}

bool require_bool(const io::Metadata& metadata, const std::string& key,
                  const std::filesystem::path& file) {
  const std::string& text = require(metadata, key, file);
  if (text != "true" && text != "false") {
    throw ProtocolError(
        fmt::format("{}: metadata '{}' = '{}' is not true/false", file.string(), key, text));
  }
  return text == "true";
}

EngineOptions recorded_options(const io::Metadata& metadata, const std::filesystem::path& file) {
  const std::string& text = require(metadata, "options", file);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw ProtocolError(
        fmt::format("{}: metadata 'options' is not JSON: {}", file.string(), e.what()));
  }
  try {
    return options_from_json(json);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(
        fmt::format("{}: metadata 'options' are not valid options: {}", file.string(), e.message()),
        e.context());
  }
}

}  // namespace pulseloco::state_files
