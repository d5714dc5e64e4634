// `pulseloco inspect FILE`: the report for valid messages and a non-zero exit that names the
// reason for corrupt, truncated, foreign and missing files. Runs the real CLI binary.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include <pulseloco/codec/message.h>
#include "codec/codec_test_util.h"

namespace pulseloco::codec {
namespace {

using testing::Bytes;

struct CliRun {
  int status = -1;
  std::string output;  // stdout and stderr
};

// Runs the CLI; `shell_prefix` runs first in the same shell (a resource limit, say). `timeout`
// ends a CLI that blocks (on a FIFO, say): the test then fails on its status instead of hanging.
CliRun run_cli(const std::string& arguments, const std::string& shell_prefix = "") {
  const std::string command =
      shell_prefix + "exec timeout 120 " + std::string(PULSELOCO_CLI) + " " + arguments + " 2>&1";
  CliRun run;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  char buffer[4096];
  std::size_t got;
  while ((got = std::fread(buffer, 1, sizeof buffer, pipe)) > 0)
    run.output.append(buffer, got);
  const int status = pclose(pipe);
  run.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

struct MeasuredRun {
  int status = -1;
  std::string output;      // stdout and stderr
  long peak_rss_kib = -1;  // the CLI's largest resident set, as wait4 reports it
};

// Runs the CLI itself (no shell in between) on `arguments` and measures its peak resident memory
// (getrusage's ru_maxrss of that child, from wait4). An alarm ends a CLI that blocks.
MeasuredRun run_cli_measured(const std::vector<std::string>& arguments) {
  MeasuredRun run;
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return run;
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(pipe_fds[1], STDOUT_FILENO);
    ::dup2(pipe_fds[1], STDERR_FILENO);
    ::close(pipe_fds[0]);
    ::close(pipe_fds[1]);
    std::vector<char*> argv{const_cast<char*>(PULSELOCO_CLI)};
    for (const std::string& argument : arguments)
      argv.push_back(const_cast<char*>(argument.c_str()));
    argv.push_back(nullptr);
    ::alarm(120);
    ::execv(PULSELOCO_CLI, argv.data());
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  char buffer[4096];
  ssize_t got;
  while ((got = ::read(pipe_fds[0], buffer, sizeof buffer)) > 0)
    run.output.append(buffer, static_cast<std::size_t>(got));
  ::close(pipe_fds[0]);
  int status = 0;
  struct rusage usage {};
  if (pid > 0 && ::wait4(pid, &status, 0, &usage) == pid) {
    run.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    run.peak_rss_kib = usage.ru_maxrss;
  }
  return run;
}

class InspectCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("pulseloco-inspect-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir_);
    // Two tensors, three frames (one empty), 64-bit indices in the second tensor.
    std::mt19937_64 rng(11);
    header_ = {.window = 77, .sender_rank = 3, .tensor_numels = {5000, std::uint64_t{6} << 30}};
    chunks_.push_back({.tensor = 0,
                       .begin = 0,
                       .length = 5000,
                       .offsets = testing::random_offsets(rng, 5000, 0.05)});
    chunks_.push_back({.tensor = 1, .begin = 0, .length = 1u << 20});
    chunks_.push_back({.tensor = 1,
                       .begin = std::uint64_t{5} << 30,
                       .length = 1u << 20,
                       .offsets = {0, 9, (1u << 20) - 1}});
    for (auto& chunk : chunks_) {
      for (std::size_t i = 0; i < chunk.offsets.size(); ++i) {
        chunk.values.push_back(testing::random_value(rng));
      }
      entries_ += chunk.offsets.size();
    }
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  Bytes message(Encoding encoding) const {
    MessageHeader h = header_;
    h.encoding = encoding;
    Bytes out = encode_header(h, static_cast<std::uint32_t>(chunks_.size()));
    for (const auto& chunk : chunks_) {
      testing::append(out, encode_frame(chunk.entries(), {.encoding = encoding}));
    }
    return out;
  }

  std::string write(const std::string& name, const Bytes& bytes) const {
    const auto path = dir_ / name;
    std::ofstream file(path, std::ios::binary);
    file.write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
    return path.string();
  }

  std::filesystem::path dir_;
  MessageHeader header_;
  std::vector<testing::Chunk> chunks_;
  std::size_t entries_ = 0;
};

TEST_F(InspectCli, ReportsAndVerifiesAValidMessage) {
  for (const Encoding encoding :
       {Encoding::pulse, Encoding::plain_i64_f32, Encoding::plain_i32_f32}) {
    const Bytes bytes = message(encoding);
    const std::string path = write("valid.msg", bytes);
    const CliRun run = run_cli("inspect " + path);
    ASSERT_EQ(run.status, 0) << run.output;
    EXPECT_NE(run.output.find(std::to_string(bytes.size()) + " bytes"), std::string::npos)
        << run.output;
    EXPECT_NE(run.output.find("encoding   " + std::string(encoding_name(encoding))),
              std::string::npos)
        << run.output;
    EXPECT_NE(run.output.find("window     77"), std::string::npos) << run.output;
    EXPECT_NE(run.output.find("sender     rank 3"), std::string::npos) << run.output;
    EXPECT_NE(run.output.find("frames     3"), std::string::npos) << run.output;
    EXPECT_NE(run.output.find("entries    " + std::to_string(entries_)), std::string::npos)
        << run.output;
    EXPECT_NE(run.output.find("5368709120"), std::string::npos) << "64-bit begin: " << run.output;
    EXPECT_NE(run.output.find("verified: all 3 frames decode"), std::string::npos) << run.output;
  }
}

TEST_F(InspectCli, AContextMessageIsCheckedWithoutTheSendersWeights) {
  // One chunk of bf16-rounded weights whose fired values are about a bf16 half-ulp: the frame
  // is context-coded, and inspect (which holds no θ_g) checks it up to its stream directory.
  constexpr std::uint32_t kLength = 20000;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> weight(0.0f, 0.02f);
  std::vector<float> context(kLength);
  for (float& w : context)
    w = std::bit_cast<float>(std::bit_cast<std::uint32_t>(weight(rng)) & 0xFFFF0000u);
  testing::Chunk chunk{.tensor = 0, .begin = 0, .length = kLength};
  for (std::uint32_t i = 0; i < kLength; i += 37) {
    if (context[i] == 0.0f) continue;
    chunk.offsets.push_back(i);
    chunk.values.push_back(
        std::ldexp(1.0f + static_cast<float>(i % 97) / 128.0f, std::ilogb(context[i]) - 8));
  }
  MessageHeader h{.window = 5, .encoding = Encoding::context, .tensor_numels = {kLength}};
  Bytes bytes = encode_header(h, 1);
  FrameEntries entries = chunk.entries();
  entries.context = context;
  testing::append(bytes, encode_frame(entries, {.encoding = Encoding::context}));
  ASSERT_EQ(MessageView::parse(bytes).frame(0).encoding, Encoding::context);
  const CliRun run = run_cli("inspect " + write("context.msg", bytes));
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_NE(run.output.find("format v6"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("encoding   context"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("1 context-coded frames checked up to their stream directory"),
            std::string::npos)
      << run.output;
  const auto json =
      nlohmann::json::parse(run_cli("inspect --json " + write("c.msg", bytes)).output);
  EXPECT_EQ(json["header"]["format_version"].get<int>(), 6);
  EXPECT_EQ(json["context_frames"].get<int>(), 1);
  EXPECT_EQ(json["entries"].get<std::size_t>(), chunk.offsets.size());
}

TEST_F(InspectCli, JsonAgreesWithTheMessage) {
  const Bytes bytes = message(Encoding::pulse);
  const CliRun run = run_cli("inspect --json " + write("valid.msg", bytes));
  ASSERT_EQ(run.status, 0) << run.output;
  const auto json = nlohmann::json::parse(run.output);
  EXPECT_EQ(json["bytes"].get<std::size_t>(), bytes.size());
  EXPECT_EQ(json["entries"].get<std::size_t>(), entries_);
  EXPECT_TRUE(json["valid"].get<bool>());
  EXPECT_EQ(json["header"]["encoding"], "pulse");
  EXPECT_EQ(json["header"]["window"].get<std::uint64_t>(), 77u);
  ASSERT_EQ(json["frames"].size(), 3u);
  ASSERT_EQ(json["tensors"].size(), 2u);
  EXPECT_EQ(json["tensors"][1]["numel"].get<std::uint64_t>(), std::uint64_t{6} << 30);
  std::uint64_t frame_bytes = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(json["frames"][i]["entries"].get<std::size_t>(), chunks_[i].offsets.size());
    EXPECT_EQ(json["frames"][i]["begin"].get<std::uint64_t>(), chunks_[i].begin);
    frame_bytes += json["frames"][i]["bytes"].get<std::uint64_t>();
  }
  EXPECT_EQ(frame_bytes + json["header"]["bytes"].get<std::uint64_t>(), bytes.size());
  EXPECT_DOUBLE_EQ(json["bytes_per_entry"].get<double>(),
                   static_cast<double>(bytes.size()) / static_cast<double>(entries_));
  EXPECT_EQ(json["index_bytes"].get<std::uint64_t>() + json["value_bytes"].get<std::uint64_t>() +
                json["framing_bytes"].get<std::uint64_t>(),
            bytes.size());
}

// --no-frames leaves out the frames table (and the JSON's "frames" array) but still verifies
// every frame.
TEST_F(InspectCli, NoFramesKeepsTheHeaderAndTensorsAndLeavesOutEveryFrame) {
  const Bytes bytes = message(Encoding::pulse);
  const std::string path = write("valid.msg", bytes);
  const CliRun run = run_cli("inspect --no-frames " + path);
  ASSERT_EQ(run.status, 0) << run.output;
  EXPECT_NE(run.output.find(std::to_string(bytes.size()) + " bytes"), std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("frames     3"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("entries    " + std::to_string(entries_)), std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("\ntensors\n"), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("\nframes\n"), std::string::npos) << run.output;
  // Frame 2's begin appears only in its row of the frames table.
  EXPECT_EQ(run.output.find("5368709120"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("verified: all 3 frames decode"), std::string::npos) << run.output;

  const CliRun json_run = run_cli("inspect --json --no-frames " + path);
  ASSERT_EQ(json_run.status, 0) << json_run.output;
  const auto json = nlohmann::json::parse(json_run.output);
  EXPECT_FALSE(json.contains("frames")) << json_run.output;
  EXPECT_EQ(json["header"]["frames"].get<std::uint64_t>(), 3u);
  EXPECT_EQ(json["tensors"].size(), 2u);
  EXPECT_EQ(json["entries"].get<std::size_t>(), entries_);
  EXPECT_TRUE(json["valid"].get<bool>());

  Bytes corrupt = bytes;
  const MessageView view = MessageView::parse(corrupt);
  corrupt[view.frame(2).byte_offset + view.frame(2).byte_size - 12] ^= std::byte{0x10};
  const CliRun corrupt_run = run_cli("inspect --no-frames " + write("corrupt.msg", corrupt));
  EXPECT_EQ(corrupt_run.status, 1) << corrupt_run.output;
  EXPECT_NE(corrupt_run.output.find("1 of 3 frames are invalid"), std::string::npos)
      << corrupt_run.output;
}

TEST_F(InspectCli, ACorruptFrameFailsWithItsReasonAndOffset) {
  Bytes bytes = message(Encoding::pulse);
  const MessageView view = MessageView::parse(bytes);
  const std::size_t at = view.frame(2).byte_offset + view.frame(2).byte_size - 12;
  bytes[at] ^= std::byte{0x10};
  const std::string path = write("corrupt.msg", bytes);
  const CliRun run = run_cli("inspect " + path);
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_NE(run.output.find("1 of 3 frames are invalid"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("frame 2: checksum mismatch"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("byte offset"), std::string::npos) << run.output;
  // The valid frames are still listed as ok.
  EXPECT_NE(run.output.find("  ok"), std::string::npos) << run.output;
  const CliRun json = run_cli("inspect --json " + path);
  EXPECT_EQ(json.status, 1) << json.output;
  EXPECT_NE(json.output.find("\"valid\": false"), std::string::npos) << json.output;
}

TEST_F(InspectCli, TruncatedForeignAndMissingFilesFail) {
  Bytes truncated = message(Encoding::plain_i32_f32);
  truncated.resize(truncated.size() - 3);
  const std::string truncated_path = write("truncated.msg", truncated);
  CliRun run = run_cli("inspect " + truncated_path);
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_NE(run.output.find("protocol violation: " + truncated_path + ": truncated"),
            std::string::npos)
      << run.output;

  const std::string text = "not a message at all, just some text in a file\n";
  run = run_cli(
      "inspect " +
      write("foreign.txt", Bytes(reinterpret_cast<const std::byte*>(text.data()),
                                 reinterpret_cast<const std::byte*>(text.data()) + text.size())));
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_NE(run.output.find("bad magic"), std::string::npos) << run.output;

  run = run_cli("inspect " + (dir_ / "missing.msg").string());
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_NE(run.output.find("cannot open"), std::string::npos) << run.output;

  run = run_cli("inspect");
  EXPECT_NE(run.status, 0) << run.output;
}

// Address space for the CLI in the tests below: room for the program and a few MiB of
// decoding, far less than the gigabytes the crafted file announces.
const std::string kAddressSpaceLimit = "ulimit -v 1048576; ";  // 1 GiB

TEST_F(InspectCli, AFileThatAnnouncesHugeFramesIsRefusedWithoutAllocatingThem) {
  // A few hundred bytes that announce a frame of 2^28 entries; its streams claim to decompress
  // to 2^28 bytes each. Decoding it would take gigabytes: inspect refuses it from its sizes.
  constexpr std::uint32_t n = 1u << 28;
  testing::RawFrame frame{.encoding = 0, .zstd_streams = 0x1F, .length = n, .entries = n};
  testing::put_leb128(frame.payload, n);  // the raw varint index stream: n bytes
  const Bytes stream = testing::rle_zstd_frame(0, 1, n);
  for (int s = 0; s < 5; ++s)
    testing::put_leb128(frame.payload, stream.size());
  for (int s = 0; s < 5; ++s)
    testing::append(frame.payload, stream);
  MessageHeader header{.tensor_numels = {n}};
  Bytes bytes = encode_header(header, 1);
  testing::append(bytes, testing::make_frame(frame));
  ASSERT_LT(bytes.size(), 512u);
  const std::string path = write("huge.msg", bytes);
  const CliRun run = run_cli("inspect " + path, kAddressSpaceLimit);
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_NE(run.output.find("frame 0: 268435456 entries in a frame of"), std::string::npos)
      << run.output;
  EXPECT_NE(run.output.find("per frame byte"), std::string::npos) << run.output;
  EXPECT_EQ(run.output.find("bad_alloc"), std::string::npos) << run.output;

  // A real message of the same order of entries per byte as training produces still verifies
  // under the same limit, frames of more than 2^16 entries included.
  std::mt19937_64 rng(5);
  testing::Chunk chunk{.tensor = 0, .begin = 0, .length = 1u << 22};
  chunk.offsets = testing::random_offsets(rng, chunk.length, 0.05);
  for (std::size_t i = 0; i < chunk.offsets.size(); ++i)
    chunk.values.push_back(testing::random_value(rng));
  ASSERT_GT(chunk.offsets.size(), std::size_t{1} << 16);
  MessageHeader real_header{.tensor_numels = {chunk.length}};
  Bytes real = encode_header(real_header, 1);
  testing::append(real, encode_frame(chunk.entries(), {}));
  const CliRun verified = run_cli("inspect " + write("real.msg", real), kAddressSpaceLimit);
  EXPECT_EQ(verified.status, 0) << verified.output;
  EXPECT_NE(verified.output.find("verified: all 1 frames decode"), std::string::npos)
      << verified.output;
}

// A sparse file of 3 GiB (its size costs no disk): `prefix` at its start, zeros after.
std::string write_sparse(const std::filesystem::path& path, const Bytes& prefix) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  EXPECT_GE(fd, 0) << path;
  EXPECT_EQ(::write(fd, prefix.data(), prefix.size()), static_cast<ssize_t>(prefix.size()));
  EXPECT_EQ(::ftruncate(fd, off_t{3} << 30), 0);
  ::close(fd);
  return path.string();
}

// Far below the 3 GiB of the files: what reading them whole would cost.
constexpr long kPeakRssLimitKib = 64 * 1024;

// A hostile file of 3 GiB costs inspect a bounded amount of memory, whatever it announces: its
// header is checked before anything else is read, a frame beyond the file is refused from its
// prefix, a frame is hashed in pieces before it is held, and nothing per frame is kept. Each
// error names the file.
TEST_F(InspectCli, ASparseFileOfThreeGibibytesFailsInBoundedMemory) {
  constexpr std::uint64_t size = std::uint64_t{3} << 30;
  const MessageHeader header{.tensor_numels = {std::uint64_t{1} << 31}};
  const Bytes valid_header = encode_header(header, 1);
  // A frame of `payload_bytes` (its prefix only; zeros follow).
  const auto with_frame = [&](std::uint64_t payload_bytes) {
    testing::RawFrame frame{.encoding = 0, .length = 1u << 31, .entries = 1000};
    frame.override_payload_bytes = true;
    frame.payload_bytes = payload_bytes;
    Bytes bytes = valid_header;
    Bytes prefix = testing::make_frame(frame);
    prefix.resize(kFramePrefixBytes);
    testing::append(bytes, prefix);
    return bytes;
  };
  // Where the message ends when its one frame has this payload; the rest of the file follows it.
  const auto end_with = [&](std::uint64_t payload_bytes) {
    return valid_header.size() + kFramePrefixBytes + payload_bytes + kChecksumBytes;
  };
  constexpr std::uint64_t garbage_payload = std::uint64_t{512} << 20;
  struct Case {
    std::string name;
    Bytes prefix;
    std::vector<std::string> options;
    std::string says;  // after "FILE: "
  };
  const std::string not_a_message_text = "NOPE, not a message";
  const std::vector<Case> cases{
      {"foreign.msg",
       Bytes(reinterpret_cast<const std::byte*>(not_a_message_text.data()),
             reinterpret_cast<const std::byte*>(not_a_message_text.data()) +
                 not_a_message_text.size()),
       {},
       "bad magic: not a pulseloco message (byte offset 0)"},
      // The zeros after the header read as one empty frame (whose checksum does not match), then
      // gigabytes that no frame announced.
      {"zeros.msg",
       valid_header,
       {"--json"},
       std::to_string(size - end_with(0)) + " bytes after the last of 1 frames (byte offset " +
           std::to_string(end_with(0)) + ")"},
      {"beyond.msg", with_frame(size), {}, "truncated: frame 0 of 1 needs bytes up to "},
      // A frame of 512 MiB of zeros: hashed in pieces (it does not match), never held.
      {"garbage.msg",
       with_frame(garbage_payload),
       {},
       std::to_string(size - end_with(garbage_payload)) +
           " bytes after the last of 1 frames (byte offset " +
           std::to_string(end_with(garbage_payload)) + ")"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = write_sparse(dir_ / c.name, c.prefix);
    std::vector<std::string> arguments{"inspect"};
    arguments.insert(arguments.end(), c.options.begin(), c.options.end());
    arguments.push_back(path);
    const MeasuredRun run = run_cli_measured(arguments);
    EXPECT_EQ(run.status, 1) << run.output;
    EXPECT_NE(run.output.find("pulseloco: protocol violation: " + path + ": " + c.says),
              std::string::npos)
        << run.output;
    EXPECT_GT(run.peak_rss_kib, 0);
    EXPECT_LT(run.peak_rss_kib, kPeakRssLimitKib) << "peak RSS of inspect on a 3 GiB file";
    std::filesystem::remove(path);
  }
}

TEST_F(InspectCli, ADirectoryOrAFifoIsNamedAndRefusedAtOnce) {
  const auto fifo = dir_ / "message.fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  CliRun run = run_cli("inspect " + dir_.string());
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_NE(run.output.find("'" + dir_.string() + "' is a directory, not a window message file"),
            std::string::npos)
      << run.output;
  run = run_cli("inspect " + fifo.string());
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_NE(run.output.find("'" + fifo.string() + "' is a FIFO, not a window message file"),
            std::string::npos)
      << run.output;
}

// replay reads safetensors files from a trace directory: a FIFO where a trace file or the
// directory should be is named and refused at once too.
TEST_F(InspectCli, ReplayNamesAFifoInATraceAndRefusesIt) {
  const auto window_dir = dir_ / "trace" / "window-000001";
  std::filesystem::create_directories(window_dir);
  const auto fifo = window_dir / "rank-00000.out.safetensors";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const CliRun run = run_cli("replay " + (dir_ / "trace").string() + " --window 1");
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_NE(run.output.find("'" + fifo.string() + "' is a FIFO, not a safetensors file"),
            std::string::npos)
      << run.output;
  // A FIFO given as the trace directory.
  const CliRun not_a_dir = run_cli("replay " + fifo.string());
  EXPECT_NE(not_a_dir.status, 0) << not_a_dir.output;
  EXPECT_NE(not_a_dir.output.find("'" + fifo.string() + "' is a FIFO, not a trace directory"),
            std::string::npos)
      << not_a_dir.output;
}

}  // namespace
}  // namespace pulseloco::codec
