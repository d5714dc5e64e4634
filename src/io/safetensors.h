// safetensors files (https://github.com/huggingface/safetensors, format version of 2023+):
//
//   [8 bytes: header length N, little-endian u64]
//   [N bytes: JSON header, padded with spaces to a multiple of 8]
//   [data section: every tensor's raw little-endian, row-major bytes]
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
// relative to the data section) plus an optional "__metadata__" object of string -> string.
//
// SafetensorsWriter streams: it writes the header first and then the data tensor by tensor from
// chunks the caller supplies, so a state of many GB is written with bounded memory. The file is
// written under a temporary name, fsynced and renamed: the final name never holds a partial file.
//
// SafetensorsReader treats every file as hostile input: it validates the whole header (length
// against the file size and a cap, JSON syntax, duplicate names, dtypes, shapes, overflow, offsets
// that exactly tile the data section) before it exposes anything, and it never allocates more
// than the header's bytes for a file, whatever sizes the header declares.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/tensor_view.h>

namespace pulseloco::io {

class AtomicFile;

// The element types of the safetensors format, with their names in the header.
enum class TensorDType : std::uint8_t {
  boolean,  // "BOOL" (1 byte)
  u8,       // "U8"
  i8,       // "I8"
  f8_e4m3,  // "F8_E4M3"
  f8_e5m2,  // "F8_E5M2"
  i16,      // "I16"
  u16,      // "U16"
  f16,      // "F16"
  bf16,     // "BF16"
  i32,      // "I32"
  u32,      // "U32"
  f32,      // "F32"
  f64,      // "F64"
  i64,      // "I64"
  u64,      // "U64"
};

[[nodiscard]] std::string_view tensor_dtype_name(TensorDType dtype) noexcept;
[[nodiscard]] std::size_t tensor_dtype_size(TensorDType dtype) noexcept;
// nullopt for a name the format does not define.
[[nodiscard]] std::optional<TensorDType> parse_tensor_dtype(std::string_view name) noexcept;

// Conversions from and to the core's dtypes (float32 <-> F32, bfloat16 <-> BF16).
[[nodiscard]] TensorDType to_tensor_dtype(DType dtype) noexcept;
[[nodiscard]] std::optional<DType> to_core_dtype(TensorDType dtype) noexcept;

// The safetensors dtype of a C++ element type (for the typed helpers).
template <typename T>
[[nodiscard]] constexpr std::optional<TensorDType> tensor_dtype_of() noexcept {
  if constexpr (std::is_same_v<T, float>) return TensorDType::f32;
  if constexpr (std::is_same_v<T, double>) return TensorDType::f64;
  if constexpr (std::is_same_v<T, std::int64_t>) return TensorDType::i64;
  if constexpr (std::is_same_v<T, std::uint64_t>) return TensorDType::u64;
  if constexpr (std::is_same_v<T, std::int32_t>) return TensorDType::i32;
  if constexpr (std::is_same_v<T, std::uint32_t>) return TensorDType::u32;
  if constexpr (std::is_same_v<T, std::int16_t>) return TensorDType::i16;
  if constexpr (std::is_same_v<T, std::int8_t>) return TensorDType::i8;
  if constexpr (std::is_same_v<T, std::uint8_t>) return TensorDType::u8;
  if constexpr (std::is_same_v<T, bool>) return TensorDType::boolean;
  // std::uint16_t is ambiguous (U16, F16 or raw BF16 bits): the caller states the dtype.
  return std::nullopt;
}

// String -> string, as the format's "__metadata__" requires.
using Metadata = std::map<std::string, std::string>;

// One tensor as declared in a file.
struct TensorSpec {
  std::string name;
  TensorDType dtype = TensorDType::f32;
  std::vector<std::uint64_t> shape;  // {} is a scalar (one element)

  // The product of the shape; throws InvalidArgument when it overflows 64 bits.
  [[nodiscard]] std::uint64_t numel() const;
  // numel() * element size; throws InvalidArgument when it overflows 64 bits.
  [[nodiscard]] std::uint64_t byte_size() const;
};

// A tensor as found in a validated file.
struct TensorInfo {
  TensorSpec spec;
  std::uint64_t data_begin = 0;  // offset within the data section
  std::uint64_t data_end = 0;    // one past the last byte; data_end - data_begin = byte size

  [[nodiscard]] std::uint64_t byte_size() const noexcept { return data_end - data_begin; }
};

// The reference implementation's cap on the header length (100 MB). Larger headers are refused
// before anything is allocated.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

// Writes one file. Tensors are written in the order they are declared, each as one or more
// chunks whose sizes add up to exactly its byte size; zero-byte tensors need no write() call.
// The header lists them in the same order with contiguous data offsets. (The reference writer
// orders tensors by alignment then name; readers accept any order. Declare wide dtypes first
// when readers should see naturally aligned data.)
//
//   SafetensorsWriter writer(path, {{"step", "12"}}, {{"w", TensorDType::f32, {2, 3}}});
//   writer.write("w", std::as_bytes(std::span(values)));   // possibly in several chunks
//   writer.finish();                                         // fsync + rename: now durable
//
// The data goes to "<path>.tmp.<pid>.<n>" (an AtomicFile, io/atomic_file.h) until finish()
// fsyncs it, renames it to `path` and fsyncs the directory. If the writer is destroyed before
// finish() (an exception, a caller that gives up), the temporary file is removed and `path` is left
// as it was.
class SafetensorsWriter {
 public:
  // Validates the declaration (non-empty unique names other than "__metadata__", valid UTF-8,
  // sizes that fit in 64 bits), creates the temporary file and writes the header.
  // Throws InvalidArgument for a bad declaration, IoError when the file cannot be created.
  SafetensorsWriter(std::filesystem::path path, const Metadata& metadata,
                    std::vector<TensorSpec> tensors);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  SafetensorsWriter(SafetensorsWriter&&) = delete;
  SafetensorsWriter& operator=(SafetensorsWriter&&) = delete;

  // Appends `chunk` to tensor `name`. Throws InvalidArgument when `name` is not the tensor being
  // written (tensors go in declared order; a tensor is current until it has all its bytes) or
  // when the chunk would exceed its byte size; IoError when the write fails. After any
  // exception the writer is unusable and finish() throws.
  void write(std::string_view name, std::span<const std::byte> chunk);
  template <typename T>
  void write(std::string_view name, std::span<const T> values) {
    write(name, std::as_bytes(values));
  }

  // Checks that every tensor received exactly its bytes, then makes the file durable under
  // its final name. Throws InvalidArgument (missing bytes) or IoError.
  void finish();

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  // Bytes of the complete file (8 + header + data).
  [[nodiscard]] std::uint64_t file_size() const noexcept { return file_size_; }
  // xxh3-64 of the complete file's bytes (after finish()), for manifests that list files.
  [[nodiscard]] Digest file_digest() const;

 private:
  void flush_buffer();
  void write_all(std::span<const std::byte> bytes);
  void write_to_file(std::span<const std::byte> bytes);
  void fail_if_broken() const;

  std::filesystem::path path_;
  std::unique_ptr<AtomicFile> file_;
  std::vector<TensorSpec> tensors_;
  std::vector<std::uint64_t> byte_sizes_;
  std::size_t current_ = 0;            // index of the tensor being written
  std::uint64_t current_written_ = 0;  // bytes of it written so far
  std::uint64_t file_size_ = 0;
  std::uint64_t file_offset_ = 0;  // bytes handed to the OS or buffered so far
  std::vector<std::byte> buffer_;  // coalesces small chunks
  bool broken_ = false;
  bool finished_ = false;
};

// Opens and validates a file; reads tensors (whole or in byte ranges) into caller buffers.
// Holds the file open; reads use pread, so concurrent reads from several threads are safe.
class SafetensorsReader {
 public:
  // Throws IoError when the file cannot be opened or read, InvalidArgument when it is not a
  // regular file (input_file.h), ProtocolError (naming the file, the tensor and the byte offset
  // in the file) when it is not a valid safetensors file.
  explicit SafetensorsReader(std::filesystem::path path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;
  SafetensorsReader(SafetensorsReader&& other) noexcept;
  SafetensorsReader& operator=(SafetensorsReader&& other) noexcept;

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] const Metadata& metadata() const noexcept { return metadata_; }
  // Tensors in the order of their data offsets.
  [[nodiscard]] const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] bool contains(std::string_view name) const noexcept;
  // Throws InvalidArgument naming the file and the tensor when there is no such tensor.
  [[nodiscard]] const TensorInfo& tensor(std::string_view name) const;
  // Absolute file offset of the data section (8 + header length).
  [[nodiscard]] std::uint64_t data_section_offset() const noexcept { return data_offset_; }

  // Reads the whole tensor; `destination` must have exactly its byte size.
  void read(std::string_view name, std::span<std::byte> destination) const;
  // Reads destination.size() bytes of the tensor starting at `byte_offset` within it (for
  // chunked loading). Throws InvalidArgument when the range is outside the tensor.
  void read_range(std::string_view name, std::uint64_t byte_offset,
                  std::span<std::byte> destination) const;
  // Typed whole-tensor read: checks that T matches the tensor's dtype and the element count.
  template <typename T>
  void read_as(std::string_view name, std::span<T> destination) const {
    static_assert(tensor_dtype_of<T>().has_value(), "use read() with raw bytes for this type");
    check_element_type(name, *tensor_dtype_of<T>(), destination.size());
    read(name, std::as_writable_bytes(destination));
  }

 private:
  void check_element_type(std::string_view name, TensorDType expected,
                          std::size_t element_count) const;
  void pread_exact(std::uint64_t file_offset, std::span<std::byte> destination,
                   std::string_view tensor_name) const;

  std::filesystem::path path_;
  int fd_ = -1;
  Metadata metadata_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t, std::less<>> index_;
  std::uint64_t data_offset_ = 0;
  std::uint64_t file_size_ = 0;
};

}  // namespace pulseloco::io
