// A publishing directory in an S3-compatible bucket (docs/patches.md, "Buckets"): the objects
// under `s3://bucket/prefix/` have the directory's names (manifest.json, anchors/, deltas/,
// compact/), so a TRL-style reader fetches them as it would the files. The publisher uploads a
// version's files first and the manifest last, so a reader never sees a version whose files
// are missing; a reader checks every object's size and checksum against the manifest as it
// arrives, before anything is applied.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <pulseloco/io/s3_client.h>
#include <pulseloco/io/s3_settings.h>
#include <pulseloco/patch/manifest.h>
#include <pulseloco/patch/receiver.h>

namespace pulseloco::patch {

// The manifest under `address`; nullopt when it has none. ProtocolError naming its URL when it
// is not valid; the client's errors when the bucket cannot be read.
[[nodiscard]] std::optional<Manifest> read_bucket_manifest(io::S3Client& client,
                                                           const io::S3Address& address);

// The manifest of a directory or an s3:// address (the client from the environment);
// nullopt when it has none.
[[nodiscard]] std::optional<Manifest> find_manifest(const std::string& location);

// Streams a listed object into `local` (nullopt: reads and discards it), checking its size and
// checksum against the manifest: IoError naming its URL when it is missing, ProtocolError when
// it differs from what the manifest records.
void fetch_listed_object(io::S3Client& client, const io::S3Address& address,
                         const ManifestFile& file,
                         const std::optional<std::filesystem::path>& local);

// Receiver::update from a bucket: the manifest and the files of the planned path are fetched
// into a temporary directory (TMPDIR; removed on return), each checked as it arrives, then
// applied by Receiver::update with every check of a directory. Errors name the version.
UpdateReport update_from_bucket(Receiver& receiver, io::S3Client& client,
                                const io::S3Address& address, std::optional<std::uint64_t> target);

// A private temporary directory, removed with everything in it when destroyed.
class TemporaryDirectory {
 public:
  explicit TemporaryDirectory(std::string_view purpose);
  ~TemporaryDirectory();
  TemporaryDirectory(const TemporaryDirectory&) = delete;
  TemporaryDirectory& operator=(const TemporaryDirectory&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace pulseloco::patch
