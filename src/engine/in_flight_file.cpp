#include <pulseloco/engine/in_flight_file.h>

#include <fmt/format.h>

#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/engine/state_files.h>

namespace pulseloco::engine_detail {
namespace {

constexpr std::string_view kTensor = "in_flight_message";
constexpr std::string_view kWindowKey = "in_flight_window";
constexpr std::string_view kEntriesKey = "in_flight_entries";

}  // namespace

void describe_in_flight(const ReplicatedState& state, std::vector<io::TensorSpec>& specs,
                        io::Metadata& metadata) {
  const auto& message = state.in_flight();
  if (!message) return;
  specs.push_back({std::string(kTensor), io::TensorDType::u8, {message->bytes.size()}});
  metadata[std::string(kWindowKey)] = std::to_string(message->window);
  metadata[std::string(kEntriesKey)] = std::to_string(message->entries);
}

void write_in_flight(io::SafetensorsWriter& writer, const ReplicatedState& state) {
  if (const auto& message = state.in_flight()) writer.write(kTensor, message->bytes);
}

std::optional<OutgoingMessage> read_in_flight(const io::SafetensorsReader& reader,
                                              const io::SafetensorsReader& global_reader,
                                              const ReplicatedState& state, int rank,
                                              std::uint64_t window) {
  const std::filesystem::path& file = reader.path();
  const io::Metadata& metadata = reader.metadata();
  if (!metadata.contains(std::string(kWindowKey)) && !reader.contains(kTensor)) return std::nullopt;
  const auto fail = [&](const std::string& what) -> void {
    throw ProtocolError(fmt::format("{}: the message in flight {}", file.string(), what),
                        {.rank = rank});
  };
  if (!reader.contains(kTensor) || reader.tensor(kTensor).spec.dtype != io::TensorDType::u8 ||
      reader.tensor(kTensor).spec.shape.size() != 1) {
    fail("is not a one-dimensional U8 tensor");
  }
  OutgoingMessage message;
  message.window = state_files::require_u64(metadata, std::string(kWindowKey), file);
  message.entries = state_files::require_u64(metadata, std::string(kEntriesKey), file);
  if (message.window != window) {
    fail(fmt::format("is for window {}; the file's state expects window {}", message.window,
                     window));
  }
  message.bytes.resize(reader.tensor(kTensor).byte_size());
  reader.read(kTensor, message.bytes);
  // The codec's own errors name the byte offset; wrapped so that they name the file too.
  const auto decoding = [&](const auto& step) {
    try {
      return step();
    } catch (const ProtocolError& error) {
      fail(fmt::format("is invalid: {}", error.message()));
      throw;
    }
  };
  const codec::MessageView view =
      decoding([&] { return codec::MessageView::parse(message.bytes); });
  const codec::MessageHeader& header = view.header();
  if (header.window != window || header.sender_rank != static_cast<std::uint32_t>(rank) ||
      header.tensor_numels != state.layout().numels()) {
    fail(fmt::format("names window {} and rank {} or another model", header.window,
                     header.sender_rank));
  }
  const auto& chunks = state.layout().chunks();
  if (view.frame_count() != chunks.size()) fail("does not cover this model's chunks");
  std::uint64_t entries = 0;
  codec::DecodeScratch scratch;
  std::vector<float> context;
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    const codec::FrameInfo& frame = view.frame(c);
    if (frame.tensor != chunks[c].tensor || frame.begin != chunks[c].begin ||
        frame.length != chunks[c].length) {
      fail(fmt::format("frame {} does not match this model's chunk", c));
    }
    context.clear();
    if (frame.encoding == codec::Encoding::context) {
      const std::string key = std::string(state_files::kGlobal) + state.name(frame.tensor);
      if (!global_reader.contains(key) ||
          global_reader.tensor(key).spec.dtype != io::TensorDType::f32 ||
          global_reader.tensor(key).byte_size() < (frame.begin + frame.length) * sizeof(float)) {
        fail(fmt::format("frame {} is context-coded, and {} holds no F32 '{}' to decode it against",
                         c, global_reader.path().string(), key));
      }
      context.resize(frame.length);
      global_reader.read_range(key, frame.begin * sizeof(float),
                               std::as_writable_bytes(std::span(context)));
    }
    std::vector<std::uint32_t> offsets(frame.entries);
    std::vector<float> values(frame.entries);
    entries += decoding([&] { return view.decode_frame(c, offsets, values, scratch, context); });
  }
  if (entries != message.entries) {
    fail(fmt::format("holds {} entries, its metadata says {}", entries, message.entries));
  }
  return message;
}

}  // namespace pulseloco::engine_detail
