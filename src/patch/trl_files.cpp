#include <pulseloco/patch/trl_files.h>

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <limits>
#include <span>

#include <pulseloco/base/errors.h>
#include <pulseloco/io/safetensors.h>

namespace pulseloco::patch {
namespace {

constexpr std::string_view kFormat = "sparse_weight_patch";
constexpr std::string_view kFormatVersion = "1";
constexpr std::string_view kIdxSuffix = ".idx";
constexpr std::string_view kValSuffix = ".val";

// Python's str(float) for the values TRL writes (a fraction in [0, 1]): the shortest repr,
// with ".0" when it would read as an integer.
std::string python_float(double value) {
  std::string text = fmt::format("{}", value);
  if (text.find_first_of(".en") == std::string::npos) text += ".0";
  return text;
}

io::Metadata trl_metadata(bool sparse, std::uint64_t version, std::uint64_t params,
                          std::uint64_t changed, std::uint64_t total, IndexEncoding encoding) {
  const double density =
      total == 0 ? 0.0 : static_cast<double>(changed) / static_cast<double>(total);
  return io::Metadata{
      {"format", std::string(kFormat)},
      {"version", std::string(kFormatVersion)},
      {"sparse", sparse ? "True" : "False"},
      {"model_version", std::to_string(version)},
      {"num_changed_params", std::to_string(params)},
      {"total_changed_elements", std::to_string(changed)},
      {"total_elements", std::to_string(total)},
      {"sparsity", python_float(1.0 - density)},
      {"encoding", std::string(index_encoding_name(encoding))},
      {"pulseloco.digest_definition", std::string(kStateDigestName)},
  };
}

[[noreturn]] void bad_file(const std::filesystem::path& path, std::string_view reason,
                           std::string_view tensor = {}) {
  throw ProtocolError(fmt::format("'{}' is not a valid patch file: {}", path.string(), reason),
                      ErrorContext{.tensor = std::string(tensor)});
}

const std::string& metadata_value(const io::SafetensorsReader& reader, std::string_view key) {
  const auto it = reader.metadata().find(std::string(key));
  if (it == reader.metadata().end())
    bad_file(reader.path(), fmt::format("its metadata has no '{}'", key));
  return it->second;
}

std::uint64_t metadata_u64(const io::SafetensorsReader& reader, std::string_view key) {
  const std::string& text = metadata_value(reader, key);
  std::uint64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || text.empty())
    bad_file(reader.path(),
             fmt::format("metadata '{}' = '{}' is not an unsigned integer", key, text));
  return value;
}

Digest metadata_digest(const io::SafetensorsReader& reader, std::string_view key) {
  const std::string& text = metadata_value(reader, key);
  Digest value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  if (text.size() != 16 || error != std::errc() || end != text.data() + text.size())
    bad_file(reader.path(), fmt::format("metadata '{}' = '{}' is not 16 hex digits", key, text));
  return value;
}

void expect_metadata(const io::SafetensorsReader& reader, std::string_view key,
                     std::string_view expected) {
  const std::string& text = metadata_value(reader, key);
  if (text != expected)
    bad_file(reader.path(), fmt::format("metadata '{}' is '{}', not '{}'", key, text, expected));
}

IndexEncoding metadata_encoding(const io::SafetensorsReader& reader) {
  const std::string& text = metadata_value(reader, "encoding");
  if (text == "raw") return IndexEncoding::raw;
  if (text == "gap_delta") return IndexEncoding::gap_delta;
  bad_file(reader.path(), fmt::format("index encoding '{}' is not raw or gap_delta", text));
}

// The keys every anchor and delta has; returns the version.
std::uint64_t check_common_metadata(const io::SafetensorsReader& reader, bool sparse) {
  expect_metadata(reader, "format", kFormat);
  expect_metadata(reader, "version", kFormatVersion);
  expect_metadata(reader, "sparse", sparse ? "True" : "False");
  expect_metadata(reader, "pulseloco.digest_definition", kStateDigestName);
  (void)metadata_encoding(reader);
  return metadata_u64(reader, "model_version");
}

bool is_nan_bf16(std::uint16_t bits) {
  return (bits & 0x7FFFu) > 0x7F80u;
}

// The largest gap of ascending indices coded as TRL's gap_delta (idx[-1] = -1).
std::uint64_t largest_gap(const std::vector<std::uint32_t>& indices) {
  std::uint64_t largest = 0;
  std::int64_t previous = -1;
  for (const std::uint32_t index : indices) {
    largest = std::max(largest, static_cast<std::uint64_t>(index - previous - 1));
    previous = index;
  }
  return largest;
}

template <typename Gap>
std::vector<Gap> gaps_of(const std::vector<std::uint32_t>& indices) {
  std::vector<Gap> gaps(indices.size());
  std::int64_t previous = -1;
  for (std::size_t k = 0; k < indices.size(); ++k) {
    gaps[k] = static_cast<Gap>(indices[k] - previous - 1);
    previous = indices[k];
  }
  return gaps;
}

// Reads the idx tensor of `name` (n entries) into indices below `numel`, strictly ascending.
std::vector<std::uint32_t> read_indices(const io::SafetensorsReader& reader,
                                        const io::TensorInfo& info, IndexEncoding encoding,
                                        std::uint64_t n, std::uint64_t numel,
                                        const std::string& tensor) {
  std::vector<std::uint32_t> indices(n);
  std::vector<std::byte> raw(info.byte_size());
  reader.read(info.spec.name, raw);
  std::int64_t previous = -1;
  for (std::uint64_t k = 0; k < n; ++k) {
    std::int64_t index = 0;
    if (encoding == IndexEncoding::raw) {
      std::int32_t value = 0;
      std::memcpy(&value, raw.data() + 4 * k, 4);
      index = value;
    } else if (info.spec.dtype == io::TensorDType::u16) {
      std::uint16_t gap = 0;
      std::memcpy(&gap, raw.data() + 2 * k, 2);
      index = previous + gap + 1;
    } else {
      std::uint32_t gap = 0;
      std::memcpy(&gap, raw.data() + 4 * k, 4);
      index = previous + static_cast<std::int64_t>(gap) + 1;
    }
    if (index <= previous) {
      bad_file(reader.path(),
               fmt::format("index {} at entry {} is not above the previous index {}", index, k,
                           previous),
               tensor);
    }
    if (static_cast<std::uint64_t>(index) >= numel) {
      bad_file(reader.path(),
               fmt::format("index {} at entry {} is out of range for {} elements", index, k, numel),
               tensor);
    }
    indices[k] = static_cast<std::uint32_t>(index);
    previous = index;
  }
  return indices;
}

}  // namespace

std::string_view index_encoding_name(IndexEncoding encoding) noexcept {
  return encoding == IndexEncoding::raw ? "raw" : "gap_delta";
}

IndexEncoding parse_index_encoding(std::string_view name) {
  if (name == "raw") return IndexEncoding::raw;
  if (name == "gap_delta") return IndexEncoding::gap_delta;
  throw InvalidArgument(fmt::format("index encoding '{}' is not one of raw, gap_delta", name));
}

std::uint64_t Delta::changed_elements() const noexcept {
  std::uint64_t changed = 0;
  for (const TensorDelta& tensor : tensors)
    changed += tensor.indices.size();
  return changed;
}

std::filesystem::path anchor_file_name(std::uint64_t version) {
  return std::filesystem::path("anchors") / fmt::format("step_{:06d}.safetensors", version);
}

std::filesystem::path delta_file_name(std::uint64_t version) {
  return std::filesystem::path("deltas") / fmt::format("step_{:06d}.safetensors", version);
}

io::FileChecksum write_delta_file(const std::filesystem::path& path, const Delta& delta) {
  io::Metadata metadata =
      trl_metadata(true, delta.version, delta.tensors.size(), delta.changed_elements(),
                   delta.total_elements, delta.encoding);
  metadata["pulseloco.parent_version"] = std::to_string(delta.parent_version);
  metadata["pulseloco.parent_digest"] = digest_hex(delta.parent_digest);
  metadata["pulseloco.digest"] = digest_hex(delta.digest);

  // The index of each tensor in its dtype; 4-byte tensors first, so that every tensor is
  // naturally aligned in the data section (as the reference writer orders them).
  struct Entry {
    io::TensorSpec spec;
    std::vector<std::byte> bytes;
  };
  std::vector<Entry> entries;
  for (const TensorDelta& tensor : delta.tensors) {
    const std::uint64_t n = tensor.indices.size();
    Entry index{.spec = {tensor.name + std::string(kIdxSuffix), io::TensorDType::i32, {n}}};
    if (delta.encoding == IndexEncoding::raw) {
      const auto bytes = std::as_bytes(std::span(tensor.indices));
      index.bytes.assign(bytes.begin(), bytes.end());
    } else if (largest_gap(tensor.indices) <= 0xFFFF) {
      index.spec.dtype = io::TensorDType::u16;
      const auto gaps = gaps_of<std::uint16_t>(tensor.indices);
      const auto bytes = std::as_bytes(std::span(gaps));
      index.bytes.assign(bytes.begin(), bytes.end());
    } else {
      index.spec.dtype = io::TensorDType::u32;
      const auto gaps = gaps_of<std::uint32_t>(tensor.indices);
      const auto bytes = std::as_bytes(std::span(gaps));
      index.bytes.assign(bytes.begin(), bytes.end());
    }
    entries.push_back(std::move(index));
    Entry value{.spec = {tensor.name + std::string(kValSuffix), io::TensorDType::bf16, {n}}};
    const auto bytes = std::as_bytes(std::span(tensor.values));
    value.bytes.assign(bytes.begin(), bytes.end());
    entries.push_back(std::move(value));
  }
  std::stable_sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return io::tensor_dtype_size(a.spec.dtype) > io::tensor_dtype_size(b.spec.dtype);
  });
  std::vector<io::TensorSpec> specs;
  for (const Entry& entry : entries)
    specs.push_back(entry.spec);
  io::SafetensorsWriter writer(path, metadata, std::move(specs));
  for (const Entry& entry : entries) {
    if (!entry.bytes.empty()) writer.write(entry.spec.name, std::span(entry.bytes));
  }
  writer.finish();
  return io::FileChecksum{.size = writer.file_size(), .digest = writer.file_digest()};
}

io::FileChecksum write_anchor_file(const std::filesystem::path& path, const Bf16State& state,
                                   std::uint64_t version, Digest digest, IndexEncoding encoding) {
  const std::uint64_t total = state.total_elements();
  io::Metadata metadata =
      trl_metadata(false, version, state.tensors().size(), total, total, encoding);
  metadata["pulseloco.digest"] = digest_hex(digest);
  std::vector<io::TensorSpec> specs;
  for (const Bf16Tensor& tensor : state.tensors())
    specs.push_back({tensor.name, io::TensorDType::bf16, tensor.shape});
  io::SafetensorsWriter writer(path, metadata, std::move(specs));
  for (const Bf16Tensor& tensor : state.tensors()) {
    if (!tensor.bits.empty()) writer.write(tensor.name, std::as_bytes(std::span(tensor.bits)));
  }
  writer.finish();
  return io::FileChecksum{.size = writer.file_size(), .digest = writer.file_digest()};
}

Delta read_delta_file(const std::filesystem::path& path, const Bf16State& layout) {
  const io::SafetensorsReader reader(path);
  Delta delta;
  delta.version = check_common_metadata(reader, true);
  delta.encoding = metadata_encoding(reader);
  delta.parent_version = metadata_u64(reader, "pulseloco.parent_version");
  delta.parent_digest = metadata_digest(reader, "pulseloco.parent_digest");
  delta.digest = metadata_digest(reader, "pulseloco.digest");
  delta.total_elements = metadata_u64(reader, "total_elements");
  if (delta.total_elements != layout.total_elements()) {
    bad_file(path, fmt::format("it is for a model of {} elements, not {}", delta.total_elements,
                               layout.total_elements()));
  }

  std::vector<std::string> names;
  for (const io::TensorInfo& info : reader.tensors()) {
    const std::string& key = info.spec.name;
    const bool is_val = key.ends_with(kValSuffix);
    if (!is_val && !key.ends_with(kIdxSuffix))
      bad_file(path, "a tensor name ends in neither .idx nor .val", key);
    const std::string name = key.substr(0, key.size() - kValSuffix.size());
    const std::string partner = name + std::string(is_val ? kIdxSuffix : kValSuffix);
    if (!reader.contains(partner)) bad_file(path, fmt::format("'{}' is missing", partner), name);
    if (is_val) names.push_back(name);
  }
  std::sort(names.begin(), names.end());

  for (const std::string& name : names) {
    const Bf16Tensor* target = layout.find(name);
    if (target == nullptr) bad_file(path, "the receiver holds no tensor of this name", name);
    const io::TensorInfo& values = reader.tensor(name + std::string(kValSuffix));
    const io::TensorInfo& index = reader.tensor(name + std::string(kIdxSuffix));
    if (values.spec.dtype != io::TensorDType::bf16 || values.spec.shape.size() != 1)
      bad_file(path, "its .val is not a 1-D BF16 tensor", name);
    const std::uint64_t n = values.spec.shape[0];
    const bool index_dtype_ok =
        delta.encoding == IndexEncoding::raw
            ? index.spec.dtype == io::TensorDType::i32
            : index.spec.dtype == io::TensorDType::u16 || index.spec.dtype == io::TensorDType::u32;
    if (!index_dtype_ok) {
      bad_file(
          path,
          fmt::format("its .idx has dtype {}, which the {} encoding does not use",
                      io::tensor_dtype_name(index.spec.dtype), index_encoding_name(delta.encoding)),
          name);
    }
    if (index.spec.shape != std::vector<std::uint64_t>{n})
      bad_file(path, fmt::format("its .idx does not hold {} entries like its .val", n), name);
    if (n > target->bits.size())
      bad_file(path, "it changes more elements than the tensor has", name);

    TensorDelta tensor{.name = name, .numel = target->bits.size()};
    tensor.indices = read_indices(reader, index, delta.encoding, n, target->bits.size(), name);
    tensor.values.resize(n);
    reader.read(values.spec.name, std::as_writable_bytes(std::span(tensor.values)));
    const auto nan = std::find_if(tensor.values.begin(), tensor.values.end(), is_nan_bf16);
    if (nan != tensor.values.end()) {
      throw ProtocolError(
          fmt::format("'{}' is not a valid patch file: a new value is NaN", path.string()),
          ErrorContext{.tensor = name, .index = tensor.indices[nan - tensor.values.begin()]});
    }
    delta.tensors.push_back(std::move(tensor));
  }
  if (metadata_u64(reader, "num_changed_params") != delta.tensors.size())
    bad_file(path, "num_changed_params is not the number of tensors it changes");
  if (metadata_u64(reader, "total_changed_elements") != delta.changed_elements())
    bad_file(path, "total_changed_elements is not the number of entries it holds");
  return delta;
}

Anchor read_anchor_file(const std::filesystem::path& path) {
  const io::SafetensorsReader reader(path);
  Anchor anchor;
  anchor.version = check_common_metadata(reader, false);
  anchor.digest = metadata_digest(reader, "pulseloco.digest");
  std::vector<Bf16Tensor> tensors;
  for (const io::TensorInfo& info : reader.tensors()) {
    if (info.spec.dtype != io::TensorDType::bf16)
      bad_file(path, "an anchor tensor is not BF16", info.spec.name);
    Bf16Tensor tensor{.name = info.spec.name, .shape = info.spec.shape};
    tensor.bits.resize(shape_elements(info.spec.name, info.spec.shape));
    reader.read(info.spec.name, std::as_writable_bytes(std::span(tensor.bits)));
    tensors.push_back(std::move(tensor));
  }
  anchor.state = Bf16State(std::move(tensors));
  if (metadata_u64(reader, "total_elements") != anchor.state.total_elements())
    bad_file(path, "total_elements is not the number of elements it holds");
  if (anchor.state.digest() != anchor.digest) {
    bad_file(path, fmt::format("its tensors have digest {}, its metadata names {}",
                               digest_hex(anchor.state.digest()), digest_hex(anchor.digest)));
  }
  return anchor;
}

}  // namespace pulseloco::patch
