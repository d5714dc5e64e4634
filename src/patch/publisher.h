// Publishes a model's weights as bf16 versions into a directory that TRL-style receivers and
// patch::Receiver read (docs/patches.md): a delta per version against the previous one, an
// anchor (every tensor in full) for the first version, every `anchor_every` versions, and
// whenever the deltas since the last anchor would add up to more than an anchor.
//
// Each version's files are written atomically (a temporary name, fsync, rename), then the
// manifest, atomically too, last: a reader never sees a version whose files are incomplete,
// whenever the publisher stops. The destination may be an s3://bucket/prefix address
// (bucket.h): each file is written to a private temporary directory, uploaded (a multipart
// upload for a file above S3Settings::part_bytes, one part in memory at a time) and removed,
// and the manifest is uploaded after the version's files. The publisher keeps one bf16 snapshot (2
// bytes per parameter) of the last published version; the patch kernel (kernels/patch_kernels.h)
// compares the current weights with it chunk by chunk on a thread pool.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/tensor_view.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/io/s3_client.h>
#include <pulseloco/io/s3_settings.h>
#include <pulseloco/patch/bf16_state.h>
#include <pulseloco/patch/manifest.h>
#include <pulseloco/patch/trl_files.h>

namespace pulseloco::patch {

class TemporaryDirectory;  // bucket.h

struct PublisherOptions {
  std::uint64_t anchor_every = 10;  // versions between anchors (>= 1)
  IndexEncoding encoding = IndexEncoding::gap_delta;
  bool compact = true;  // also write each delta as a compact patch (compact_files.h)
  std::uint64_t chunk_elements = std::uint64_t{1} << 20;  // the kernel's unit of work
  std::size_t threads = 1;                                // ThreadPool parallelism
  // A directory that already holds versions: false refuses it; true reloads its newest version
  // through a Receiver (every file and digest checked) and publishes after it.
  bool continue_existing = false;
  // Called with "files written" once a version's files are in place and before the manifest
  // names them, "manifest written" once the manifest names them, "manifest read back" before a
  // publisher reads the location's manifest to learn whether a failed manifest write landed, and
  // for a bucket with "file uploaded" after each of its files (tests stop the process or the
  // server there, or throw); empty in production.
  std::function<void(std::string_view point)> fault_hook;
};

// One tensor of the current weights, in host memory (fp32 or bf16, row-major).
struct WeightsView {
  std::string name;
  std::vector<std::uint64_t> shape;
  const void* data = nullptr;
  DType dtype = DType::float32;
};

struct PublishedVersion {
  std::uint64_t version = 0;
  Digest digest = 0;
  std::uint64_t changed = 0;        // elements whose bf16 value changed
  std::uint64_t delta_bytes = 0;    // 0 when no delta was written (the first version)
  std::uint64_t compact_bytes = 0;  // 0 when no compact patch was written
  std::uint64_t anchor_bytes = 0;   // 0 when no anchor was written
};

class Publisher {
 public:
  // `directory` (a directory, created when missing, or an s3:// address whose bucket exists) One
  // that holds a manifest is refused (InvalidArgument) unless options.continue_existing, which
  // reloads its newest version (the Receiver's errors when a file or digest is wrong) and continues
  // its sequence: the next delta's parent is that version, and anchors fall due as if this
  // publisher had written the versions since the last.
  Publisher(std::filesystem::path directory, PublisherOptions options);
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Publishes `weights` (the same tensors every time, in any order) as `version`, which must be
  // above the previous one. Throws NonFiniteError naming the tensor and index for a NaN,
  // InvalidArgument for tensors other than the first version's or a version not above the
  // last, IoError when a file cannot be written or uploaded (InvalidArgument naming the bucket
  // and the endpoint when the bucket refuses the credentials or is missing). On any error nothing
  // is published and the snapshot is unchanged, with one exception: a manifest write that reports
  // an error may still have landed (an S3 PUT whose answer was lost). The publisher then reads
  // the location's manifest back: when it names this version, the version is published and
  // publish returns; when it does not, the error is thrown as above; when it cannot be read, the
  // error is thrown and the next publish first reloads the newest version from the location (as
  // continue_existing does), so that the sequence continues from what readers see. A version that
  // was published in the end is then refused as not above the last.
  PublishedVersion publish(std::span<const WeightsView> weights, std::uint64_t version);

  [[nodiscard]] const Bf16State& snapshot() const noexcept { return snapshot_; }
  [[nodiscard]] const Manifest& manifest() const noexcept { return manifest_; }
  // The directory or the s3:// address published to.
  [[nodiscard]] std::string location() const;

 private:
  struct Extracted;
  // Takes the newest version at the location (snapshot, manifest, anchor counts) through a
  // Receiver, which checks every file and digest.
  void load_from_location();
  // Whether the location's manifest names `entry` as its newest version; nullopt when it cannot
  // be read.
  [[nodiscard]] std::optional<bool> location_ends_with(const ManifestVersion& entry);
  // Uploads the version's files (bucket only), then removes them from the staging directory.
  void upload_files(const ManifestVersion& entry);
  void publish_manifest(const Manifest& manifest);
  Extracted extract(std::span<const WeightsView> weights);
  [[nodiscard]] bool anchor_due(std::uint64_t delta_bytes) const;
  // Counts a published version (written here, or found in the directory) towards the next
  // anchor.
  void count_towards_anchor(const ManifestVersion& entry);

  std::filesystem::path directory_;  // the files are written here (a bucket's staging directory)
  PublisherOptions options_;
  // A bucket: its address, client and staging directory.
  std::optional<io::S3Address> bucket_;
  std::unique_ptr<io::S3Client> client_;
  std::unique_ptr<TemporaryDirectory> staging_;
  std::unique_ptr<ThreadPool> pool_;
  Bf16State snapshot_;
  Manifest manifest_;
  std::uint64_t versions_since_anchor_ = 0;
  std::uint64_t delta_bytes_since_anchor_ = 0;
  std::uint64_t last_anchor_bytes_ = 0;
  // A manifest write failed and reading the location back failed too: what readers see is
  // unknown until the location is read again.
  bool reload_due_ = false;
};

}  // namespace pulseloco::patch
