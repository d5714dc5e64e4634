#include <pulseloco/codec/message.h>

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/codec/context_coding.h>
#include <pulseloco/codec/context_index.h>
#include <pulseloco/codec/index_coding.h>
#include <pulseloco/codec/message_parse.h>
#include <pulseloco/codec/value_planes.h>
#include <pulseloco/codec/wire.h>
#include <pulseloco/codec/zstd_frames.h>

namespace pulseloco::codec {

using detail::frame_text;
using wire::fail;

std::string detail::frame_text(std::size_t i) {
  return "frame " + std::to_string(i);
}

namespace {

// Where the streams of a validated pulse frame are (docs/wire-format.md, "pulse payload").
// Stream 0 holds the index coding's bytes, stream 1 + k value byte plane k.
struct PulseLayout {
  std::uint64_t index_raw_bytes = 0;
  std::uint64_t directory_bytes = 0;
  std::array<bool, 4> sparse{};            // plane k stored as bitmap + non-zero bytes
  std::array<std::uint64_t, 4> nonzero{};  // non-zero bytes of a sparse plane
  std::array<std::uint64_t, wire::kPulseStreams> decoded{};  // bytes before zstd
  std::array<std::span<const std::byte>, wire::kPulseStreams> stored{};
  std::array<std::uint64_t, wire::kPulseStreams> offset{};  // in the message
  std::array<bool, wire::kPulseStreams> compressed{};
};

// Parses and checks the stream directory of a pulse frame with entries >= 1.
PulseLayout parse_pulse_layout(std::span<const std::byte> payload, std::uint64_t payload_offset,
                               const FrameInfo& info, std::uint8_t zstd_streams,
                               std::uint8_t sparse_planes, std::size_t frame_index) {
  const std::string where = frame_text(frame_index);
  wire::Reader reader(payload, payload_offset);
  PulseLayout layout;
  const std::uint64_t raw_at = reader.offset();
  layout.index_raw_bytes = reader.varint(where + " index stream size");
  const detail::SizeRange range =
      detail::index_raw_size_range(info.index_coding, info.entries, info.length);
  if (layout.index_raw_bytes < range.min || layout.index_raw_bytes > range.max) {
    fail(where + ": " + std::string(index_coding_name(info.index_coding)) + " index stream of " +
             std::to_string(info.entries) + " entries cannot be " +
             std::to_string(layout.index_raw_bytes) + " bytes (allowed " +
             std::to_string(range.min) + ".." + std::to_string(range.max) + ")",
         raw_at);
  }
  layout.decoded[wire::kIndexStream] = layout.index_raw_bytes;
  for (int k = 0; k < 4; ++k) {
    layout.sparse[k] = ((sparse_planes >> k) & 1u) != 0;
    layout.decoded[1 + k] = info.entries;
    if (!layout.sparse[k]) continue;
    const std::uint64_t count_at = reader.offset();
    layout.nonzero[k] = reader.varint(where + " plane " + std::to_string(k) + " non-zero count");
    if (layout.nonzero[k] > info.entries) {
      fail(where + ": sparse plane " + std::to_string(k) + " claims " +
               std::to_string(layout.nonzero[k]) + " non-zero bytes of " +
               std::to_string(info.entries),
           count_at);
    }
    layout.decoded[1 + k] = detail::sparse_plane_bytes(info.entries, layout.nonzero[k]);
  }
  std::array<std::uint64_t, wire::kPulseStreams> stored_size{};
  std::array<std::uint64_t, wire::kPulseStreams> size_at{};
  for (int s = 0; s < wire::kPulseStreams; ++s) {
    size_at[s] = reader.offset();
    stored_size[s] = reader.varint(where + " stream " + std::to_string(s) + " size");
  }
  layout.directory_bytes = reader.offset() - payload_offset;
  for (int s = 0; s < wire::kPulseStreams; ++s) {
    layout.compressed[s] = ((zstd_streams >> s) & 1u) != 0;
    if (!layout.compressed[s] && stored_size[s] != layout.decoded[s]) {
      fail(where + ": uncompressed stream " + std::to_string(s) + " stores " +
               std::to_string(stored_size[s]) + " bytes, it decodes to " +
               std::to_string(layout.decoded[s]),
           size_at[s]);
    }
    if (layout.compressed[s] && (stored_size[s] == 0 || layout.decoded[s] == 0)) {
      fail(where + ": compressed stream " + std::to_string(s) + " is empty", size_at[s]);
    }
    layout.offset[s] = reader.offset();
    layout.stored[s] = reader.take(stored_size[s], where + " stream " + std::to_string(s));
  }
  if (reader.remaining() != 0) {
    fail(where + ": " + std::to_string(reader.remaining()) + " payload bytes after the streams",
         reader.offset());
  }
  return layout;
}

}  // namespace

detail::FrameParse detail::parse_frame(std::span<const std::byte> available,
                                       std::uint64_t frame_offset, const MessageHeader& header,
                                       const DecodeLimits& limits, std::size_t frame_index) {
  const std::string where = frame_text(frame_index);
  FrameParse result;
  FrameInfo& info = result.info;
  info.byte_offset = frame_offset;
  if (available.size() < kFramePrefixBytes) {
    result.needed = frame_offset + kFramePrefixBytes;
    return result;
  }
  const std::byte* p = available.data();
  info.tensor = load_le<std::uint32_t>(p + kFrameTensorAt);
  if (info.tensor >= header.tensor_numels.size()) {
    fail(where + ": tensor " + std::to_string(info.tensor) + " is not in the tensor table (" +
             std::to_string(header.tensor_numels.size()) + " tensors)",
         frame_offset + kFrameTensorAt);
  }
  const auto encoding_code = static_cast<std::uint8_t>(p[kFrameEncodingAt]);
  // A context message's chunks fall back to pulse frames where context coding does not pay.
  const bool fallback = header.encoding == Encoding::context &&
                        encoding_code == static_cast<std::uint8_t>(Encoding::pulse);
  if (encoding_code != static_cast<std::uint8_t>(header.encoding) && !fallback) {
    fail(where + ": encoding " + std::to_string(encoding_code) + " differs from the message's (" +
             std::to_string(static_cast<int>(header.encoding)) + ")",
         frame_offset + kFrameEncodingAt);
  }
  info.encoding = static_cast<Encoding>(encoding_code);
  const bool streams = (info.encoding == Encoding::pulse || info.encoding == Encoding::context);
  const auto coding_code = static_cast<std::uint8_t>(p[kFrameIndexCodingAt]);
  const auto zstd_streams = static_cast<std::uint8_t>(p[kFrameZstdStreamsAt]);
  const auto plane_or_value_flags = static_cast<std::uint8_t>(p[kFramePlaneOrValueFlagsAt]);
  info.begin = load_le<std::uint64_t>(p + kFrameBeginAt);
  info.length = load_le<std::uint32_t>(p + kFrameLengthAt);
  info.entries = load_le<std::uint32_t>(p + kFrameEntriesAt);
  const auto payload_bytes = load_le<std::uint64_t>(p + kFramePayloadBytesAt);

  const std::uint64_t max_length = std::min(kMaxFrameElements, limits.max_frame_elements);
  if (info.length > max_length) {
    fail(where + ": chunk length " + std::to_string(info.length) + " exceeds the limit " +
             std::to_string(max_length),
         frame_offset + kFrameLengthAt);
  }
  const std::uint64_t numel = header.tensor_numels[info.tensor];
  if (info.begin > numel || info.length > numel - info.begin) {
    fail(where + ": chunk [" + std::to_string(info.begin) + ", +" + std::to_string(info.length) +
             ") exceeds tensor " + std::to_string(info.tensor) + " of " + std::to_string(numel) +
             " elements",
         frame_offset + kFrameBeginAt);
  }
  if (info.entries > info.length) {
    fail(where + ": " + std::to_string(info.entries) + " entries in a chunk of " +
             std::to_string(info.length) + " elements",
         frame_offset + kFrameEntriesAt);
  }
  if (info.encoding == Encoding::context && info.entries == 0) {
    fail(where + ": a context frame without entries (an empty chunk is a pulse frame)",
         frame_offset + kFrameEncodingAt);
  }
  if (streams && info.entries > 0) {
    const bool context = info.encoding == Encoding::context;
    if (!valid_index_coding(coding_code) &&
        !(context && coding_code == static_cast<std::uint8_t>(IndexCoding::exponent_groups))) {
      fail(where + ": unknown index coding " + std::to_string(coding_code),
           frame_offset + kFrameIndexCodingAt);
    }
    if ((zstd_streams & ~(context ? detail::kContextZstdMask : kZstdStreamsMask)) != 0) {
      fail(where + ": unknown stream flags " + std::to_string(zstd_streams),
           frame_offset + kFrameZstdStreamsAt);
    }
    if ((plane_or_value_flags & ~(context ? detail::kContextValueFlagsMask : kSparsePlanesMask)) !=
        0) {
      fail(where + (context ? ": unknown value flags " : ": unknown plane flags ") +
               std::to_string(plane_or_value_flags),
           frame_offset + kFramePlaneOrValueFlagsAt);
    }
    info.index_coding = static_cast<IndexCoding>(coding_code);
    info.values_less_residue = context && (plane_or_value_flags & detail::kContextLessResidue) != 0;
    info.residue_multiples =
        context && (plane_or_value_flags & detail::kContextResidueMultiples) != 0;
    if (info.residue_multiples && !info.values_less_residue) {
      fail(where + ": value flags " + std::to_string(plane_or_value_flags) +
               " give residue multiples without the residue",
           frame_offset + kFramePlaneOrValueFlagsAt);
    }
  } else {
    // Plain frames and empty pulse frames have no streams to describe.
    if (coding_code != 0) {
      fail(where + ": index coding must be 0 in a frame without streams",
           frame_offset + kFrameIndexCodingAt);
    }
    if (zstd_streams != 0) {
      fail(where + ": stream flags must be 0 in a frame without streams",
           frame_offset + kFrameZstdStreamsAt);
    }
    if (plane_or_value_flags != 0) {
      fail(where + ": plane flags must be 0 in a frame without streams",
           frame_offset + kFramePlaneOrValueFlagsAt);
    }
  }
  // Sizes: everything in u64 arithmetic that cannot overflow (entries < 2^32, payload checked
  // against what can still fit in the message before it is added to anything).
  std::uint64_t expected_payload = 0;
  bool payload_size_fixed = false;
  if (!streams) {
    expected_payload = info.entries * (plain_index_bytes(header.encoding) + 4);
    payload_size_fixed = true;
  } else if (info.entries == 0) {
    payload_size_fixed = true;
  }
  if (payload_size_fixed && payload_bytes != expected_payload) {
    fail(where + ": payload of " + std::to_string(payload_bytes) + " bytes, expected " +
             std::to_string(expected_payload),
         frame_offset + kFramePayloadBytesAt);
  }
  const std::uint64_t room = limits.max_message_bytes > frame_offset + kFrameOverheadBytes
                                 ? limits.max_message_bytes - frame_offset - kFrameOverheadBytes
                                 : 0;
  if (payload_bytes > room) {
    fail(where + ": payload of " + std::to_string(payload_bytes) +
             " bytes exceeds the message size limit",
         frame_offset + kFramePayloadBytesAt);
  }
  info.byte_size = kFrameOverheadBytes + payload_bytes;
  if (const std::uint64_t per_byte = limits.max_entries_per_frame_byte;
      per_byte != 0 && info.entries > kFreeFrameEntries &&
      (info.entries - kFreeFrameEntries - 1) / per_byte >= info.byte_size) {
    fail(where + ": " + std::to_string(info.entries) + " entries in a frame of " +
             std::to_string(info.byte_size) + " bytes exceed the limit of " +
             std::to_string(kFreeFrameEntries) + " + " + std::to_string(per_byte) +
             " per frame byte for a message without a model to check it against",
         frame_offset + kFrameEntriesAt);
  }
  if (available.size() < info.byte_size) {
    result.needed = frame_offset + info.byte_size;
    return result;
  }
  const auto payload = available.subspan(kFramePrefixBytes, payload_bytes);
  if (info.encoding == Encoding::context) {
    const detail::ContextLayout layout = detail::parse_context_layout(
        payload, frame_offset + kFramePrefixBytes, info, zstd_streams, frame_index);
    info.index_bytes = layout.directory_bytes + layout.stored[detail::kContextIndexStream].size();
    info.value_bytes = payload_bytes - info.index_bytes;
  } else if (info.encoding == Encoding::pulse) {
    if (info.entries > 0) {
      const PulseLayout layout =
          parse_pulse_layout(payload, frame_offset + kFramePrefixBytes, info, zstd_streams,
                             plane_or_value_flags, frame_index);
      info.index_bytes = layout.directory_bytes + layout.stored[wire::kIndexStream].size();
      info.value_bytes = payload_bytes - info.index_bytes;
    }
  } else {
    info.index_bytes = info.entries * plain_index_bytes(header.encoding);
    info.value_bytes = info.entries * 4;
  }
  result.complete = true;
  result.needed = frame_offset + info.byte_size;
  return result;
}

detail::HeaderPrefix detail::parse_header_prefix(std::span<const std::byte> bytes,
                                                 const DecodeLimits& limits) {
  if (bytes.size() < kHeaderPrefixBytes) {
    fail("truncated: the message header needs " + std::to_string(kHeaderPrefixBytes) + " bytes, " +
             std::to_string(bytes.size()) + " present",
         bytes.size());
  }
  const std::byte* p = bytes.data();
  if (std::memcmp(p, wire::kMagic, sizeof wire::kMagic) != 0) {
    fail("bad magic: not a pulseloco message", 0);
  }
  const auto version = load_le<std::uint16_t>(p + kHeaderVersionAt);
  if (version != kFormatVersion && version != kContextFormatVersion) {
    fail("unsupported format version " + std::to_string(version) + " (this build reads " +
             std::to_string(kFormatVersion) + " and " + std::to_string(kContextFormatVersion) + ")",
         kHeaderVersionAt);
  }
  const auto encoding_code = static_cast<std::uint8_t>(p[kHeaderEncodingAt]);
  if (!valid_encoding(encoding_code)) {
    fail("unknown encoding " + std::to_string(encoding_code), kHeaderEncodingAt);
  }
  if (version != format_version_of(static_cast<Encoding>(encoding_code))) {
    fail("encoding " + std::to_string(encoding_code) + " is not a format version " +
             std::to_string(version) + " encoding",
         kHeaderVersionAt);
  }
  if (p[kHeaderFlagsAt] != std::byte{0}) fail("header flags are not zero", kHeaderFlagsAt);
  if (load_le<std::uint32_t>(p + kHeaderReservedAt) != 0) {
    fail("reserved header field is not zero", kHeaderReservedAt);
  }
  HeaderPrefix prefix;
  prefix.encoding = static_cast<Encoding>(encoding_code);
  prefix.tensor_count = load_le<std::uint32_t>(p + kHeaderTensorCountAt);
  prefix.frame_count = load_le<std::uint32_t>(p + kHeaderFrameCountAt);
  if (prefix.tensor_count > limits.max_tensors) {
    fail(std::to_string(prefix.tensor_count) + " tensors exceed the limit of " +
             std::to_string(limits.max_tensors),
         kHeaderTensorCountAt);
  }
  if (prefix.frame_count > limits.max_frames) {
    fail(std::to_string(prefix.frame_count) + " frames exceed the limit of " +
             std::to_string(limits.max_frames),
         kHeaderFrameCountAt);
  }
  prefix.header_bytes =
      kHeaderPrefixBytes + 8 * std::uint64_t{prefix.tensor_count} + kChecksumBytes;
  const std::uint64_t minimum = prefix.header_bytes + prefix.frame_count * kFrameOverheadBytes;
  if (minimum > limits.max_message_bytes) {
    fail("a header of " + std::to_string(prefix.tensor_count) + " tensors and " +
             std::to_string(prefix.frame_count) + " frames exceeds the message size limit",
         kHeaderTensorCountAt);
  }
  return prefix;
}

MessageHeader detail::parse_header(std::span<const std::byte> bytes, const HeaderPrefix& prefix) {
  if (bytes.size() < prefix.header_bytes) {
    fail("truncated: the header of " + std::to_string(prefix.tensor_count) + " tensors needs " +
             std::to_string(prefix.header_bytes) + " bytes, " + std::to_string(bytes.size()) +
             " present",
         bytes.size());
  }
  const std::uint64_t checksum_at = prefix.header_bytes - kChecksumBytes;
  const std::uint64_t expected = XXH3_64bits(bytes.data(), checksum_at);
  if (load_le<std::uint64_t>(bytes.data() + checksum_at) != expected) {
    fail("header checksum mismatch", checksum_at);
  }
  MessageHeader header;
  header.encoding = prefix.encoding;
  header.window = load_le<std::uint64_t>(bytes.data() + kHeaderWindowAt);
  header.sender_rank = load_le<std::uint32_t>(bytes.data() + kHeaderRankAt);
  header.tensor_numels.resize(prefix.tensor_count);
  for (std::uint32_t t = 0; t < prefix.tensor_count; ++t) {
    const std::uint64_t at = kHeaderPrefixBytes + 8 * std::uint64_t{t};
    header.tensor_numels[t] = load_le<std::uint64_t>(bytes.data() + at);
    if (header.tensor_numels[t] > kMaxNumel) {
      fail("tensor " + std::to_string(t) + " has " + std::to_string(header.tensor_numels[t]) +
               " elements, more than 2^63 - 1",
           at);
    }
  }
  return header;
}

void detail::check_frame_order(const FrameInfo* previous, const FrameInfo& next,
                               std::size_t frame_index) {
  if (previous == nullptr) return;
  const std::uint64_t previous_end = previous->begin + previous->length;
  if (next.tensor < previous->tensor ||
      (next.tensor == previous->tensor && next.begin < previous_end)) {
    fail(frame_text(frame_index) + ": chunk (tensor " + std::to_string(next.tensor) + ", begin " +
             std::to_string(next.begin) +
             ") is out of order or overlaps the previous frame's (tensor " +
             std::to_string(previous->tensor) + ", end " + std::to_string(previous_end) + ")",
         next.byte_offset);
  }
}

void detail::check_message_size(std::uint64_t size, const DecodeLimits& limits) {
  if (size > limits.max_message_bytes) {
    fail("message of " + std::to_string(size) + " bytes exceeds the limit of " +
             std::to_string(limits.max_message_bytes),
         0);
  }
}

void detail::fail_truncated_frame(std::size_t frame_index, std::uint32_t frame_count,
                                  std::uint64_t frame_offset, std::uint64_t needed,
                                  std::uint64_t size) {
  fail("truncated: " + frame_text(frame_index) + " of " + std::to_string(frame_count) +
           " needs bytes up to " + std::to_string(needed) + ", the message has " +
           std::to_string(size),
       frame_offset);
}

void detail::fail_bytes_after_frames(std::uint32_t frame_count, std::uint64_t end,
                                     std::uint64_t size) {
  fail(std::to_string(size - end) + " bytes after the last of " + std::to_string(frame_count) +
           " frames",
       end);
}

void detail::fail_checksum(std::size_t frame_index, std::uint64_t checksum_offset) {
  fail(frame_text(frame_index) + ": checksum mismatch", checksum_offset);
}

// ---------------------------------------------------------------------------------------------
// Names

std::string_view encoding_name(Encoding encoding) noexcept {
  switch (encoding) {
    case Encoding::pulse:
      return "pulse";
    case Encoding::plain_i64_f32:
      return "plain_i64_f32";
    case Encoding::plain_i32_f32:
      return "plain_i32_f32";
    case Encoding::context:
      return "context";
  }
  return "unknown";
}

std::string_view index_coding_name(IndexCoding coding) noexcept {
  switch (coding) {
    case IndexCoding::varint:
      return "varint";
    case IndexCoding::bitpack:
      return "bitpack";
    case IndexCoding::elias_fano:
      return "elias_fano";
    case IndexCoding::exponent_groups:
      return "exponent_groups";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------------------------
// Decoding

struct DecodeScratch::Impl {
  detail::ZstdDCtxPtr dctx = detail::make_zstd_dctx();
  std::vector<std::byte> index_raw;  // decompressed or padded index stream
  std::vector<std::byte> planes;     // value planes that are not used in place
  std::vector<std::byte> sparse;     // a decompressed sparse plane
  std::vector<std::uint32_t> offsets;
  std::vector<std::uint8_t> symbols;  // a context frame's context exponents, D, U, multiples
  std::unique_ptr<detail::SymbolModels> symbol_models;  // a context frame's symbol models
  std::vector<float> values;    // a context frame's values before their digest is checked
  detail::GroupScratch groups;  // a context frame's exponent_groups coding
};

DecodeScratch::DecodeScratch() : impl_(std::make_unique<Impl>()) {}
DecodeScratch::~DecodeScratch() = default;
DecodeScratch::DecodeScratch(DecodeScratch&&) noexcept = default;
DecodeScratch& DecodeScratch::operator=(DecodeScratch&&) noexcept = default;

std::uint64_t message_header_size(std::span<const std::byte> prefix, const DecodeLimits& limits) {
  return detail::parse_header_prefix(prefix, limits).header_bytes;
}

DecodeLimits DecodeLimits::for_file() {
  DecodeLimits limits;
  limits.max_entries_per_frame_byte = kFileEntriesPerFrameByte;
  return limits;
}

MessageView MessageView::parse(std::span<const std::byte> message, const DecodeLimits& limits) {
  return parse_impl(message, limits, true);
}

MessageView MessageView::parse_prefix(std::span<const std::byte> received,
                                      const DecodeLimits& limits) {
  return parse_impl(received, limits, false);
}

MessageView MessageView::parse_impl(std::span<const std::byte> bytes, const DecodeLimits& limits,
                                    bool require_complete) {
  detail::check_message_size(bytes.size(), limits);
  const detail::HeaderPrefix prefix = detail::parse_header_prefix(bytes, limits);
  MessageView view;
  view.bytes_ = bytes;
  view.announced_frames_ = prefix.frame_count;
  view.header_ = detail::parse_header(bytes, prefix);
  const MessageHeader& header = view.header_;

  // Never trust frame_count for memory: reserve only what the bytes present could hold.
  std::uint64_t offset = prefix.header_bytes;
  view.frames_.reserve(static_cast<std::size_t>(
      std::min<std::uint64_t>(prefix.frame_count, (bytes.size() - offset) / kFrameOverheadBytes)));
  view.bytes_needed_ = offset;
  for (std::uint32_t i = 0; i < prefix.frame_count; ++i) {
    const detail::FrameParse parsed =
        detail::parse_frame(bytes.subspan(offset), offset, header, limits, i);
    if (!parsed.complete) {
      view.bytes_needed_ = parsed.needed;
      if (require_complete) {
        detail::fail_truncated_frame(i, prefix.frame_count, offset, parsed.needed, bytes.size());
      }
      break;
    }
    const FrameInfo& info = parsed.info;
    detail::check_frame_order(view.frames_.empty() ? nullptr : &view.frames_.back(), info, i);
    view.frames_.push_back(info);
    offset += info.byte_size;
    view.bytes_needed_ = offset;
  }
  if (view.complete() && offset != bytes.size()) {
    detail::fail_bytes_after_frames(prefix.frame_count, offset, bytes.size());
  }
  return view;
}

namespace {

std::uint64_t decode_plain(std::span<const std::byte> payload, std::uint64_t payload_offset,
                           const FrameInfo& info, std::size_t frame_index,
                           std::span<std::uint32_t> out_offsets, std::span<float> out_values) {
  const std::size_t n = info.entries;
  const std::uint64_t index_bytes = plain_index_bytes(info.encoding);
  const std::byte* indices = payload.data();
  const std::byte* values = payload.data() + n * index_bytes;
  const auto offset_of = [&](std::size_t i) -> std::uint64_t {
    // As unsigned: a negative index wraps to >= 2^63 and fails the range check like any other.
    if (info.encoding == Encoding::plain_i64_f32) {
      return load_le<std::uint64_t>(indices + 8 * i) - info.begin;
    }
    return load_le<std::uint32_t>(indices + 4 * i);
  };
  // Validate every entry before the first write.
  std::uint64_t next = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t offset = offset_of(i);
    if (offset >= info.length || offset < next) {
      const std::uint64_t at = payload_offset + i * index_bytes;
      if (info.encoding == Encoding::plain_i64_f32) {
        const auto index = load_le<std::int64_t>(indices + 8 * i);
        fail(frame_text(frame_index) + ": entry " + std::to_string(i) + ": index " +
                 std::to_string(index) +
                 (offset >= info.length ? " is outside the chunk [" + std::to_string(info.begin) +
                                              ", " + std::to_string(info.begin + info.length) + ")"
                                        : " does not ascend"),
             at);
      }
      fail(frame_text(frame_index) + ": entry " + std::to_string(i) + ": offset " +
               std::to_string(static_cast<std::int32_t>(offset)) +
               (offset >= info.length
                    ? " is not below the chunk length " + std::to_string(info.length)
                    : " does not ascend"),
           at);
    }
    next = offset + 1;
  }
  for (std::size_t i = 0; i < n; ++i) {
    const auto bits = load_le<std::uint32_t>(values + 4 * i);
    if ((bits & 0x7F800000u) == 0x7F800000u) {
      throw ProtocolError(
          frame_text(frame_index) + ": entry " + std::to_string(i) + ": value is not finite",
          ErrorContext{.index = info.begin + offset_of(i),
                       .byte_offset = payload_offset + n * index_bytes + 4 * i});
    }
  }
  for (std::size_t i = 0; i < n; ++i)
    out_offsets[i] = static_cast<std::uint32_t>(offset_of(i));
  std::memcpy(out_values.data(), values, n * 4);
  return n;
}

// Decodes a frame's index stream (as stored, at `stored_offset` in the message) into
// scratch.offsets.
void decode_index_stream(const FrameInfo& info, std::uint64_t index_raw_bytes,
                         std::span<const std::byte> stored, bool compressed,
                         std::uint64_t stored_offset, const std::string& where,
                         DecodeScratch::Impl& scratch, std::span<const float> context = {}) {
  // Stage the raw stream with zero padding (the bit-level decoders read whole words).
  const auto raw_bytes = static_cast<std::size_t>(index_raw_bytes);
  grow(scratch.index_raw, raw_bytes + detail::kIndexPadding);
  const std::span<std::byte> index_raw(scratch.index_raw.data(), raw_bytes);
  if (compressed) {
    detail::zstd_decompress_exact(scratch.dctx.get(), stored, index_raw, stored_offset,
                                  where + " index stream");
  } else {
    std::memcpy(index_raw.data(), stored.data(), raw_bytes);
  }
  std::fill_n(scratch.index_raw.data() + raw_bytes, detail::kIndexPadding, std::byte{0});
  if (scratch.offsets.size() < info.entries) scratch.offsets.resize(info.entries);
  try {
    if (info.index_coding == IndexCoding::exponent_groups) {
      detail::decode_grouped_indices(index_raw, info.entries, context, scratch.offsets.data(),
                                     scratch.groups, stored_offset, compressed);
      return;
    }
    detail::decode_indices(info.index_coding, index_raw, info.entries, info.length,
                           scratch.offsets.data(), stored_offset, compressed);
  } catch (const ProtocolError& e) {
    throw ProtocolError(where + " " + e.message(), e.context());
  }
}

std::uint64_t decode_pulse(std::span<const std::byte> payload, std::uint64_t payload_offset,
                           const FrameInfo& info, std::uint8_t zstd_streams,
                           std::uint8_t sparse_planes, std::size_t frame_index,
                           std::span<std::uint32_t> out_offsets, std::span<float> out_values,
                           DecodeScratch::Impl& scratch) {
  const std::size_t n = info.entries;
  const PulseLayout layout =
      parse_pulse_layout(payload, payload_offset, info, zstd_streams, sparse_planes, frame_index);
  const std::string where = frame_text(frame_index);
  const auto stream_name = [&](int s) {
    return s == wire::kIndexStream ? where + " index stream"
                                   : where + " value plane " + std::to_string(s - 1);
  };
  // Every compressed stream must be able to hold what it declares before anything is allocated
  // for it (the sizes in the directory are the sender's word; the zstd headers can be checked).
  for (int s = 0; s < wire::kPulseStreams; ++s) {
    if (layout.compressed[s]) {
      detail::check_zstd_frame(layout.stored[s], layout.decoded[s], layout.offset[s],
                               stream_name(s));
    }
  }

  decode_index_stream(info, layout.index_raw_bytes, layout.stored[wire::kIndexStream],
                      layout.compressed[wire::kIndexStream], layout.offset[wire::kIndexStream],
                      where, scratch);

  // Values: dense planes stored raw are used in place; the others are rebuilt in scratch.
  grow(scratch.planes, 4 * n);
  detail::PlanePointers planes;
  for (std::size_t k = 0; k < 4; ++k) {
    const std::size_t s = 1 + k;
    const std::string what = stream_name(static_cast<int>(s));
    std::span<const std::byte> raw = layout.stored[s];
    if (layout.compressed[s]) {
      const auto decoded = static_cast<std::size_t>(layout.decoded[s]);
      std::byte* target = scratch.planes.data() + k * n;
      if (layout.sparse[k]) {
        grow(scratch.sparse, decoded);
        target = scratch.sparse.data();
      }
      detail::zstd_decompress_exact(scratch.dctx.get(), layout.stored[s],
                                    std::span<std::byte>(target, decoded), layout.offset[s], what);
      raw = std::span<const std::byte>(target, decoded);
    }
    if (layout.sparse[k]) {
      std::byte* plane = scratch.planes.data() + k * n;
      detail::decode_sparse_plane(raw, n, static_cast<std::size_t>(layout.nonzero[k]), plane,
                                  layout.offset[s], what);
      planes.plane[k] = plane;
    } else {
      planes.plane[k] = raw.data();
    }
  }
  const std::size_t bad = detail::first_non_finite_in_planes(planes, n);
  if (bad != n) {
    throw ProtocolError(
        where + ": entry " + std::to_string(bad) + ": value is not finite",
        ErrorContext{.index = info.begin + scratch.offsets[bad], .byte_offset = layout.offset[4]});
  }

  // Everything is valid: now, and only now, write the caller's buffers.
  std::memcpy(out_offsets.data(), scratch.offsets.data(), n * sizeof(std::uint32_t));
  detail::merge_planes(planes, n, out_values.data());
  return n;
}

// A context frame: indices as a pulse frame's, values rebuilt against `context` and checked
// against the frame's value digest before the caller's buffers are written.
std::uint64_t decode_context(std::span<const std::byte> payload, std::uint64_t payload_offset,
                             const FrameInfo& info, std::uint8_t zstd_streams,
                             std::size_t frame_index, std::span<std::uint32_t> out_offsets,
                             std::span<float> out_values, std::span<const float> context,
                             DecodeScratch::Impl& scratch) {
  const std::string where = frame_text(frame_index);
  if (context.size() != info.length) {
    throw InvalidArgument(where + " is context-coded: decoding it needs the chunk's " +
                          std::to_string(info.length) + " context values (θ_g), " +
                          std::to_string(context.size()) + " given");
  }
  const std::size_t n = info.entries;
  const detail::ContextLayout layout =
      detail::parse_context_layout(payload, payload_offset, info, zstd_streams, frame_index);
  // The symbols are modelled by the context exponents: decoded against other exponents, the
  // symbol and raw bit streams stop fitting together, or the values differ (the digest).
  constexpr const char* kAgainstThisContext =
      " against this receiver's context (the receiver's θ_g differs from the sender's, or the "
      "streams are corrupt)";
  if (layout.compressed[detail::kContextIndexStream]) {
    detail::check_zstd_frame(layout.stored[detail::kContextIndexStream],
                             layout.decoded[detail::kContextIndexStream],
                             layout.offset[detail::kContextIndexStream], where + " index stream");
  }
  decode_index_stream(info, layout.index_raw_bytes, layout.stored[detail::kContextIndexStream],
                      layout.compressed[detail::kContextIndexStream],
                      layout.offset[detail::kContextIndexStream], where, scratch, context);
  if (scratch.symbols.size() < 4 * n) scratch.symbols.resize(4 * n);
  std::uint8_t* const e = scratch.symbols.data();
  std::uint8_t* const d = e + n;
  std::uint8_t* const u = d + n;
  std::uint8_t* const k = info.residue_multiples ? u + n : nullptr;
  const std::span<const std::uint32_t> offsets(scratch.offsets.data(), n);
  // exponent_groups computed the chunk's exponent bytes while decoding the indices.
  const std::uint8_t* exponents =
      info.index_coding == IndexCoding::exponent_groups ? scratch.groups.exponents.data() : nullptr;
  detail::gather_context_exponents(offsets, context, exponents, e);
  if (!scratch.symbol_models) scratch.symbol_models = std::make_unique<detail::SymbolModels>();
  if (!detail::decode_symbols(layout.stored[detail::kContextSymbolStream], e, n,
                              *scratch.symbol_models, d, u, k)) {
    fail(where + ": the symbol stream does not decode to " + std::to_string(n) +
             " entries' symbols" + kAgainstThisContext,
         layout.offset[detail::kContextSymbolStream]);
  }
  const detail::RawBitsNeed need = detail::raw_bits_needed(d, u, n);
  if (need.bad_entry != n) {
    fail(where + ": entry " + std::to_string(need.bad_entry) +
             ": zero-run symbol gives more than 23 trailing zeros" + kAgainstThisContext,
         layout.offset[detail::kContextSymbolStream]);
  }
  const auto& bits = layout.stored[detail::kContextRawBitsStream];
  const std::uint64_t bits_at = layout.offset[detail::kContextRawBitsStream];
  if (bits.size() != (need.bits + 7) / 8) {
    fail(where + ": raw bit stream of " + std::to_string(bits.size()) +
             " bytes, its entries need " + std::to_string(need.bits) + " bits" +
             kAgainstThisContext,
         bits_at);
  }
  if ((need.bits & 7) != 0 && (std::to_integer<unsigned>(bits.back()) >> (need.bits & 7)) != 0) {
    fail(where + ": non-zero padding bits in the raw bit stream" + kAgainstThisContext,
         bits_at + bits.size() - 1);
  }
  // The raw bits are the payload's last stream, followed by the frame's 8-byte checksum: the
  // word reads of join_against_context stay inside the frame.
  if (scratch.values.size() < n) scratch.values.resize(n);
  std::size_t bad = detail::join_against_context(n, e, d, u, bits.data(), scratch.values.data());
  if (info.values_less_residue) {
    bad = detail::add_context_residue(offsets, context, k, scratch.values.data());
  }
  const std::span<const float> values(scratch.values.data(), n);
  const std::uint64_t digest = info.index_coding == IndexCoding::exponent_groups
                                   ? detail::entries_digest(offsets, values)
                                   : detail::values_digest(values);
  if (digest != layout.digest) {
    fail(where +
             ": the values decoded against this receiver's context do not match the "
             "sender's value digest (the receiver's θ_g differs from the sender's, or the "
             "streams are corrupt)",
         payload_offset + layout.directory_bytes - 8);
  }
  if (bad != n) {
    throw ProtocolError(
        where + ": entry " + std::to_string(bad) + ": value is not finite",
        ErrorContext{.index = info.begin + scratch.offsets[bad], .byte_offset = bits_at});
  }
  std::memcpy(out_offsets.data(), scratch.offsets.data(), n * sizeof(std::uint32_t));
  std::memcpy(out_values.data(), scratch.values.data(), n * sizeof(float));
  return n;
}

}  // namespace

std::uint64_t detail::decode_frame(std::span<const std::byte> frame, const FrameInfo& info,
                                   std::size_t frame_index, std::span<std::uint32_t> out_offsets,
                                   std::span<float> out_values, DecodeScratch& scratch,
                                   std::span<const float> context) {
  if (out_offsets.size() < info.entries || out_values.size() < info.entries) {
    throw InvalidArgument("decode_frame: frame " + std::to_string(frame_index) + " has " +
                          std::to_string(info.entries) + " entries; the output holds " +
                          std::to_string(std::min(out_offsets.size(), out_values.size())));
  }
  const std::size_t checksum_at = frame.size() - kChecksumBytes;
  if (load_le<std::uint64_t>(frame.data() + checksum_at) !=
      XXH3_64bits(frame.data(), checksum_at)) {
    fail_checksum(frame_index, info.byte_offset + checksum_at);
  }
  if (info.entries == 0) return 0;
  const auto payload = frame.subspan(kFramePrefixBytes, checksum_at - kFramePrefixBytes);
  const std::uint64_t payload_offset = info.byte_offset + kFramePrefixBytes;
  if (info.encoding == Encoding::context) {
    const auto zstd_streams = static_cast<std::uint8_t>(frame[kFrameZstdStreamsAt]);
    return decode_context(payload, payload_offset, info, zstd_streams, frame_index, out_offsets,
                          out_values, context, scratch.impl());
  }
  if (info.encoding == Encoding::pulse) {
    const auto zstd_streams = static_cast<std::uint8_t>(frame[kFrameZstdStreamsAt]);
    const auto sparse_planes = static_cast<std::uint8_t>(frame[kFramePlaneOrValueFlagsAt]);
    return decode_pulse(payload, payload_offset, info, zstd_streams, sparse_planes, frame_index,
                        out_offsets, out_values, scratch.impl());
  }
  return decode_plain(payload, payload_offset, info, frame_index, out_offsets, out_values);
}

std::uint64_t MessageView::decode_frame(std::size_t i, std::span<std::uint32_t> out_offsets,
                                        std::span<float> out_values, DecodeScratch& scratch,
                                        std::span<const float> context) const {
  const FrameInfo& info = frames_.at(i);
  return detail::decode_frame(bytes_.subspan(info.byte_offset, info.byte_size), info, i,
                              out_offsets, out_values, scratch, context);
}

}  // namespace pulseloco::codec
