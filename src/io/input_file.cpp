#include <pulseloco/io/input_file.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include <pulseloco/base/errors.h>

namespace pulseloco::io {

std::string file_type_name(unsigned mode) {
  switch (mode & S_IFMT) {
    case S_IFREG:
      return "a regular file";
    case S_IFDIR:
      return "a directory";
    case S_IFIFO:
      return "a FIFO";
    case S_IFSOCK:
      return "a socket";
    case S_IFCHR:
      return "a character device";
    case S_IFBLK:
      return "a block device";
    case S_IFLNK:
      return "a symbolic link";
    default:
      return "not a regular file";
  }
}

void read_exactly(int fd, const std::filesystem::path& path, std::uint64_t offset,
                  std::span<std::byte> destination, std::string_view tensor) {
  std::size_t done = 0;
  while (done < destination.size()) {
    const ssize_t got = ::pread(fd, destination.data() + done, destination.size() - done,
                                static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      throw IoError(fmt::format("read of '{}' failed: {}", path.string(), std::strerror(error)),
                    {.tensor = std::string(tensor), .byte_offset = offset + done});
    }
    if (got == 0) {
      throw IoError(
          fmt::format("'{}' ended early (was it truncated after it was opened?)", path.string()),
          {.tensor = std::string(tensor), .byte_offset = offset + done});
    }
    done += static_cast<std::size_t>(got);
  }
}

InputFile::InputFile(std::filesystem::path path, std::string_view what) : path_(std::move(path)) {
  // O_NONBLOCK: opening a FIFO without a writer (or some devices) would otherwise wait.
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) {
    const int error = errno;
    throw IoError(fmt::format("cannot open '{}': {}", path_.string(), std::strerror(error)));
  }
  struct stat status {};
  if (::fstat(fd_, &status) != 0) {
    const int error = errno;
    ::close(fd_);
    throw IoError(fmt::format("cannot examine '{}': {}", path_.string(), std::strerror(error)));
  }
  if (!S_ISREG(status.st_mode)) {
    ::close(fd_);
    throw InvalidArgument(
        fmt::format("'{}' is {}, not {}", path_.string(), file_type_name(status.st_mode), what));
  }
  size_ = static_cast<std::uint64_t>(status.st_size);
  // Reads of a regular file never block; clear the flag so that the descriptor behaves as usual.
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) (void)::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

InputFile::InputFile(InputFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), size_(other.size_) {}

int InputFile::release() noexcept {
  return std::exchange(fd_, -1);
}

void InputFile::read_at(std::uint64_t offset, std::span<std::byte> destination) const {
  read_exactly(fd_, path_, offset, destination);
}

}  // namespace pulseloco::io
