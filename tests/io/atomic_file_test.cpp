// AtomicFile (io/atomic_file.h): the final name holds only complete files, and the temporary
// file is always a new one: a link or a file left at its name is never written through.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <pulseloco/io/atomic_file.h>
#include "io/test_files.h"

namespace pulseloco::io {
namespace {

namespace fs = std::filesystem;
using test::read_file_bytes;
using test::TempDir;

void write_text(AtomicFile& file, const std::string& text) {
  file.write(std::as_bytes(std::span(text.data(), text.size())));
}

// The temporary name AtomicFile uses for `path` while one is open: "<path>.tmp.<pid>.<n>".
std::uint64_t open_temporary_number(const fs::path& path) {
  const std::string prefix = path.filename().string() + ".tmp." + std::to_string(::getpid()) + ".";
  for (const auto& entry : fs::directory_iterator(path.parent_path())) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) return std::stoull(name.substr(prefix.size()));
  }
  throw std::runtime_error("no temporary file for " + path.string());
}

TEST(AtomicFile, ALinkOrFileAtTheNextTemporaryNameIsNeverWrittenThrough) {
  const TempDir dir;
  const fs::path path = dir.path() / "weights.bin";
  const fs::path victim = dir.path() / "victim";
  std::ofstream(victim) << "keep me";
  std::uint64_t next = 0;
  {
    AtomicFile first(path);
    write_text(first, "first");
    next = open_temporary_number(path) + 1;
    first.commit();
  }
  // Names the next files would take: a link to the victim, then a leftover file.
  const auto temporary = [&](std::uint64_t n) {
    return fs::path(path.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(n));
  };
  fs::create_symlink(victim, temporary(next));
  std::ofstream(temporary(next + 1)) << "left by a crash";
  {
    AtomicFile second(path);
    write_text(second, "second");
    second.commit();
  }
  EXPECT_EQ(read_file_bytes(path), "second");
  EXPECT_EQ(read_file_bytes(victim), "keep me");
  EXPECT_TRUE(fs::is_symlink(fs::symlink_status(temporary(next))));
  EXPECT_EQ(read_file_bytes(temporary(next + 1)), "left by a crash");
}

}  // namespace
}  // namespace pulseloco::io
