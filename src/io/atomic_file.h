// Files that appear under their final name only complete and durable. AtomicFile writes to a
// temporary name in the final directory ("<path>.tmp.<pid>.<n>"), hashes every byte it writes
// (xxh3-64, base/digest.h) and commit() fsyncs the file, renames it and fsyncs the directory.
// A file that is never committed (an exception, ENOSPC) is removed: the final name keeps
// whatever it held before. The temporary file is always created new (O_EXCL, O_NOFOLLOW): a
// link someone planted at its name is never written through.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include <pulseloco/base/digest.h>

namespace pulseloco::io {

class AtomicFile {
 public:
  // Creates the temporary file. Throws IoError naming it when it cannot be created.
  explicit AtomicFile(std::filesystem::path path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  AtomicFile(AtomicFile&&) = delete;
  AtomicFile& operator=(AtomicFile&&) = delete;

  // Appends `bytes`. Throws IoError naming the file and the byte offset of the failure.
  void write(std::span<const std::byte> bytes);
  // fsync, close, rename to the final name, fsync of the directory. Throws IoError.
  void commit();

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  // xxh3-64 of every byte written so far.
  [[nodiscard]] Digest digest() const noexcept { return digest_.finish(); }

 private:
  std::filesystem::path path_;
  std::filesystem::path temporary_path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
  DigestStream digest_;
  bool committed_ = false;
};

// One AtomicFile holding `bytes`; returns their xxh3-64.
Digest write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes);

// A file's size and the xxh3-64 of its bytes, read in bounded parts. Throws IoError naming it.
struct FileChecksum {
  std::uint64_t size = 0;
  Digest digest = 0;
};
[[nodiscard]] FileChecksum file_checksum(const std::filesystem::path& path);

// A regular file's bytes; IoError naming it when it cannot be read or holds more than
// `max_bytes` (nothing beyond that is read or allocated).
[[nodiscard]] std::vector<std::byte> read_file(const std::filesystem::path& path,
                                               std::uint64_t max_bytes);

// Makes a directory's entries (a rename, a new file, a removal) durable. Throws IoError;
// filesystems that cannot fsync a directory (EINVAL, EROFS) are accepted.
void fsync_directory(const std::filesystem::path& directory);

}  // namespace pulseloco::io
