// `pulseloco inspect FILE [--json] [--no-frames]`: a window message's header, tensors, frames,
// sizes and bytes per entry; every frame is decoded to verify it. Exits non-zero, naming the
// file, the reason and the byte offset, when the file is not a valid message. The file is read
// frame by frame, never whole (codec/message_reader.h), so its size does not decide the memory.
#include <fmt/format.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/cli/commands.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/codec/message_reader.h>
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

struct TensorReport {
  std::uint64_t frames = 0;
  std::uint64_t covered = 0;  // elements of its chunks
  std::uint64_t entries = 0;
  std::uint64_t bytes = 0;
};

// What the first pass learns: the sums, per tensor and in all, and the first invalid frame.
struct Summary {
  std::vector<TensorReport> tensors;
  std::uint64_t frames = 0;
  std::uint64_t entries = 0;
  std::uint64_t index_bytes = 0;
  std::uint64_t value_bytes = 0;
  std::size_t invalid = 0;
  // Context frames: checked up to their stream directory (their values need θ_g).
  std::uint64_t context_frames = 0;
  std::optional<ProtocolError> first_error;
};

// Reads every frame of `reader`'s message, decoding each to verify it, and calls
// on_frame(index, info, error) for each, `error` null when the frame decodes. A bad frame is
// reported and the next still read; a broken structure (a prefix, the frames' order, what
// follows the last frame) throws.
void for_each_frame(codec::MessageReader& reader,
                    const std::function<void(std::size_t, const codec::FrameInfo&,
                                             const ProtocolError*)>& on_frame) {
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
  codec::DecodeScratch scratch;
  for (std::size_t i = 0;; ++i) {
    const std::optional<codec::FrameInfo> announced = reader.next_frame();
    if (!announced) return;
    std::optional<codec::FrameInfo> decoded;
    std::optional<ProtocolError> error;
    try {
      decoded = reader.decode_frame(offsets, values, scratch);
    } catch (const ProtocolError& e) {
      error = e;
    }
    on_frame(i, decoded ? *decoded : *announced, error ? &*error : nullptr);
  }
}

Summary summarise(codec::MessageReader& reader) {
  Summary summary;
  summary.tensors.resize(reader.header().tensor_numels.size());
  for_each_frame(reader,
                 [&](std::size_t, const codec::FrameInfo& info, const ProtocolError* error) {
                   if (error != nullptr && summary.invalid++ == 0) summary.first_error = *error;
                   TensorReport& tensor = summary.tensors[info.tensor];
                   ++tensor.frames;
                   tensor.covered += info.length;
                   tensor.entries += info.entries;
                   tensor.bytes += info.byte_size;
                   ++summary.frames;
                   if (info.encoding == codec::Encoding::context) ++summary.context_frames;
                   summary.entries += info.entries;
                   summary.index_bytes += info.index_bytes;
                   summary.value_bytes += info.value_bytes;
                 });
  return summary;
}

nlohmann::json frame_json(std::size_t i, const codec::FrameInfo& f, const ProtocolError* error) {
  nlohmann::json frame = {{"frame", i},
                          {"tensor", f.tensor},
                          {"begin", f.begin},
                          {"length", f.length},
                          {"entries", f.entries},
                          {"byte_offset", f.byte_offset},
                          {"bytes", f.byte_size},
                          {"index_bytes", f.index_bytes},
                          {"value_bytes", f.value_bytes},
                          {"valid", error == nullptr}};
  if (f.encoding == codec::Encoding::pulse && f.entries > 0) {
    frame["index_coding"] = std::string(codec::index_coding_name(f.index_coding));
  }
  if (error != nullptr) frame["error"] = error->what();
  return frame;
}

void print_frame_row(std::size_t i, const codec::FrameInfo& f, const ProtocolError* error) {
  const std::string coding = f.encoding != codec::Encoding::pulse || f.entries == 0
                                 ? "-"
                                 : std::string(codec::index_coding_name(f.index_coding));
  fmt::print("  {:>6} {:>6} {:>14} {:>11} {:>9} {:>10} {:>10} {:>8.3f}  {}\n", i, f.tensor, f.begin,
             f.length, f.entries, f.byte_size, coding, per_entry(f.byte_size, f.entries),
             error != nullptr ? std::string(error->what()) : std::string("ok"));
}

// Prints the report; returns the summary, whose first error (when a frame does not decode) the
// caller throws after the report.
Summary report(const InspectOptions& options, const io::InputFile& file) {
  // First pass: verify every frame and sum up. The second (when frames are listed) reads the
  // frames again and prints each as it is read: nothing per frame is held.
  // The file's message, read frame by frame (codec/message_reader.h): the header is checked
  // before anything else is read, and no frame is held whole before its checksum matched.
  codec::MessageReader reader(
      [&file](std::uint64_t offset, std::span<std::byte> destination) {
        file.read_at(offset, destination);
      },
      file.size(), codec::DecodeLimits::for_file());
  const Summary summary = summarise(reader);
  reader.rewind();
  const codec::MessageHeader& header = reader.header();
  const std::uint64_t bytes = file.size();
  const std::uint64_t header_bytes = reader.header_bytes();
  const std::uint64_t framing_bytes = bytes - summary.index_bytes - summary.value_bytes;

  if (options.json) {
    nlohmann::json out;
    out["file"] = options.path;
    out["bytes"] = bytes;
    out["header"] = {{"format_version", codec::format_version_of(header.encoding)},
                     {"encoding", std::string(codec::encoding_name(header.encoding))},
                     {"window", header.window},
                     {"sender_rank", header.sender_rank},
                     {"tensors", header.tensor_numels.size()},
                     {"frames", summary.frames},
                     {"bytes", header_bytes}};
    out["entries"] = summary.entries;
    out["context_frames"] = summary.context_frames;
    out["index_bytes"] = summary.index_bytes;
    out["value_bytes"] = summary.value_bytes;
    out["framing_bytes"] = framing_bytes;
    out["bytes_per_entry"] = per_entry(bytes, summary.entries);
    out["tensors"] = nlohmann::json::array();
    for (std::size_t t = 0; t < summary.tensors.size(); ++t) {
      const TensorReport& r = summary.tensors[t];
      out["tensors"].push_back({{"tensor", t},
                                {"numel", header.tensor_numels[t]},
                                {"frames", r.frames},
                                {"covered", r.covered},
                                {"entries", r.entries},
                                {"bytes", r.bytes}});
    }
    out["valid"] = summary.invalid == 0;
    if (summary.first_error) out["error"] = summary.first_error->what();
    std::string text = out.dump(2);
    if (!options.frames) {
      fmt::print("{}\n", text);
    } else {
      // The object's last member is "frames", written frame by frame as the second pass reads
      // them (one compact object per line).
      text.resize(text.size() - 2);  // "\n}"
      fmt::print("{},\n  \"frames\": [", text);
      for_each_frame(reader,
                     [](std::size_t i, const codec::FrameInfo& f, const ProtocolError* error) {
                       fmt::print("{}\n    {}", i == 0 ? "" : ",", frame_json(i, f, error).dump());
                     });
      fmt::print("{}]\n}}\n", summary.frames == 0 ? "" : "\n  ");
    }
  } else {
    fmt::print("{}: {} bytes, pulseloco message format v{}\n", options.path, bytes,
               codec::format_version_of(header.encoding));
    fmt::print("  encoding   {}\n", codec::encoding_name(header.encoding));
    fmt::print("  window     {}\n", header.window);
    fmt::print("  sender     rank {}\n", header.sender_rank);
    fmt::print("  tensors    {}\n", header.tensor_numels.size());
    fmt::print("  frames     {}\n", summary.frames);
    fmt::print("  entries    {}\n", summary.entries);
    fmt::print(
        "  bytes      header {}, indices {} ({:.3f} B/entry), values {} ({:.3f} B/entry), "
        "framing {} ({:.3f} B/entry); total {:.3f} B/entry\n",
        header_bytes, summary.index_bytes, per_entry(summary.index_bytes, summary.entries),
        summary.value_bytes, per_entry(summary.value_bytes, summary.entries), framing_bytes,
        per_entry(framing_bytes, summary.entries), per_entry(bytes, summary.entries));
    fmt::print("\ntensors\n  {:>6} {:>14} {:>7} {:>12} {:>9} {:>12} {:>8}\n", "tensor", "numel",
               "frames", "entries", "density", "bytes", "B/entry");
    for (std::size_t t = 0; t < summary.tensors.size(); ++t) {
      const TensorReport& r = summary.tensors[t];
      const double density =
          r.covered == 0 ? 0.0
                         : 100.0 * static_cast<double>(r.entries) / static_cast<double>(r.covered);
      fmt::print("  {:>6} {:>14} {:>7} {:>12} {:>8.3f}% {:>12} {:>8.3f}\n", t,
                 header.tensor_numels[t], r.frames, r.entries, density, r.bytes,
                 per_entry(r.bytes, r.entries));
    }
    if (options.frames) {
      fmt::print("\nframes\n  {:>6} {:>6} {:>14} {:>11} {:>9} {:>10} {:>10} {:>8}  {}\n", "frame",
                 "tensor", "begin", "length", "entries", "bytes", "coding", "B/entry", "status");
      for_each_frame(reader, print_frame_row);
    }
    if (summary.invalid == 0) {
      fmt::print("\nverified: all {} frames decode ({} entries)\n", summary.frames,
                 summary.entries);
      if (summary.context_frames > 0) {
        fmt::print(
            "({} context-coded frames checked up to their stream directory: their values "
            "decode only against the sender's θ_g)\n",
            summary.context_frames);
      }
    }
  }
  return summary;
}

void inspect(const InspectOptions& options) {
  // A directory, FIFO or device is refused before anything is read.
  const io::InputFile file(options.path, "a window message file");
  std::optional<Summary> summary;
  try {
    summary = report(options, file);
  } catch (const ProtocolError& error) {
    // A broken structure: the reader names the reason and the byte offset, this the file.
    throw ProtocolError(fmt::format("{}: {}", options.path, error.message()), error.context());
  }
  if (summary->first_error) {
    throw ProtocolError(
        fmt::format("{}: {} of {} frames are invalid; the first: {}", options.path,
                    summary->invalid, summary->frames, summary->first_error->message()),
        summary->first_error->context());
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
