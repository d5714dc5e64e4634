// Files that come from outside the process (a window message given to `pulseloco inspect`, the
// safetensors files of a trace or a checkpoint) are opened as an InputFile: with O_NONBLOCK, so
// that a FIFO or a device cannot block the open, then checked with fstat, so that anything but a
// regular file (a directory, a FIFO, a socket, a device) is refused at once, with an error that
// names the path and what it is, before anything is read or allocated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace pulseloco::io {

class InputFile {
 public:
  // Opens `path` for reading. `what` names what the file should be ("a window message file"),
  // for the error when it is something else: InvalidArgument "'PATH' is a directory, not a
  // window message file". IoError when it cannot be opened or examined.
  InputFile(std::filesystem::path path, std::string_view what);
  ~InputFile();
  InputFile(InputFile&& other) noexcept;
  InputFile& operator=(InputFile&&) = delete;
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  [[nodiscard]] int fd() const noexcept { return fd_; }
  // The size fstat reported when the file was opened.
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

  // Fills `destination` from `offset` (read_exactly).
  void read_at(std::uint64_t offset, std::span<std::byte> destination) const;

  // Hands the descriptor over to the caller, who closes it.
  [[nodiscard]] int release() noexcept;

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
};

// Fills `destination` from `offset` of the open file `fd` (named `path` in errors). IoError with
// `tensor` and the byte offset in its context when the read fails or the file ends first (it
// shrank after it was opened).
void read_exactly(int fd, const std::filesystem::path& path, std::uint64_t offset,
                  std::span<std::byte> destination, std::string_view tensor = {});

// What a file of this st_mode is, in words: "a directory", "a FIFO", "a socket", ...
[[nodiscard]] std::string file_type_name(unsigned mode);

}  // namespace pulseloco::io
