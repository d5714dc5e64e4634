// `pulseloco inspect FILE [--json] [--no-frames]`: a window message's header, tensors, frames,
// sizes and bytes per entry; every frame is decoded to verify it. Exits non-zero, naming the
// reason and the byte offset, when the file is not a valid message.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/cli/commands.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/io/input_file.h>

namespace pulseloco::cli {
namespace {

struct InspectOptions {
  std::string path;
  bool json = false;
  bool frames = true;
};

double per_entry(std::uint64_t bytes, std::uint64_t entries) {
  return entries == 0 ? 0.0 : static_cast<double>(bytes) / static_cast<double>(entries);
}

struct FrameReport {
  codec::FrameInfo info;
  std::optional<std::string> error;
};

struct TensorReport {
  std::uint64_t numel = 0;
  std::uint64_t frames = 0;
  std::uint64_t covered = 0;  // elements of its chunks
  std::uint64_t entries = 0;
  std::uint64_t bytes = 0;
};

void inspect(const InspectOptions& options) {
  // A directory, FIFO or device is refused before anything is read; a regular file of n bytes
  // is read whole, and the limits for a message without a model bound what decoding its
  // frames allocates by a multiple of n (docs/wire-format.md, "Decoding limits").
  const std::vector<std::byte> bytes =
      io::InputFile(options.path, "a window message file").read_all();
  // Structural errors (header, frame table) make the whole file unreadable: they throw.
  const codec::MessageView view = codec::MessageView::parse(bytes, codec::DecodeLimits::for_file());
  const codec::MessageHeader& header = view.header();

  // Verify every frame by decoding it; a bad frame is reported and the others still checked.
  std::uint64_t largest = 0;
  for (std::size_t i = 0; i < view.frame_count(); ++i) {
    largest = std::max(largest, view.frame(i).entries);
  }
  std::vector<std::uint32_t> offsets(largest);
  std::vector<float> values(largest);
  codec::DecodeScratch scratch;
  std::vector<FrameReport> frames;
  std::vector<TensorReport> tensors(header.tensor_numels.size());
  for (std::size_t t = 0; t < tensors.size(); ++t)
    tensors[t].numel = header.tensor_numels[t];
  std::uint64_t entries = 0;
  std::uint64_t index_bytes = 0;
  std::uint64_t value_bytes = 0;
  std::size_t invalid = 0;
  std::optional<ProtocolError> first_error;
  for (std::size_t i = 0; i < view.frame_count(); ++i) {
    FrameReport report{.info = view.frame(i)};
    try {
      (void)view.decode_frame(i, offsets, values, scratch);
    } catch (const ProtocolError& error) {
      report.error = error.what();
      if (invalid++ == 0) first_error = error;
    }
    const codec::FrameInfo& info = report.info;
    TensorReport& tensor = tensors[info.tensor];
    ++tensor.frames;
    tensor.covered += info.length;
    tensor.entries += info.entries;
    tensor.bytes += info.byte_size;
    entries += info.entries;
    index_bytes += info.index_bytes;
    value_bytes += info.value_bytes;
    frames.push_back(std::move(report));
  }
  const std::uint64_t header_bytes =
      view.frame_count() == 0 ? bytes.size() : view.frame(0).byte_offset;
  const std::uint64_t framing_bytes = bytes.size() - index_bytes - value_bytes;

  if (options.json) {
    nlohmann::json out;
    out["file"] = options.path;
    out["bytes"] = bytes.size();
    out["header"] = {{"format_version", codec::kFormatVersion},
                     {"encoding", std::string(codec::encoding_name(header.encoding))},
                     {"window", header.window},
                     {"sender_rank", header.sender_rank},
                     {"tensors", header.tensor_numels.size()},
                     {"frames", view.frame_count()},
                     {"bytes", header_bytes}};
    out["entries"] = entries;
    out["index_bytes"] = index_bytes;
    out["value_bytes"] = value_bytes;
    out["framing_bytes"] = framing_bytes;
    out["bytes_per_entry"] = per_entry(bytes.size(), entries);
    out["tensors"] = nlohmann::json::array();
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const TensorReport& r = tensors[t];
      out["tensors"].push_back({{"tensor", t},
                                {"numel", r.numel},
                                {"frames", r.frames},
                                {"covered", r.covered},
                                {"entries", r.entries},
                                {"bytes", r.bytes}});
    }
    if (options.frames) {
      out["frames"] = nlohmann::json::array();
      for (std::size_t i = 0; i < frames.size(); ++i) {
        const codec::FrameInfo& f = frames[i].info;
        nlohmann::json frame = {{"frame", i},
                                {"tensor", f.tensor},
                                {"begin", f.begin},
                                {"length", f.length},
                                {"entries", f.entries},
                                {"byte_offset", f.byte_offset},
                                {"bytes", f.byte_size},
                                {"index_bytes", f.index_bytes},
                                {"value_bytes", f.value_bytes},
                                {"valid", !frames[i].error.has_value()}};
        if (f.encoding == codec::Encoding::pulse && f.entries > 0) {
          frame["index_coding"] = std::string(codec::index_coding_name(f.index_coding));
        }
        if (frames[i].error) frame["error"] = *frames[i].error;
        out["frames"].push_back(std::move(frame));
      }
    }
    out["valid"] = invalid == 0;
    if (first_error) out["error"] = first_error->what();
    std::cout << out.dump(2) << '\n';
  } else {
    fmt::print("{}: {} bytes, pulseloco message format v{}\n", options.path, bytes.size(),
               codec::kFormatVersion);
    fmt::print("  encoding   {}\n", codec::encoding_name(header.encoding));
    fmt::print("  window     {}\n", header.window);
    fmt::print("  sender     rank {}\n", header.sender_rank);
    fmt::print("  tensors    {}\n", header.tensor_numels.size());
    fmt::print("  frames     {}\n", view.frame_count());
    fmt::print("  entries    {}\n", entries);
    fmt::print(
        "  bytes      header {}, indices {} ({:.3f} B/entry), values {} ({:.3f} B/entry), "
        "framing {} ({:.3f} B/entry); total {:.3f} B/entry\n",
        header_bytes, index_bytes, per_entry(index_bytes, entries), value_bytes,
        per_entry(value_bytes, entries), framing_bytes, per_entry(framing_bytes, entries),
        per_entry(bytes.size(), entries));
    fmt::print("\ntensors\n  {:>6} {:>14} {:>7} {:>12} {:>9} {:>12} {:>8}\n", "tensor", "numel",
               "frames", "entries", "density", "bytes", "B/entry");
    for (std::size_t t = 0; t < tensors.size(); ++t) {
      const TensorReport& r = tensors[t];
      const double density =
          r.covered == 0 ? 0.0
                         : 100.0 * static_cast<double>(r.entries) / static_cast<double>(r.covered);
      fmt::print("  {:>6} {:>14} {:>7} {:>12} {:>8.3f}% {:>12} {:>8.3f}\n", t, r.numel, r.frames,
                 r.entries, density, r.bytes, per_entry(r.bytes, r.entries));
    }
    if (options.frames) {
      fmt::print("\nframes\n  {:>6} {:>6} {:>14} {:>11} {:>9} {:>10} {:>10} {:>8}  {}\n", "frame",
                 "tensor", "begin", "length", "entries", "bytes", "coding", "B/entry", "status");
      for (std::size_t i = 0; i < frames.size(); ++i) {
        const codec::FrameInfo& f = frames[i].info;
        const std::string coding = f.encoding != codec::Encoding::pulse || f.entries == 0
                                       ? "-"
                                       : std::string(codec::index_coding_name(f.index_coding));
        fmt::print("  {:>6} {:>6} {:>14} {:>11} {:>9} {:>10} {:>10} {:>8.3f}  {}\n", i, f.tensor,
                   f.begin, f.length, f.entries, f.byte_size, coding,
                   per_entry(f.byte_size, f.entries),
                   frames[i].error ? *frames[i].error : std::string("ok"));
      }
    }
    if (invalid == 0) {
      fmt::print("\nverified: all {} frames decode ({} entries)\n", frames.size(), entries);
    }
  }
  if (first_error) {
    throw ProtocolError(fmt::format("{}: {} of {} frames are invalid; the first: {}", options.path,
                                    invalid, frames.size(), first_error->message()),
                        first_error->context());
  }
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  auto options = std::make_shared<InspectOptions>();
  auto* command = app.add_subcommand(
      "inspect", "Show a window message's header, tensors and frames, and verify every frame");
  command
      ->add_option("FILE", options->path,
                   "A window message file (docs/operations.md, \"Inspecting a window message\")")
      ->required();
  command->add_flag("--json", options->json, "Print machine-readable JSON");
  command->add_flag("--frames,!--no-frames", options->frames,
                    "List every frame (default) or only the header and tensors");
  command->callback([options] { inspect(*options); });
}

}  // namespace pulseloco::cli
