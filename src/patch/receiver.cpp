#include <pulseloco/patch/receiver.h>

#include <fmt/format.h>

#include <limits>
#include <numeric>

#include <pulseloco/base/errors.h>
#include <pulseloco/io/s3_client.h>
#include <pulseloco/patch/bucket.h>
#include <pulseloco/patch/compact_files.h>
#include <pulseloco/patch/trl_files.h>

namespace pulseloco::patch {

void rethrow_for_version(const Error& error, std::uint64_t version) {
  const std::string message = fmt::format("version {}: {}", version, error.message());
  switch (error.kind()) {
    case ErrorKind::io:
      throw IoError(message, error.context());
    case ErrorKind::invalid_argument:
      throw InvalidArgument(message, error.context());
    default:
      throw ProtocolError(message, error.context());
  }
}

namespace {

// The elements one delta overwrote, to put back when a later step fails.
struct Undo {
  std::size_t tensor = 0;
  std::vector<std::uint32_t> indices;
  std::vector<std::uint16_t> values;
};

void apply(Bf16State& state, const Delta& delta, std::vector<Undo>* undo) {
  for (const TensorDelta& change : delta.tensors) {
    Bf16Tensor& tensor = *state.find(change.name);  // read_delta_file checked the names
    if (undo != nullptr) {
      Undo entry{.tensor = static_cast<std::size_t>(&tensor - state.tensors().data()),
                 .indices = change.indices};
      entry.values.reserve(change.indices.size());
      for (const std::uint32_t index : change.indices)
        entry.values.push_back(tensor.bits[index]);
      undo->push_back(std::move(entry));
    }
    for (std::size_t k = 0; k < change.indices.size(); ++k)
      tensor.bits[change.indices[k]] = change.values[k];
  }
}

void roll_back(Bf16State& state, std::vector<Undo>& undo) noexcept {
  for (auto it = undo.rbegin(); it != undo.rend(); ++it) {
    std::vector<std::uint16_t>& bits = state.tensors()[it->tensor].bits;
    for (std::size_t k = 0; k < it->indices.size(); ++k)
      bits[it->indices[k]] = it->values[k];
  }
  undo.clear();
}

// Checks a delta's place in the chain and the state it applies to, applies it and checks the
// result. `parent` is the version the state holds.
void apply_checked(Bf16State& state, std::uint64_t parent, const Delta& delta,
                   std::vector<Undo>* undo) {
  if (delta.parent_version != parent) {
    throw ProtocolError(fmt::format("the delta patches version {}, the state is version {}",
                                    delta.parent_version, parent));
  }
  const Digest held = state.digest();
  if (delta.parent_digest != held) {
    throw ProtocolError(fmt::format(
        "the delta patches a state with digest {}, the held state has digest {} (a foreign "
        "patch or a foreign state)",
        digest_hex(delta.parent_digest), digest_hex(held)));
  }
  const std::size_t undo_mark = undo == nullptr ? 0 : undo->size();
  apply(state, delta, undo);
  const Digest result = state.digest();
  if (result != delta.digest) {
    if (undo != nullptr) {
      std::vector<Undo> own(std::make_move_iterator(undo->begin() + undo_mark),
                            std::make_move_iterator(undo->end()));
      undo->resize(undo_mark);
      roll_back(state, own);
    }
    throw ProtocolError(fmt::format("the patched state has digest {}, the delta names {}",
                                    digest_hex(result), digest_hex(delta.digest)));
  }
}

// The file a version's delta step reads: the compact patch when listed and smaller.
const ManifestFile& delta_step_file(const ManifestVersion& entry, StepKind& kind) {
  const bool compact = entry.compact && entry.compact->bytes < entry.delta->bytes;
  kind = compact ? StepKind::compact : StepKind::delta;
  return compact ? *entry.compact : *entry.delta;
}

Delta read_patch_file(const std::filesystem::path& path, StepKind kind, const Bf16State& held) {
  return kind == StepKind::compact ? read_compact_file(path, held) : read_delta_file(path, held);
}

}  // namespace

const ManifestFile& step_file(const ManifestVersion& entry, StepKind kind) {
  switch (kind) {
    case StepKind::anchor:
      return *entry.anchor;
    case StepKind::compact:
      return *entry.compact;
    case StepKind::delta:
      break;
  }
  return *entry.delta;
}

std::string_view step_kind_name(StepKind kind) noexcept {
  switch (kind) {
    case StepKind::anchor:
      return "anchor";
    case StepKind::delta:
      return "delta";
    case StepKind::compact:
      return "compact";
  }
  return "unknown";
}

std::uint64_t UpdateReport::bytes() const noexcept {
  std::uint64_t total = 0;
  for (const UpdateStep& step : steps)
    total += step.bytes;
  return total;
}

std::vector<UpdateStep> plan_update(const Manifest& manifest, std::optional<std::uint64_t> from,
                                    std::uint64_t target) {
  const std::vector<ManifestVersion>& versions = manifest.versions;
  const ManifestVersion* target_entry = manifest.find(target);
  if (target_entry == nullptr) {
    throw InvalidArgument(fmt::format("version {} is not published in this directory", target));
  }
  const auto target_index = static_cast<std::size_t>(target_entry - versions.data());
  // delta_sum[i] = bytes of the deltas of versions[1..i].
  std::vector<std::uint64_t> delta_sum(versions.size(), 0);
  StepKind kind = StepKind::delta;
  for (std::size_t i = 1; i < versions.size(); ++i)
    delta_sum[i] = delta_sum[i - 1] + delta_step_file(versions[i], kind).bytes;

  std::optional<std::size_t> start;  // index of the held version when deltas can start there
  std::optional<std::size_t> anchor;
  std::uint64_t best = std::numeric_limits<std::uint64_t>::max();
  if (from) {
    const ManifestVersion* held = manifest.find(*from);
    if (held != nullptr && held->version <= target) {
      start = static_cast<std::size_t>(held - versions.data());
      best = delta_sum[target_index] - delta_sum[*start];
    }
  }
  for (std::size_t a = 0; a <= target_index; ++a) {
    if (!versions[a].anchor) continue;
    const std::uint64_t cost = versions[a].anchor->bytes + delta_sum[target_index] - delta_sum[a];
    if (cost < best) {
      best = cost;
      anchor = a;
    }
  }
  std::vector<UpdateStep> steps;
  std::size_t next = 0;
  if (anchor) {
    steps.push_back({.version = versions[*anchor].version,
                     .kind = StepKind::anchor,
                     .bytes = versions[*anchor].anchor->bytes});
    next = *anchor + 1;
  } else if (start) {
    next = *start + 1;
  } else {
    throw InvalidArgument(
        fmt::format("version {} cannot be reached: no anchor at or before it", target));
  }
  for (std::size_t i = next; i <= target_index; ++i) {
    const std::uint64_t bytes = delta_step_file(versions[i], kind).bytes;
    steps.push_back({.version = versions[i].version, .kind = kind, .bytes = bytes});
  }
  return steps;
}

Receiver::Receiver(Bf16State state, std::uint64_t version)
    : state_(std::move(state)), version_(version) {}

UpdateReport Receiver::update(const std::filesystem::path& directory,
                              std::optional<std::uint64_t> target) {
  if (io::is_s3_address(directory.native())) {
    io::S3Client client(io::S3Settings::from_environment());
    return update_from_bucket(*this, client, io::parse_s3_address(directory.native()), target);
  }
  const Manifest manifest = read_manifest(directory);
  if (manifest.versions.empty())
    throw InvalidArgument(fmt::format("'{}' holds no published version", directory.string()));
  UpdateReport report{.from = version_, .to = target.value_or(manifest.versions.back().version)};
  if (version_) {
    // A held version this directory lists must be the state it published.
    const ManifestVersion* entry = manifest.find(*version_);
    if (entry != nullptr && entry->digest != state_.digest()) {
      throw ProtocolError(
          fmt::format("version {}: the held state has digest {}, this directory published {}",
                      *version_, digest_hex(state_.digest()), digest_hex(entry->digest)));
    }
    if (*version_ == report.to && entry != nullptr) return report;
  }
  report.steps = plan_update(manifest, version_, report.to);

  Bf16State loaded;  // the anchor's state, when the path starts at one
  bool from_anchor = false;
  std::optional<std::uint64_t> held = version_;
  std::vector<Undo> undo;
  std::uint64_t step_version = 0;
  try {
    for (const UpdateStep& step : report.steps) {
      step_version = step.version;
      const ManifestVersion& entry = *manifest.find(step.version);
      if (step.kind == StepKind::anchor) {
        check_listed_file(directory, *entry.anchor);
        Anchor anchor = read_anchor_file(directory / entry.anchor->path);
        if (anchor.version != step.version || anchor.digest != entry.digest) {
          throw ProtocolError(
              fmt::format("the anchor file holds version {} with digest {}, the manifest lists {}",
                          anchor.version, digest_hex(anchor.digest), digest_hex(entry.digest)));
        }
        loaded = std::move(anchor.state);
        from_anchor = true;
      } else {
        StepKind kind = StepKind::delta;
        const ManifestFile& file = delta_step_file(entry, kind);
        check_listed_file(directory, file);
        Bf16State& state = from_anchor ? loaded : state_;
        const Delta delta = read_patch_file(directory / file.path, kind, state);
        if (delta.version != step.version || delta.digest != entry.digest) {
          throw ProtocolError(
              fmt::format("the delta file holds version {} with digest {}, the manifest lists {}",
                          delta.version, digest_hex(delta.digest), digest_hex(entry.digest)));
        }
        apply_checked(state, held.value_or(0), delta, from_anchor ? nullptr : &undo);
      }
      held = step.version;
    }
  } catch (const Error& error) {
    roll_back(state_, undo);
    rethrow_for_version(error, step_version);
  } catch (...) {
    roll_back(state_, undo);
    throw;
  }
  if (from_anchor) state_ = std::move(loaded);
  version_ = report.to;
  return report;
}

void Receiver::apply_file(const std::filesystem::path& path) {
  if (!version_) throw InvalidArgument("the receiver holds no version to patch");
  const StepKind kind = path.extension() == ".plsp" ? StepKind::compact : StepKind::delta;
  apply_delta(read_patch_file(path, kind, state_));  // its errors name the file
}

void Receiver::apply_delta(const Delta& delta) {
  if (!version_) throw InvalidArgument("the receiver holds no version to patch");
  std::vector<Undo> undo;
  try {
    apply_checked(state_, *version_, delta, &undo);
  } catch (const Error& error) {
    rethrow_for_version(error, delta.version);
  }
  version_ = delta.version;
}

}  // namespace pulseloco::patch
