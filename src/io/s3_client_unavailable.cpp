// The bucket client of a build without libcurl and expat (PULSELOCO_WITH_S3=OFF or not found):
// every s3:// address is refused with an error that says so.
#include <pulseloco/io/s3_client.h>
#include <pulseloco/io/sealed_object.h>

#include <pulseloco/base/errors.h>

namespace pulseloco::io {

struct S3Client::Impl {};

S3Client::S3Client(S3Settings) {
  throw InvalidArgument(
      "this build of pulseloco has no S3 support (configured without libcurl and expat: "
      "PULSELOCO_WITH_S3)");
}

S3Client::~S3Client() = default;

const S3Settings& S3Client::settings() const noexcept {
  static const S3Settings none;
  return none;
}

std::string S3Client::where(std::string_view) const {
  return {};
}
void S3Client::set_deadline(std::optional<std::chrono::steady_clock::time_point>) noexcept {}
void S3Client::put_object(std::string_view, std::string_view, std::span<const std::byte>) {}
FileChecksum S3Client::put_file(std::string_view, std::string_view, const std::filesystem::path&) {
  return {};
}
bool S3Client::get_object(std::string_view, std::string_view, ObjectSink&, std::uint64_t) {
  return false;
}
std::optional<std::vector<std::byte>> S3Client::get_bytes(std::string_view, std::string_view,
                                                          std::uint64_t) {
  return std::nullopt;
}
std::vector<std::string> S3Client::list_keys(std::string_view, std::string_view) {
  return {};
}
void S3Client::delete_object(std::string_view, std::string_view) {}

// Sealed objects live only in buckets: without a client there is nothing to seal.
std::vector<std::byte> seal_object(std::string_view, std::string_view, std::span<const std::byte>) {
  throw InvalidArgument("this build of pulseloco has no S3 support (PULSELOCO_WITH_S3)");
}
std::optional<std::span<const std::byte>> open_sealed_object(std::string_view, std::string_view,
                                                             std::span<const std::byte>) {
  return std::nullopt;
}

}  // namespace pulseloco::io
