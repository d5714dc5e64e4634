// The manifest of a publishing directory: which versions exist, which files hold them, their
// sizes and checksums, and the digest of each version's state. The publisher writes it
// atomically after the files it lists, so a reader sees a version only once it is complete.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/io/atomic_file.h>

namespace pulseloco::patch {

inline constexpr std::string_view kManifestName = "manifest.json";

struct ManifestFile {
  std::string path;  // relative to the directory
  std::uint64_t bytes = 0;
  Digest checksum = 0;  // xxh3-64 of the file's bytes

  friend bool operator==(const ManifestFile&, const ManifestFile&) = default;
};

struct ManifestVersion {
  std::uint64_t version = 0;
  Digest digest = 0;                    // of the bf16 state at this version
  std::uint64_t changed = 0;            // elements changed since the previous version
  std::optional<ManifestFile> delta;    // from the previous version (absent for the first)
  std::optional<ManifestFile> compact;  // the same delta as a compact patch, when written
  std::optional<ManifestFile> anchor;

  friend bool operator==(const ManifestVersion&, const ManifestVersion&) = default;
};

struct Manifest {
  std::uint64_t total_elements = 0;
  std::vector<ManifestVersion> versions;  // ascending; each delta's parent is the one before

  // nullptr when the manifest does not list `version`.
  [[nodiscard]] const ManifestVersion* find(std::uint64_t version) const noexcept;
};

// The largest manifest a reader accepts.
inline constexpr std::uint64_t kMaxManifestBytes = std::uint64_t{256} << 20;

// The manifest's JSON text, which carries its own xxh3-64.
[[nodiscard]] std::string manifest_text(const Manifest& manifest);
// Writes `directory`/manifest.json atomically.
void write_manifest(const std::filesystem::path& directory, const Manifest& manifest);
// Reads and checks it (syntax, fields, its checksum, ascending versions, files inside the
// directory). IoError when it cannot be read, ProtocolError naming it when it is not valid.
[[nodiscard]] Manifest read_manifest(const std::filesystem::path& directory);
// The same checks of a manifest's bytes read from `source` (named in errors).
[[nodiscard]] Manifest parse_manifest(std::span<const std::byte> bytes, std::string_view source);

// ProtocolError naming `name` when `found` is not the size and checksum the manifest records.
void check_file_checksum(std::string_view name, const ManifestFile& file,
                         const io::FileChecksum& found);

// Checks that a listed file is there with the size and checksum the manifest records: IoError
// naming it when it is missing or unreadable, ProtocolError when it differs.
void check_listed_file(const std::filesystem::path& directory, const ManifestFile& file);

}  // namespace pulseloco::patch
