#include <pulseloco/io/atomic_file.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/unique_fd.h>
#include <pulseloco/io/input_file.h>

namespace pulseloco::io {
namespace {

constexpr std::size_t kReadChunkBytes = std::size_t{1} << 20;

std::filesystem::path temporary_path_for(const std::filesystem::path& path) {
  static std::atomic<std::uint64_t> counter{0};
  return std::filesystem::path(
      fmt::format("{}.tmp.{}.{}", path.string(), ::getpid(), counter.fetch_add(1)));
}

}  // namespace

void fsync_directory(const std::filesystem::path& directory) {
  const std::string name = directory.empty() ? std::string(".") : directory.string();
  const UniqueFd fd(::open(name.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) {
    throw IoError(
        fmt::format("cannot open directory '{}' to fsync it: {}", name, std::strerror(errno)));
  }
  // Some filesystems do not support fsync on directories; the change itself already happened.
  if (::fsync(fd.get()) != 0 && errno != EINVAL && errno != EROFS) {
    throw IoError(fmt::format("fsync of directory '{}' failed: {}", name, std::strerror(errno)));
  }
}

AtomicFile::AtomicFile(std::filesystem::path path) : path_(std::move(path)) {
  // A new file, never an existing one or a link: in a directory others can write to, a link
  // planted at the temporary name would otherwise receive the bytes. A name left by a crashed
  // process with the same pid takes the next one.
  constexpr int kAttempts = 64;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    temporary_path_ = temporary_path_for(path_);
    fd_ =
        ::open(temporary_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd_ >= 0 || errno != EEXIST) break;
  }
  if (fd_ < 0) {
    throw IoError(
        fmt::format("cannot create '{}': {}", temporary_path_.string(), std::strerror(errno)));
  }
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temporary_path_.c_str());
}

void AtomicFile::write(std::span<const std::byte> bytes) {
  if (fd_ < 0) {
    throw IoError(fmt::format("'{}' is closed: it was committed or failed", path_.string()));
  }
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t written = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (written < 0) {
      if (errno == EINTR) continue;
      throw IoError(
          fmt::format("write to '{}' failed: {}", temporary_path_.string(), std::strerror(errno)),
          {.byte_offset = size_ + done});
    }
    done += static_cast<std::size_t>(written);
  }
  digest_.update(bytes);
  size_ += bytes.size();
}

void AtomicFile::commit() {
  if (fd_ < 0) {
    throw IoError(fmt::format("'{}' is closed: it was committed or failed", path_.string()));
  }
  if (::fsync(fd_) != 0) {
    throw IoError(
        fmt::format("fsync of '{}' failed: {}", temporary_path_.string(), std::strerror(errno)));
  }
  if (::close(std::exchange(fd_, -1)) != 0) {
    throw IoError(
        fmt::format("close of '{}' failed: {}", temporary_path_.string(), std::strerror(errno)));
  }
  if (::rename(temporary_path_.c_str(), path_.c_str()) != 0) {
    throw IoError(fmt::format("cannot rename '{}' to '{}': {}", temporary_path_.string(),
                              path_.string(), std::strerror(errno)));
  }
  committed_ = true;
  fsync_directory(path_.parent_path());
}

Digest write_file_atomically(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  AtomicFile file(path);
  file.write(bytes);
  file.commit();
  return file.digest();
}

namespace {

// Reads a regular file in parts of at most kReadChunkBytes, handing each to `consume`.
template <typename Consume>
void read_chunks(const std::filesystem::path& path, Consume&& consume) {
  const InputFile file(path, "a regular file");
  std::vector<std::byte> buffer(kReadChunkBytes);
  std::uint64_t offset = 0;
  for (;;) {
    const ssize_t got = ::read(file.fd(), buffer.data(), buffer.size());
    if (got < 0) {
      if (errno == EINTR) continue;
      throw IoError(fmt::format("read of '{}' failed: {}", path.string(), std::strerror(errno)),
                    {.byte_offset = offset});
    }
    if (got == 0) return;
    consume(std::span<const std::byte>(buffer.data(), static_cast<std::size_t>(got)));
    offset += static_cast<std::uint64_t>(got);
  }
}

}  // namespace

FileChecksum file_checksum(const std::filesystem::path& path) {
  FileChecksum checksum;
  DigestStream digest;
  read_chunks(path, [&](std::span<const std::byte> chunk) {
    digest.update(chunk);
    checksum.size += chunk.size();
  });
  checksum.digest = digest.finish();
  return checksum;
}

std::vector<std::byte> read_file(const std::filesystem::path& path, std::uint64_t max_bytes) {
  std::vector<std::byte> bytes;
  read_chunks(path, [&](std::span<const std::byte> chunk) {
    if (bytes.size() + chunk.size() > max_bytes) {
      throw IoError(fmt::format("'{}' holds more than {} bytes", path.string(), max_bytes));
    }
    bytes.insert(bytes.end(), chunk.begin(), chunk.end());
  });
  return bytes;
}

}  // namespace pulseloco::io
