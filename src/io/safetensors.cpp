#include <pulseloco/io/safetensors.h>

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include <pulseloco/base/errors.h>
#include <pulseloco/io/atomic_file.h>
#include <pulseloco/io/input_file.h>

namespace pulseloco::io {
namespace {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts would need byte swapping");

struct DTypeEntry {
  TensorDType dtype;
  std::string_view name;
  std::size_t size;
};

constexpr std::array<DTypeEntry, 15> kDTypes{{
    {TensorDType::boolean, "BOOL", 1},
    {TensorDType::u8, "U8", 1},
    {TensorDType::i8, "I8", 1},
    {TensorDType::f8_e4m3, "F8_E4M3", 1},
    {TensorDType::f8_e5m2, "F8_E5M2", 1},
    {TensorDType::i16, "I16", 2},
    {TensorDType::u16, "U16", 2},
    {TensorDType::f16, "F16", 2},
    {TensorDType::bf16, "BF16", 2},
    {TensorDType::i32, "I32", 4},
    {TensorDType::u32, "U32", 4},
    {TensorDType::f32, "F32", 4},
    {TensorDType::f64, "F64", 8},
    {TensorDType::i64, "I64", 8},
    {TensorDType::u64, "U64", 8},
}};

const DTypeEntry& dtype_entry(TensorDType dtype) noexcept {
  const auto index = static_cast<std::size_t>(dtype);
  PULSELOCO_CHECK(index < kDTypes.size() && kDTypes[index].dtype == dtype, "unknown TensorDType");
  return kDTypes[index];
}

constexpr std::string_view kMetadataKey = "__metadata__";
constexpr std::size_t kWriteBufferBytes = std::size_t{1} << 20;

std::uint64_t checked_numel(const std::vector<std::uint64_t>& shape, bool* overflow) {
  std::uint64_t numel = 1;
  *overflow = false;
  for (const std::uint64_t dim : shape) {
    if (__builtin_mul_overflow(numel, dim, &numel)) {
      *overflow = true;
      return 0;
    }
  }
  return numel;
}

std::string shape_text(const std::vector<std::uint64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

}  // namespace

std::string_view tensor_dtype_name(TensorDType dtype) noexcept {
  return dtype_entry(dtype).name;
}

std::size_t tensor_dtype_size(TensorDType dtype) noexcept {
  return dtype_entry(dtype).size;
}

std::optional<TensorDType> parse_tensor_dtype(std::string_view name) noexcept {
  for (const DTypeEntry& entry : kDTypes) {
    if (entry.name == name) return entry.dtype;
  }
  return std::nullopt;
}

TensorDType to_tensor_dtype(DType dtype) noexcept {
  return dtype == DType::float32 ? TensorDType::f32 : TensorDType::bf16;
}

std::optional<DType> to_core_dtype(TensorDType dtype) noexcept {
  if (dtype == TensorDType::f32) return DType::float32;
  if (dtype == TensorDType::bf16) return DType::bfloat16;
  return std::nullopt;
}

std::uint64_t TensorSpec::numel() const {
  bool overflow = false;
  const std::uint64_t count = checked_numel(shape, &overflow);
  if (overflow) {
    throw InvalidArgument(fmt::format("shape {} has more than 2^64 elements", shape_text(shape)),
                          {.tensor = name});
  }
  return count;
}

std::uint64_t TensorSpec::byte_size() const {
  std::uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel(), tensor_dtype_size(dtype), &bytes)) {
    throw InvalidArgument(fmt::format("shape {} of {} needs more than 2^64 bytes",
                                      shape_text(shape), tensor_dtype_name(dtype)),
                          {.tensor = name});
  }
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// Writer

SafetensorsWriter::SafetensorsWriter(std::filesystem::path path, const Metadata& metadata,
                                     std::vector<TensorSpec> tensors)
    : path_(std::move(path)), tensors_(std::move(tensors)) {
  if (path_.empty()) throw InvalidArgument("safetensors writer: empty file path");

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json meta = nlohmann::ordered_json::object();
    for (const auto& [key, value] : metadata)
      meta[key] = value;
    header[std::string(kMetadataKey)] = std::move(meta);
  }
  std::set<std::string_view> names;
  std::uint64_t offset = 0;
  byte_sizes_.reserve(tensors_.size());
  for (const TensorSpec& spec : tensors_) {
    if (spec.name.empty()) {
      throw InvalidArgument(fmt::format("'{}': a tensor name is empty", path_.string()));
    }
    if (spec.name == kMetadataKey) {
      throw InvalidArgument(
          fmt::format("'{}': the tensor name '__metadata__' is reserved", path_.string()),
          {.tensor = spec.name});
    }
    if (!names.insert(spec.name).second) {
      throw InvalidArgument(fmt::format("'{}': tensor declared twice", path_.string()),
                            {.tensor = spec.name});
    }
    const std::uint64_t bytes = spec.byte_size();
    std::uint64_t end = 0;
    if (__builtin_add_overflow(offset, bytes, &end)) {
      throw InvalidArgument(
          fmt::format("'{}': the tensors need more than 2^64 bytes", path_.string()),
          {.tensor = spec.name});
    }
    header[spec.name] = {{"dtype", tensor_dtype_name(spec.dtype)},
                         {"shape", spec.shape},
                         {"data_offsets", {offset, end}}};
    byte_sizes_.push_back(bytes);
    offset = end;
  }

  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::json::type_error& error) {
    // dump() refuses strings that are not valid UTF-8 (tensor names, metadata).
    throw InvalidArgument(fmt::format("'{}': the header cannot be encoded as JSON: {}",
                                      path_.string(), error.what()));
  }
  // Pad with spaces to a multiple of 8 bytes, as the reference writer does, so the data section
  // starts 8-byte aligned.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  if (header_text.size() > kMaxHeaderBytes) {
    throw InvalidArgument(
        fmt::format("'{}': the header would be {} bytes; readers accept at most {}", path_.string(),
                    header_text.size(), kMaxHeaderBytes));
  }
  const std::uint64_t header_size = header_text.size();
  file_size_ = 8 + header_size + offset;

  file_ = std::make_unique<AtomicFile>(path_);
  buffer_.reserve(kWriteBufferBytes);
  std::array<std::byte, 8> length{};
  for (std::size_t i = 0; i < 8; ++i)
    length[i] = std::byte((header_size >> (8 * i)) & 0xFFu);
  write_all(length);
  write_all(std::as_bytes(std::span(header_text.data(), header_text.size())));
  // Skip leading zero-byte tensors so write() always addresses a tensor that still needs bytes.
  while (current_ < tensors_.size() && byte_sizes_[current_] == 0)
    ++current_;
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::fail_if_broken() const {
  if (broken_) {
    throw InvalidArgument(
        fmt::format("'{}': the writer failed earlier and cannot continue", path_.string()));
  }
  if (finished_) {
    throw InvalidArgument(fmt::format("'{}': the file is already finished", path_.string()));
  }
}

void SafetensorsWriter::write_all(std::span<const std::byte> bytes) {
  // Small writes gather in the buffer; a write that does not fit flushes it, and one at least
  // as large as the buffer goes to the file directly.
  if (buffer_.size() + bytes.size() > kWriteBufferBytes) flush_buffer();
  if (bytes.size() < kWriteBufferBytes) {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
    file_offset_ += bytes.size();
    return;
  }
  write_to_file(bytes);
  file_offset_ += bytes.size();
}

void SafetensorsWriter::flush_buffer() {
  write_to_file(buffer_);
  buffer_.clear();
}

void SafetensorsWriter::write_to_file(std::span<const std::byte> bytes) {
  try {
    file_->write(bytes);
  } catch (...) {
    broken_ = true;
    throw;
  }
}

void SafetensorsWriter::write(std::string_view name, std::span<const std::byte> chunk) {
  fail_if_broken();
  if (current_ >= tensors_.size()) {
    broken_ = true;
    throw InvalidArgument(
        fmt::format("'{}': every declared tensor already has all its bytes", path_.string()),
        {.tensor = std::string(name)});
  }
  const TensorSpec& spec = tensors_[current_];
  if (name != spec.name) {
    broken_ = true;
    throw InvalidArgument(
        fmt::format("'{}': tensors are written in declared order; expected bytes of '{}' "
                    "({} of {} written)",
                    path_.string(), spec.name, current_written_, byte_sizes_[current_]),
        {.tensor = std::string(name)});
  }
  const std::uint64_t remaining = byte_sizes_[current_] - current_written_;
  if (chunk.size() > remaining) {
    broken_ = true;
    throw InvalidArgument(
        fmt::format("'{}': chunk of {} bytes exceeds the tensor's remaining {} of {} bytes",
                    path_.string(), chunk.size(), remaining, byte_sizes_[current_]),
        {.tensor = spec.name, .byte_offset = current_written_});
  }
  write_all(chunk);
  current_written_ += chunk.size();
  if (current_written_ == byte_sizes_[current_]) {
    current_written_ = 0;
    ++current_;
    while (current_ < tensors_.size() && byte_sizes_[current_] == 0)
      ++current_;
  }
}

void SafetensorsWriter::finish() {
  fail_if_broken();
  if (current_ < tensors_.size()) {
    broken_ = true;
    throw InvalidArgument(
        fmt::format("'{}': tensor '{}' received {} of its {} bytes", path_.string(),
                    tensors_[current_].name, current_written_, byte_sizes_[current_]),
        {.tensor = tensors_[current_].name});
  }
  flush_buffer();
  PULSELOCO_CHECK(file_offset_ == file_size_, "safetensors writer size bookkeeping");
  try {
    file_->commit();
  } catch (...) {
    broken_ = true;
    throw;
  }
  finished_ = true;
}

Digest SafetensorsWriter::file_digest() const {
  PULSELOCO_CHECK(finished_, "file_digest() before finish()");
  return file_->digest();
}

// ---------------------------------------------------------------------------------------------
// Reader

namespace {

using Json = nlohmann::json;

class HeaderParser {
 public:
  HeaderParser(const std::filesystem::path& path, std::uint64_t header_size,
               std::uint64_t data_size)
      : path_(path), header_size_(header_size), data_size_(data_size) {}

  [[noreturn]] void fail(std::string_view what, std::string tensor = {},
                         std::optional<std::uint64_t> offset = std::nullopt) const {
    // Without a position the error points at the header's first byte.
    throw ProtocolError(
        fmt::format("'{}' is not a valid safetensors file: {}", path_.string(), what),
        {.tensor = std::move(tensor), .byte_offset = offset.value_or(8)});
  }

  Json parse(std::string_view text) {
    // Keys seen per open object, to refuse duplicates (a JSON library would keep the last one
    // silently, so two readers could see different tensors). Nesting deeper than the format
    // allows is refused while parsing.
    std::vector<std::set<std::string>> open_objects;
    const Json::parser_callback_t callback = [&](int depth, Json::parse_event_t event,
                                                 Json& parsed) -> bool {
      switch (event) {
        case Json::parse_event_t::object_start:
        case Json::parse_event_t::array_start:
          if (depth > 2) fail("the header nests objects or arrays deeper than the format allows");
          if (event == Json::parse_event_t::object_start) open_objects.emplace_back();
          break;
        case Json::parse_event_t::object_end:
          open_objects.pop_back();
          break;
        case Json::parse_event_t::key: {
          const auto& key = parsed.get_ref<const std::string&>();
          if (!open_objects.back().insert(key).second) {
            fail(fmt::format("the key '{}' appears twice in one object", key),
                 depth == 1 ? key : std::string());
          }
          break;
        }
        default:
          break;
      }
      return true;
    };
    try {
      return Json::parse(text.begin(), text.end(), callback);
    } catch (const Json::parse_error& error) {
      // error.byte is 1-based within the header.
      const std::uint64_t offset = 8 + (error.byte > 0 ? error.byte - 1 : 0);
      fail(fmt::format("the header is not valid JSON: {}", error.what()), {}, offset);
    }
  }

  std::uint64_t unsigned_field(const Json& value, std::string_view what,
                               const std::string& tensor) const {
    if (value.is_number_unsigned()) return value.get<std::uint64_t>();
    if (value.is_number_integer()) fail(fmt::format("{} is negative", what), tensor);
    if (value.is_number_float()) {
      fail(fmt::format("{} is not an integer that fits in 64 bits ({})", what, value.dump()),
           tensor);
    }
    fail(fmt::format("{} is not an integer but {}", what, value.type_name()), tensor);
  }

  TensorInfo tensor(const std::string& name, const Json& entry) const {
    if (name.empty()) fail("a tensor has an empty name");
    if (!entry.is_object()) {
      fail(fmt::format("the entry is a JSON {}, not an object", entry.type_name()), name);
    }
    for (const auto& [key, value] : entry.items()) {
      if (key != "dtype" && key != "shape" && key != "data_offsets") {
        fail(fmt::format("unknown field '{}' (expected dtype, shape, data_offsets)", key), name);
      }
    }
    TensorInfo info;
    info.spec.name = name;

    const auto dtype_it = entry.find("dtype");
    if (dtype_it == entry.end()) fail("missing field 'dtype'", name);
    if (!dtype_it->is_string()) fail("'dtype' is not a string", name);
    const auto& dtype_name = dtype_it->get_ref<const std::string&>();
    const std::optional<TensorDType> dtype = parse_tensor_dtype(dtype_name);
    if (!dtype) fail(fmt::format("unknown dtype '{}'", dtype_name), name);
    info.spec.dtype = *dtype;

    const auto shape_it = entry.find("shape");
    if (shape_it == entry.end()) fail("missing field 'shape'", name);
    if (!shape_it->is_array()) fail("'shape' is not an array", name);
    info.spec.shape.reserve(shape_it->size());
    for (const Json& dim : *shape_it) {
      info.spec.shape.push_back(unsigned_field(dim, "a dimension of 'shape'", name));
    }

    const auto offsets_it = entry.find("data_offsets");
    if (offsets_it == entry.end()) fail("missing field 'data_offsets'", name);
    if (!offsets_it->is_array() || offsets_it->size() != 2) {
      fail("'data_offsets' is not an array of two integers", name);
    }
    info.data_begin = unsigned_field((*offsets_it)[0], "data_offsets[0]", name);
    info.data_end = unsigned_field((*offsets_it)[1], "data_offsets[1]", name);
    const std::uint64_t data_start = 8 + header_size_;
    if (info.data_begin > info.data_end) {
      fail(fmt::format("data_offsets [{}, {}] end before they begin", info.data_begin,
                       info.data_end),
           name, data_start + std::min(info.data_begin, data_size_));
    }
    if (info.data_end > data_size_) {
      fail(fmt::format("data_offsets [{}, {}] reach past the data section ({} bytes)",
                       info.data_begin, info.data_end, data_size_),
           name, data_start + std::min(info.data_begin, data_size_));
    }

    bool overflow = false;
    const std::uint64_t numel = checked_numel(info.spec.shape, &overflow);
    std::uint64_t bytes = 0;
    if (overflow || __builtin_mul_overflow(numel, tensor_dtype_size(info.spec.dtype), &bytes)) {
      fail(fmt::format("shape {} of {} overflows 64 bits", shape_text(info.spec.shape), dtype_name),
           name);
    }
    if (bytes != info.data_end - info.data_begin) {
      fail(fmt::format("shape {} of {} needs {} bytes but data_offsets [{}, {}] span {}",
                       shape_text(info.spec.shape), dtype_name, bytes, info.data_begin,
                       info.data_end, info.data_end - info.data_begin),
           name, data_start + info.data_begin);
    }
    return info;
  }

  Metadata metadata(const Json& entry) const {
    if (!entry.is_object()) {
      fail(fmt::format("'__metadata__' is a JSON {}, not an object", entry.type_name()));
    }
    Metadata result;
    for (const auto& [key, value] : entry.items()) {
      if (!value.is_string()) {
        fail(fmt::format("'__metadata__' value of '{}' is a JSON {}, not a string", key,
                         value.type_name()));
      }
      result.emplace(key, value.get<std::string>());
    }
    return result;
  }

  // Tensors must tile the data section exactly: no overlap (two tensors sharing bytes), no gap
  // (bytes no tensor owns), nothing left over at the end.
  void check_tiling(std::vector<TensorInfo>& tensors) const {
    std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return std::tie(a.data_begin, a.data_end, a.spec.name) <
             std::tie(b.data_begin, b.data_end, b.spec.name);
    });
    const std::uint64_t data_start = 8 + header_size_;
    std::uint64_t covered = 0;
    const TensorInfo* previous = nullptr;
    for (const TensorInfo& info : tensors) {
      if (info.data_begin < covered) {
        fail(fmt::format("data_offsets [{}, {}] overlap tensor '{}' (which ends at {})",
                         info.data_begin, info.data_end, previous->spec.name, covered),
             info.spec.name, data_start + info.data_begin);
      }
      if (info.data_begin > covered) {
        fail(fmt::format("bytes [{}, {}) of the data section belong to no tensor", covered,
                         info.data_begin),
             info.spec.name, data_start + covered);
      }
      covered = info.data_end;
      previous = &info;
    }
    if (covered != data_size_) {
      fail(fmt::format("the data section has {} bytes but its tensors cover only {}", data_size_,
                       covered),
           {}, data_start + covered);
    }
  }

 private:
  const std::filesystem::path& path_;
  std::uint64_t header_size_;
  std::uint64_t data_size_;
};

}  // namespace

SafetensorsReader::SafetensorsReader(std::filesystem::path path) : path_(std::move(path)) {
  {
    InputFile file(path_, "a safetensors file");
    file_size_ = file.size();
    fd_ = file.release();
  }
  try {
    if (file_size_ < 8) {
      throw ProtocolError(
          fmt::format("'{}' is not a valid safetensors file: it has {} bytes, fewer than the "
                      "8-byte header length",
                      path_.string(), file_size_),
          {.byte_offset = 0});
    }
    std::array<std::byte, 8> length_bytes{};
    pread_exact(0, length_bytes, {});
    std::uint64_t header_size = 0;
    for (std::size_t i = 0; i < 8; ++i) {
      header_size |= static_cast<std::uint64_t>(length_bytes[i]) << (8 * i);
    }
    if (header_size > kMaxHeaderBytes) {
      throw ProtocolError(
          fmt::format("'{}' is not a valid safetensors file: header length {} exceeds the "
                      "limit of {} bytes",
                      path_.string(), header_size, kMaxHeaderBytes),
          {.byte_offset = 0});
    }
    if (header_size > file_size_ - 8) {
      throw ProtocolError(
          fmt::format("'{}' is not a valid safetensors file: header length {} exceeds the {} "
                      "bytes after the length field (truncated file?)",
                      path_.string(), header_size, file_size_ - 8),
          {.byte_offset = 0});
    }
    std::string header_text(header_size, '\0');
    pread_exact(8, std::as_writable_bytes(std::span(header_text.data(), header_text.size())), {});
    if (header_text.empty() || header_text.front() != '{') {
      throw ProtocolError(
          fmt::format("'{}' is not a valid safetensors file: the header does not start with '{{'",
                      path_.string()),
          {.byte_offset = 8});
    }
    data_offset_ = 8 + header_size;
    HeaderParser parser(path_, header_size, file_size_ - data_offset_);
    const Json header = parser.parse(header_text);
    if (!header.is_object()) parser.fail("the header is not a JSON object");

    std::vector<TensorInfo> tensors;
    for (const auto& [key, value] : header.items()) {
      if (key == kMetadataKey) {
        metadata_ = parser.metadata(value);
      } else {
        tensors.push_back(parser.tensor(key, value));
      }
    }
    parser.check_tiling(tensors);
    tensors_ = std::move(tensors);
    for (std::size_t i = 0; i < tensors_.size(); ++i)
      index_.emplace(tensors_[i].spec.name, i);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

SafetensorsReader::SafetensorsReader(SafetensorsReader&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      metadata_(std::move(other.metadata_)),
      tensors_(std::move(other.tensors_)),
      index_(std::move(other.index_)),
      data_offset_(other.data_offset_),
      file_size_(other.file_size_) {}

SafetensorsReader& SafetensorsReader::operator=(SafetensorsReader&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    metadata_ = std::move(other.metadata_);
    tensors_ = std::move(other.tensors_);
    index_ = std::move(other.index_);
    data_offset_ = other.data_offset_;
    file_size_ = other.file_size_;
  }
  return *this;
}

bool SafetensorsReader::contains(std::string_view name) const noexcept {
  return index_.find(name) != index_.end();
}

const TensorInfo& SafetensorsReader::tensor(std::string_view name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) {
    throw InvalidArgument(fmt::format("'{}' has no tensor of that name", path_.string()),
                          {.tensor = std::string(name)});
  }
  return tensors_[it->second];
}

void SafetensorsReader::read(std::string_view name, std::span<std::byte> destination) const {
  const TensorInfo& info = tensor(name);
  if (destination.size() != info.byte_size()) {
    throw InvalidArgument(fmt::format("'{}': the tensor has {} bytes, the buffer {}",
                                      path_.string(), info.byte_size(), destination.size()),
                          {.tensor = info.spec.name});
  }
  pread_exact(data_offset_ + info.data_begin, destination, info.spec.name);
}

void SafetensorsReader::read_range(std::string_view name, std::uint64_t byte_offset,
                                   std::span<std::byte> destination) const {
  const TensorInfo& info = tensor(name);
  if (byte_offset > info.byte_size() || destination.size() > info.byte_size() - byte_offset) {
    throw InvalidArgument(
        fmt::format("'{}': bytes [{}, {}+{}) are outside the tensor's {} bytes", path_.string(),
                    byte_offset, byte_offset, destination.size(), info.byte_size()),
        {.tensor = info.spec.name, .byte_offset = byte_offset});
  }
  pread_exact(data_offset_ + info.data_begin + byte_offset, destination, info.spec.name);
}

void SafetensorsReader::check_element_type(std::string_view name, TensorDType expected,
                                           std::size_t element_count) const {
  const TensorInfo& info = tensor(name);
  if (info.spec.dtype != expected) {
    throw InvalidArgument(
        fmt::format("'{}': the tensor is {}, the buffer {}", path_.string(),
                    tensor_dtype_name(info.spec.dtype), tensor_dtype_name(expected)),
        {.tensor = info.spec.name});
  }
  if (element_count != info.spec.numel()) {
    throw InvalidArgument(fmt::format("'{}': the tensor has {} elements, the buffer {}",
                                      path_.string(), info.spec.numel(), element_count),
                          {.tensor = info.spec.name});
  }
}

void SafetensorsReader::pread_exact(std::uint64_t file_offset, std::span<std::byte> destination,
                                    std::string_view tensor_name) const {
  read_exactly(fd_, path_, file_offset, destination, tensor_name);
}

}  // namespace pulseloco::io
