#include <pulseloco/patch/manifest.h>

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>

#include <pulseloco/base/errors.h>
#include <pulseloco/io/atomic_file.h>

namespace pulseloco::patch {
namespace {

constexpr std::string_view kManifestFormat = "pulseloco-patches";
constexpr int kManifestFormatVersion = 1;

nlohmann::json file_json(const ManifestFile& file) {
  return {{"path", file.path}, {"bytes", file.bytes}, {"checksum", digest_hex(file.checksum)}};
}

// The checksum covers the manifest's JSON without the "checksum" field, serialised compactly
// (nlohmann orders keys, so the text is canonical).
Digest body_checksum(const nlohmann::json& body) {
  const std::string text = body.dump();
  return digest_bytes(std::as_bytes(std::span(text.data(), text.size())));
}

[[noreturn]] void bad_manifest(std::string_view path, std::string_view reason) {
  throw ProtocolError(fmt::format("'{}' is not a valid manifest: {}", path, reason));
}

Digest parse_hex(std::string_view path, const std::string& text) {
  Digest value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  if (text.size() != 16 || error != std::errc() || end != text.data() + text.size())
    bad_manifest(path, fmt::format("'{}' is not 16 hex digits", text));
  return value;
}

std::optional<ManifestFile> parse_file(std::string_view path, const nlohmann::json& json,
                                       const char* key) {
  if (!json.contains(key) || json.at(key).is_null()) return std::nullopt;
  const nlohmann::json& entry = json.at(key);
  ManifestFile file{.path = entry.at("path").get<std::string>(),
                    .bytes = entry.at("bytes").get<std::uint64_t>(),
                    .checksum = parse_hex(path, entry.at("checksum").get<std::string>())};
  const std::filesystem::path relative(file.path);
  const bool inside = relative.is_relative() &&
                      std::none_of(relative.begin(), relative.end(),
                                   [](const std::filesystem::path& part) { return part == ".."; });
  if (!inside) bad_manifest(path, fmt::format("file '{}' is outside the directory", file.path));
  return file;
}

}  // namespace

const ManifestVersion* Manifest::find(std::uint64_t version) const noexcept {
  const auto it = std::lower_bound(
      versions.begin(), versions.end(), version,
      [](const ManifestVersion& entry, std::uint64_t key) { return entry.version < key; });
  return it != versions.end() && it->version == version ? &*it : nullptr;
}

void check_listed_file(const std::filesystem::path& directory, const ManifestFile& file) {
  const std::filesystem::path path = directory / file.path;
  if (!std::filesystem::is_regular_file(path))
    throw IoError(fmt::format("'{}' is missing", path.string()));
  check_file_checksum(path.string(), file, io::file_checksum(path));
}

void check_file_checksum(std::string_view name, const ManifestFile& file,
                         const io::FileChecksum& found) {
  if (found.size != file.bytes || found.digest != file.checksum) {
    throw ProtocolError(fmt::format(
        "'{}' is corrupted: {} bytes with checksum {}, the manifest records {} bytes with {}", name,
        found.size, digest_hex(found.digest), file.bytes, digest_hex(file.checksum)));
  }
}

std::string manifest_text(const Manifest& manifest) {
  nlohmann::json versions = nlohmann::json::array();
  for (const ManifestVersion& entry : manifest.versions) {
    versions.push_back({{"version", entry.version},
                        {"digest", digest_hex(entry.digest)},
                        {"changed", entry.changed},
                        {"delta", entry.delta ? file_json(*entry.delta) : nlohmann::json()},
                        {"compact", entry.compact ? file_json(*entry.compact) : nlohmann::json()},
                        {"anchor", entry.anchor ? file_json(*entry.anchor) : nlohmann::json()}});
  }
  nlohmann::json json{{"format", kManifestFormat},
                      {"format_version", kManifestFormatVersion},
                      {"total_elements", manifest.total_elements},
                      {"versions", versions}};
  json["checksum"] = digest_hex(body_checksum(json));
  return json.dump(1) + "\n";
}

void write_manifest(const std::filesystem::path& directory, const Manifest& manifest) {
  const std::string text = manifest_text(manifest);
  (void)io::write_file_atomically(directory / kManifestName,
                                  std::as_bytes(std::span(text.data(), text.size())));
}

Manifest read_manifest(const std::filesystem::path& directory) {
  const std::filesystem::path path = directory / kManifestName;
  return parse_manifest(io::read_file(path, kMaxManifestBytes), path.string());
}

Manifest parse_manifest(std::span<const std::byte> bytes, std::string_view path) {
  Manifest manifest;
  try {
    nlohmann::json json =
        nlohmann::json::parse(reinterpret_cast<const char*>(bytes.data()),
                              reinterpret_cast<const char*>(bytes.data()) + bytes.size());
    if (json.at("format").get<std::string>() != kManifestFormat ||
        json.at("format_version").get<int>() != kManifestFormatVersion) {
      bad_manifest(path, "unknown format or format version");
    }
    const Digest checksum = parse_hex(path, json.at("checksum").get<std::string>());
    json.erase("checksum");
    if (body_checksum(json) != checksum) bad_manifest(path, "its checksum does not match");
    manifest.total_elements = json.at("total_elements").get<std::uint64_t>();
    for (const nlohmann::json& entry : json.at("versions")) {
      ManifestVersion version{.version = entry.at("version").get<std::uint64_t>(),
                              .digest = parse_hex(path, entry.at("digest").get<std::string>()),
                              .changed = entry.at("changed").get<std::uint64_t>(),
                              .delta = parse_file(path, entry, "delta"),
                              .compact = parse_file(path, entry, "compact"),
                              .anchor = parse_file(path, entry, "anchor")};
      if (!manifest.versions.empty() && version.version <= manifest.versions.back().version)
        bad_manifest(path, "its versions are not ascending");
      if (manifest.versions.empty() ? !version.anchor : !version.delta)
        bad_manifest(path, fmt::format("version {} cannot be reached", version.version));
      manifest.versions.push_back(std::move(version));
    }
  } catch (const nlohmann::json::exception& error) {
    bad_manifest(path, error.what());
  }
  return manifest;
}

}  // namespace pulseloco::patch
