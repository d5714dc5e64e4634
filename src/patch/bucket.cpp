#include <pulseloco/patch/bucket.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <system_error>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>

namespace pulseloco::patch {
namespace {

// Hashes an object as it arrives and writes it to a local file, when one is given.
class CheckedSink final : public io::ObjectSink {
 public:
  CheckedSink(const std::optional<std::filesystem::path>& local, std::string url,
              const ManifestFile& listed)
      : local_(local), url_(std::move(url)), listed_(listed) {
    reset();
  }
  void reset() override {
    digest_.reset();
    size_ = 0;
    if (!local_) return;
    file_.close();
    file_.open(*local_, std::ios::binary | std::ios::trunc);
    if (!file_) throw IoError(fmt::format("cannot create '{}'", local_->string()));
  }
  void write(std::span<const std::byte> bytes) override {
    digest_.update(bytes);
    size_ += bytes.size();
    if (size_ > listed_.bytes) {
      throw ProtocolError(fmt::format(
          "'{}' is corrupted: more than the {} bytes the manifest records", url_, listed_.bytes));
    }
    if (!local_) return;
    file_.write(reinterpret_cast<const char*>(bytes.data()),
                static_cast<std::streamsize>(bytes.size()));
    if (!file_) throw IoError(fmt::format("cannot write '{}'", local_->string()));
  }
  [[nodiscard]] io::FileChecksum finish() {
    if (local_) {
      file_.close();
      if (file_.fail()) throw IoError(fmt::format("cannot write '{}'", local_->string()));
    }
    return {.size = size_, .digest = digest_.finish()};
  }

 private:
  std::optional<std::filesystem::path> local_;
  std::string url_;
  const ManifestFile& listed_;
  std::ofstream file_;
  DigestStream digest_;
  std::uint64_t size_ = 0;
};

}  // namespace

TemporaryDirectory::TemporaryDirectory(std::string_view purpose) {
  std::string pattern =
      (std::filesystem::temp_directory_path() / fmt::format("pulseloco-{}-XXXXXX", purpose))
          .string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw IoError(
        fmt::format("cannot create a temporary directory '{}': {}", pattern, std::strerror(errno)));
  }
  path_ = pattern;
}

TemporaryDirectory::~TemporaryDirectory() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::optional<Manifest> read_bucket_manifest(io::S3Client& client, const io::S3Address& address) {
  const std::string key = address.key(kManifestName);
  const std::optional<std::vector<std::byte>> bytes =
      client.get_bytes(address.bucket, key, kMaxManifestBytes);
  if (!bytes) return std::nullopt;
  return parse_manifest(*bytes, address.url(kManifestName));
}

std::optional<Manifest> find_manifest(const std::string& location) {
  if (io::is_s3_address(location)) {
    io::S3Client client(io::S3Settings::from_environment());
    return read_bucket_manifest(client, io::parse_s3_address(location));
  }
  if (!std::filesystem::exists(std::filesystem::path(location) / kManifestName))
    return std::nullopt;
  return read_manifest(location);
}

void fetch_listed_object(io::S3Client& client, const io::S3Address& address,
                         const ManifestFile& file,
                         const std::optional<std::filesystem::path>& local) {
  CheckedSink sink(local, address.url(file.path), file);
  // The sink refuses a byte beyond the listed size (a ProtocolError): nothing more is received.
  if (!client.get_object(address.bucket, address.key(file.path), sink,
                         std::numeric_limits<std::uint64_t>::max()))
    throw IoError(fmt::format("'{}' is missing", address.url(file.path)));
  check_file_checksum(address.url(file.path), file, sink.finish());
}

UpdateReport update_from_bucket(Receiver& receiver, io::S3Client& client,
                                const io::S3Address& address, std::optional<std::uint64_t> target) {
  const std::optional<std::vector<std::byte>> bytes =
      client.get_bytes(address.bucket, address.key(kManifestName), kMaxManifestBytes);
  if (!bytes) {
    throw IoError(fmt::format("'{}' is missing: nothing is published under '{}' ({})",
                              address.url(kManifestName), address.url(),
                              client.where(address.bucket)));
  }
  const Manifest manifest = parse_manifest(*bytes, address.url(kManifestName));
  TemporaryDirectory local("bucket");
  {
    std::ofstream file(local.path() / kManifestName, std::ios::binary);
    file.write(reinterpret_cast<const char*>(bytes->data()),
               static_cast<std::streamsize>(bytes->size()));
    if (!file.flush())
      throw IoError(fmt::format("cannot write '{}'", (local.path() / kManifestName).string()));
  }
  // The files of the path Receiver::update will take; when there is none (nothing to do, or a
  // target or held state it refuses), it says so itself.
  std::vector<UpdateStep> steps;
  if (!manifest.versions.empty()) {
    try {
      const std::uint64_t to = target.value_or(manifest.versions.back().version);
      if (receiver.version() != to) steps = plan_update(manifest, receiver.version(), to);
    } catch (const InvalidArgument&) {
      steps.clear();
    }
  }
  for (const UpdateStep& step : steps) {
    const ManifestFile& file = step_file(*manifest.find(step.version), step.kind);
    const std::filesystem::path path = local.path() / file.path;
    std::filesystem::create_directories(path.parent_path());
    try {
      fetch_listed_object(client, address, file, path);
    } catch (const Error& error) {
      rethrow_for_version(error, step.version);
    }
  }
  return receiver.update(local.path(), target);
}

}  // namespace pulseloco::patch
