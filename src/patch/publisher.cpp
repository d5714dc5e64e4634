#include <pulseloco/patch/publisher.h>

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/kernels/patch_kernels.h>
#include <pulseloco/kernels/window_kernels.h>
#include <pulseloco/patch/bucket.h>
#include <pulseloco/patch/compact_files.h>
#include <pulseloco/patch/receiver.h>

namespace pulseloco::patch {

// One chunk's entries: indices within the tensor, new and replaced bits.
struct ChunkEntries {
  std::size_t tensor = 0;  // index in the snapshot
  std::uint64_t begin = 0;
  std::uint64_t count = 0;
  std::vector<std::uint32_t> indices;
  std::vector<std::uint16_t> values;
  std::vector<std::uint16_t> previous;
  kernels::PatchResult result;
};

struct Publisher::Extracted {
  std::vector<ChunkEntries> chunks;  // tensor order, then chunk order
};

Publisher::Publisher(std::filesystem::path directory, PublisherOptions options)
    : directory_(std::move(directory)), options_(std::move(options)) {
  if (options_.anchor_every == 0) throw InvalidArgument("anchor_every must be at least 1");
  if (options_.chunk_elements == 0 || options_.chunk_elements > kernels::kMaxChunkElements) {
    throw InvalidArgument(
        fmt::format("chunk_elements must be in [1, {}]", kernels::kMaxChunkElements));
  }
  bool existing = false;
  if (io::is_s3_address(directory_.native())) {
    bucket_ = io::parse_s3_address(directory_.native());
    client_ = std::make_unique<io::S3Client>(io::S3Settings::from_environment());
    staging_ = std::make_unique<TemporaryDirectory>("publish");
    existing = read_bucket_manifest(*client_, *bucket_).has_value();
    directory_ = staging_->path();
  } else {
    existing = std::filesystem::exists(directory_ / kManifestName);
  }
  std::filesystem::create_directories(directory_ / "anchors");
  std::filesystem::create_directories(directory_ / "deltas");
  if (options_.compact) std::filesystem::create_directories(directory_ / "compact");
  pool_ = std::make_unique<ThreadPool>(options_.threads);
  if (!existing) return;
  if (!options_.continue_existing) {
    throw InvalidArgument(
        fmt::format("'{}' already holds published versions (a {})", location(), kManifestName));
  }
  load_from_location();
}

Publisher::~Publisher() = default;

std::string Publisher::location() const {
  return bucket_ ? bucket_->url() : directory_.string();
}

void Publisher::load_from_location() {
  versions_since_anchor_ = 0;
  delta_bytes_since_anchor_ = 0;
  last_anchor_bytes_ = 0;
  Receiver receiver;
  receiver.update(location());
  std::optional<Manifest> manifest =
      bucket_ ? read_bucket_manifest(*client_, *bucket_) : read_manifest(directory_);
  // Another publisher may not write here meanwhile: the reloaded state must be the newest.
  if (!manifest || manifest->versions.empty() ||
      manifest->versions.back().version != receiver.version()) {
    throw ProtocolError(
        fmt::format("'{}' changed while its newest version was reloaded", location()));
  }
  for (const ManifestVersion& entry : manifest->versions)
    count_towards_anchor(entry);
  snapshot_ = receiver.state();
  manifest_ = std::move(*manifest);
}

std::optional<bool> Publisher::location_ends_with(const ManifestVersion& entry) {
  try {
    if (options_.fault_hook) options_.fault_hook("manifest read back");
    std::optional<Manifest> there;
    if (bucket_) {
      there = read_bucket_manifest(*client_, *bucket_);
    } else if (std::filesystem::exists(directory_ / kManifestName)) {
      there = read_manifest(directory_);
    }
    return there && !there->versions.empty() && there->versions.back() == entry;
  } catch (const std::exception&) {  // unreadable, or not a manifest: unknown either way
    return std::nullopt;
  }
}

void Publisher::upload_files(const ManifestVersion& entry) {
  if (!bucket_) return;
  for (const std::optional<ManifestFile>* file : {&entry.delta, &entry.compact, &entry.anchor}) {
    if (!file->has_value()) continue;
    const std::filesystem::path local = directory_ / (*file)->path;
    const io::FileChecksum sent =
        client_->put_file(bucket_->bucket, bucket_->key((*file)->path), local);
    check_file_checksum(local.string(), **file, sent);  // the staged file changed meanwhile
    std::filesystem::remove(local);
    if (options_.fault_hook) options_.fault_hook("file uploaded");
  }
}

void Publisher::publish_manifest(const Manifest& manifest) {
  if (!bucket_) {
    write_manifest(directory_, manifest);
    return;
  }
  const std::string text = manifest_text(manifest);
  client_->put_object(bucket_->bucket, bucket_->key(kManifestName),
                      std::as_bytes(std::span(text.data(), text.size())));
}

Publisher::Extracted Publisher::extract(std::span<const WeightsView> weights) {
  // The weights in the snapshot's (name) order; the first version fixes the tensors.
  std::vector<const WeightsView*> ordered;
  for (const WeightsView& view : weights)
    ordered.push_back(&view);
  std::sort(ordered.begin(), ordered.end(),
            [](const WeightsView* a, const WeightsView* b) { return a->name < b->name; });
  // The first version is published as an anchor alone: its entries (every element that is not
  // +0) are not kept, so that publishing it needs no memory beyond the snapshot.
  const bool first_version = snapshot_.empty();
  if (first_version) {
    std::vector<Bf16Tensor> tensors;
    for (const WeightsView* view : ordered) {
      // +0 everywhere: every element that is not +0 is "changed" on the first extraction.
      tensors.push_back(
          {.name = view->name,
           .shape = view->shape,
           .bits = std::vector<std::uint16_t>(shape_elements(view->name, view->shape))});
    }
    snapshot_ = Bf16State(std::move(tensors));
  }
  if (ordered.size() != snapshot_.tensors().size()) {
    throw InvalidArgument(fmt::format("{} tensors to publish, but the first version had {}",
                                      ordered.size(), snapshot_.tensors().size()));
  }
  Extracted extracted;
  for (std::size_t t = 0; t < ordered.size(); ++t) {
    const WeightsView& view = *ordered[t];
    const Bf16Tensor& tensor = snapshot_.tensors()[t];
    if (view.name != tensor.name || view.shape != tensor.shape) {
      throw InvalidArgument("the tensors to publish are not those of the first version",
                            ErrorContext{.tensor = view.name});
    }
    if (view.dtype != DType::float32 && view.dtype != DType::bfloat16)
      throw InvalidArgument("weights must be fp32 or bf16", ErrorContext{.tensor = view.name});
    for (std::uint64_t begin = 0; begin < tensor.bits.size(); begin += options_.chunk_elements) {
      extracted.chunks.push_back(
          {.tensor = t,
           .begin = begin,
           .count = std::min<std::uint64_t>(options_.chunk_elements, tensor.bits.size() - begin)});
    }
  }
  pool_->parallel_for(extracted.chunks.size(), [&](std::size_t c) {
    ChunkEntries& chunk = extracted.chunks[c];
    const WeightsView& view = *ordered[chunk.tensor];
    std::vector<std::uint32_t> offsets(chunk.count);
    std::vector<std::uint16_t> values(chunk.count);
    std::vector<std::uint16_t> previous(chunk.count);
    chunk.result = kernels::extract_patch(
        {.snapshot = snapshot_.tensors()[chunk.tensor].bits.data() + chunk.begin,
         .current = static_cast<const std::byte*>(view.data) + chunk.begin * dtype_size(view.dtype),
         .current_dtype = view.dtype,
         .count = chunk.count},
        {.offsets = offsets.data(), .values = values.data(), .previous = previous.data()});
    if (first_version) return;
    const std::uint64_t n = chunk.result.changed;
    chunk.indices.resize(n);
    for (std::uint64_t k = 0; k < n; ++k)
      chunk.indices[k] = static_cast<std::uint32_t>(chunk.begin + offsets[k]);
    chunk.values.assign(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(n));
    chunk.previous.assign(previous.begin(), previous.begin() + static_cast<std::ptrdiff_t>(n));
  });
  return extracted;
}

bool Publisher::anchor_due(std::uint64_t delta_bytes) const {
  return versions_since_anchor_ + 1 >= options_.anchor_every ||
         delta_bytes_since_anchor_ + delta_bytes > last_anchor_bytes_;
}

void Publisher::count_towards_anchor(const ManifestVersion& entry) {
  if (entry.anchor) {
    versions_since_anchor_ = 0;
    delta_bytes_since_anchor_ = 0;
    last_anchor_bytes_ = entry.anchor->bytes;
  } else {
    ++versions_since_anchor_;
    delta_bytes_since_anchor_ += entry.delta ? entry.delta->bytes : 0;
  }
}

PublishedVersion Publisher::publish(std::span<const WeightsView> weights, std::uint64_t version) {
  if (reload_due_) {
    load_from_location();
    reload_due_ = false;
  }
  if (!manifest_.versions.empty() && version <= manifest_.versions.back().version) {
    throw InvalidArgument(fmt::format("version {} is not above the last published version {}",
                                      version, manifest_.versions.back().version));
  }
  const bool first = manifest_.versions.empty();
  const Digest parent_digest = first ? 0 : snapshot_.digest();
  const bool had_snapshot = !snapshot_.empty();
  Extracted extracted = extract(weights);
  // Puts the snapshot back as it was: nothing of this version is published.
  const auto undo = [&] {
    if (!had_snapshot) {
      snapshot_ = Bf16State();
      return;
    }
    for (const ChunkEntries& chunk : extracted.chunks) {
      std::vector<std::uint16_t>& bits = snapshot_.tensors()[chunk.tensor].bits;
      for (std::size_t k = 0; k < chunk.indices.size(); ++k)
        bits[chunk.indices[k]] = chunk.previous[k];
    }
  };
  // Undoes the snapshot and empties a bucket's staging directory, which holds one version at a
  // time.
  const auto abandon = [&] {
    undo();
    if (!bucket_) return;
    std::error_code ignored;
    for (const char* folder : {"anchors", "deltas", "compact"}) {
      for (const auto& file : std::filesystem::directory_iterator(directory_ / folder, ignored))
        std::filesystem::remove(file.path(), ignored);
    }
  };
  for (const ChunkEntries& chunk : extracted.chunks) {
    if (chunk.result.nan_offset) {
      const std::string name = snapshot_.tensors()[chunk.tensor].name;
      undo();
      kernels::check_patch_finite(chunk.result, name, chunk.begin);
    }
  }

  PublishedVersion published{.version = version, .digest = snapshot_.digest()};
  ManifestVersion entry{.version = version, .digest = published.digest};
  try {
    if (!first) {
      Delta delta{.version = version,
                  .parent_version = manifest_.versions.back().version,
                  .parent_digest = parent_digest,
                  .digest = published.digest,
                  .total_elements = snapshot_.total_elements(),
                  .encoding = options_.encoding};
      for (const ChunkEntries& chunk : extracted.chunks) {
        published.changed += chunk.indices.size();
        if (chunk.indices.empty()) continue;
        const std::string& name = snapshot_.tensors()[chunk.tensor].name;
        if (delta.tensors.empty() || delta.tensors.back().name != name) {
          delta.tensors.push_back(
              {.name = name, .numel = snapshot_.tensors()[chunk.tensor].bits.size()});
        }
        TensorDelta& tensor = delta.tensors.back();
        tensor.indices.insert(tensor.indices.end(), chunk.indices.begin(), chunk.indices.end());
        tensor.values.insert(tensor.values.end(), chunk.values.begin(), chunk.values.end());
        tensor.previous.insert(tensor.previous.end(), chunk.previous.begin(), chunk.previous.end());
      }
      entry.changed = published.changed;
      const io::FileChecksum file = write_delta_file(directory_ / delta_file_name(version), delta);
      entry.delta = ManifestFile{
          .path = delta_file_name(version).string(), .bytes = file.size, .checksum = file.digest};
      published.delta_bytes = file.size;
      if (options_.compact) {
        const io::FileChecksum compact =
            write_compact_file(directory_ / compact_file_name(version), delta);
        entry.compact = ManifestFile{.path = compact_file_name(version).string(),
                                     .bytes = compact.size,
                                     .checksum = compact.digest};
        published.compact_bytes = compact.size;
      }
    }
    if (first || anchor_due(published.delta_bytes)) {
      const io::FileChecksum file =
          write_anchor_file(directory_ / anchor_file_name(version), snapshot_, version,
                            published.digest, options_.encoding);
      entry.anchor = ManifestFile{
          .path = anchor_file_name(version).string(), .bytes = file.size, .checksum = file.digest};
      published.anchor_bytes = file.size;
    }
    upload_files(entry);
    if (options_.fault_hook) options_.fault_hook("files written");
  } catch (...) {
    abandon();  // the manifest does not name the version: readers do not see it
    throw;
  }
  Manifest next = manifest_;
  next.total_elements = snapshot_.total_elements();
  next.versions.push_back(entry);
  try {
    publish_manifest(next);
    if (options_.fault_hook) options_.fault_hook("manifest written");
  } catch (...) {
    // The write may have landed although it reported an error: the location decides.
    const std::optional<bool> landed = location_ends_with(entry);
    if (landed != true) {
      abandon();
      reload_due_ = !landed.has_value();
      throw;
    }
    logger().warn(
        "patch publish: writing the manifest of version {} to {} reported an error, "
        "but the manifest there names it: version {} is published",
        version, location(), version);
  }
  manifest_ = std::move(next);
  count_towards_anchor(entry);
  return published;
}

}  // namespace pulseloco::patch
