// A worker's window message: a header (magic, format version, window, sender rank, encoding,
// tensor table) followed by independent frames, each covering one chunk of one tensor and
// carrying its own length and xxh3-64 checksum. docs/wire-format.md is the byte-level spec.
//
// Frames are encoded independently (in parallel, as the gate produces chunks) and decoded
// independently (as bytes arrive). The decoder treats every byte as hostile: it validates
// lengths, counts, checksums, tensor ids, index ranges and ordering against the real buffer
// and the configured limits before writing anything to the caller's output.
//
// A message is encode_header(header, n) followed by exactly n frames from encode_frame(),
// concatenated, in ascending (tensor, begin) order with no two frames of a tensor overlapping
// (the decoder rejects anything else, so every (tensor, index) occurs at most once per message).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace pulseloco::codec {

// How a frame's entries are represented.
enum class Encoding : std::uint8_t {
  pulse = 0,          // ours: gap-coded indices, fp32 values split into byte planes, zstd
  plain_i64_f32 = 1,  // the PULSE authors' exchange: int64 index + fp32 value, 12 B per entry
  plain_i32_f32 = 2,  // int32 index + fp32 value, 8 B per entry
  // Values coded against the bits every receiver holds at the same elements (θ_g): needs
  // FrameEntries::context to encode and the same context to decode. A chunk where that does not
  // pay goes as a pulse frame (format version 4).
  context = 3,
};

[[nodiscard]] std::string_view encoding_name(Encoding encoding) noexcept;

// How a pulse frame codes its offsets (recorded in the frame; the encoder picks per frame).
enum class IndexCoding : std::uint8_t {
  varint = 0,      // LEB128 gaps
  bitpack = 1,     // gaps bit-packed in blocks of 128 with a per-block width
  elias_fano = 2,  // Elias-Fano over the offsets
  // Context frames only: the offsets grouped by the exponent of their context value, each
  // group's count and Rice-coded ranks (decoding needs the context).
  exponent_groups = 3,
};

[[nodiscard]] std::string_view index_coding_name(IndexCoding coding) noexcept;

// The format versions this library writes and reads (docs/wire-format.md, "Versioning"): a
// message of encoding `context` is version 6 (its frames range-code their D and U symbols and
// may code their values less a multiple of θ_g's bf16 cast residue per entry), every other
// message version 1. Versions 2 to 5 (context frames of earlier layouts) are not read.
inline constexpr std::uint16_t kFormatVersion = 1;
inline constexpr std::uint16_t kContextFormatVersion = 6;
[[nodiscard]] constexpr std::uint16_t format_version_of(Encoding encoding) noexcept {
  return encoding == Encoding::context ? kContextFormatVersion : kFormatVersion;
}
// A chunk (frame) covers at most this many elements: offsets are uint32.
inline constexpr std::uint64_t kMaxFrameElements = std::uint64_t{1} << 31;
// zstd level used when EncodeOptions::zstd_level is 0, chosen by measurement
// (docs/benchmarks.md, "Codec").
inline constexpr int kDefaultZstdLevel = 1;
inline constexpr int kMaxZstdLevel = 19;

struct EncodeOptions {
  Encoding encoding = Encoding::pulse;
  int zstd_level = 0;  // 0 = the measured default (see docs/benchmarks.md); 1..19 otherwise
  // pulse and context: force one index coding (tests, benchmarks; exponent_groups only with
  // the context encoding, and a chunk that falls back to a pulse frame then picks its own).
  // Unset: per frame, the coding with the fewest bytes (deterministic: ties go to the lower
  // code).
  std::optional<IndexCoding> index_coding;
};

struct MessageHeader {
  std::uint64_t window = 0;
  std::uint32_t sender_rank = 0;
  Encoding encoding = Encoding::pulse;
  std::vector<std::uint64_t> tensor_numels;  // the tensor table, in tensor order

  friend bool operator==(const MessageHeader&, const MessageHeader&) = default;
};

// One chunk's entries as the gate produced them: offsets relative to `begin`, ascending.
struct FrameEntries {
  std::uint32_t tensor = 0;
  std::uint64_t begin = 0;   // first element of the chunk within the tensor
  std::uint64_t length = 0;  // elements the chunk covers; every offset is < length
  std::span<const std::uint32_t> offsets;
  std::span<const float> values;
  // Encoding::context only: the chunk's context, `length` values (the sender's θ_g of the
  // chunk); a receiver decodes the frame against the same bits.
  std::span<const float> context;
  // Encoding::context only, optional: per entry, how many times its value carries its context's
  // bf16 cast residue (an owner's sum of k ranks' values, with bf16 local weights and the
  // authors' Δ, carries it k times); empty: once. Only the size of the frame depends on it.
  std::span<const std::uint8_t> residue_multiples;
};

// Encodes one frame. Pure and thread-safe: frames of one message may be encoded concurrently.
// Throws InvalidArgument (naming the entry) unless offsets are strictly ascending and < length,
// values are finite, offsets and values have the same size, length <= kMaxFrameElements,
// the zstd level is 0 or 1..kMaxZstdLevel and, for Encoding::context, the context holds
// `length` values.
[[nodiscard]] std::vector<std::byte> encode_frame(const FrameEntries& entries,
                                                  const EncodeOptions& options);

// The most bytes encode_frame() writes for a chunk of `length` elements, in any encoding and
// index coding, and the most encode_header() writes for `tensors` tensors: a receiver that knows
// its model holds a peer's announced message size to their sum.
[[nodiscard]] std::uint64_t max_encoded_frame_bytes(std::uint64_t length) noexcept;
[[nodiscard]] std::uint64_t max_encoded_header_bytes(std::uint64_t tensors) noexcept;

// The message header announcing `frame_count` frames.
[[nodiscard]] std::vector<std::byte> encode_header(const MessageHeader& header,
                                                   std::uint32_t frame_count);

// Entries every frame may announce, whatever its size, under max_entries_per_frame_byte.
inline constexpr std::uint64_t kFreeFrameEntries = std::uint64_t{1} << 16;
// max_entries_per_frame_byte for messages read from files: one bit per entry, far below the
// bytes per entry of real messages (docs/wire-format.md, "Decoding limits").
inline constexpr std::uint64_t kFileEntriesPerFrameByte = 8;

// Caps the decoder enforces before trusting any size field: the one set of limits of every
// reader (docs/wire-format.md, "Decoding limits"). A reader with a model sets the sizes to its
// model's (the engine: its chunks and tensors); a reader without one uses for_file().
struct DecodeLimits {
  std::uint64_t max_message_bytes = std::uint64_t{1} << 36;
  std::uint32_t max_tensors = 1u << 20;
  std::uint32_t max_frames = 1u << 24;
  std::uint64_t max_frame_elements = std::uint64_t{1} << 31;  // chunk length cap
  // A frame of b bytes may announce at most kFreeFrameEntries + max_entries_per_frame_byte * b
  // entries, so that decoding it allocates at most a multiple of the input's size; 0: no such
  // bound (a reader that checks every frame against its own chunks, whose buffers it holds).
  std::uint64_t max_entries_per_frame_byte = 0;

  // A message read from a file, with no model to check it against: the defaults and
  // max_entries_per_frame_byte = kFileEntriesPerFrameByte.
  [[nodiscard]] static DecodeLimits for_file();
};

struct FrameInfo {
  std::uint32_t tensor = 0;
  std::uint64_t begin = 0;
  std::uint64_t length = 0;
  std::uint64_t entries = 0;      // validated against length
  std::uint64_t byte_offset = 0;  // where the frame starts in the message
  std::uint64_t byte_size = 0;    // the whole frame, header included
  // How the entries are stored (index_coding is varint for plain frames and empty frames). In a
  // message of encoding `context`, a frame is `context` or, where that did not pay, `pulse`.
  Encoding encoding = Encoding::pulse;
  IndexCoding index_coding = IndexCoding::varint;
  std::uint64_t index_bytes = 0;  // payload bytes holding the indices (stream table included)
  std::uint64_t value_bytes = 0;  // payload bytes holding the values
  // Context frames: the values are coded less θ_g's bf16 cast residue (value_flags bit 0), each
  // less its own multiple of it (bit 1).
  bool values_less_residue = false;
  bool residue_multiples = false;
};

// Fixed sizes of the format (docs/wire-format.md).
inline constexpr std::size_t kHeaderPrefixBytes = 32;  // the header before the tensor table
inline constexpr std::size_t kFramePrefixBytes = 32;   // a frame before its payload
inline constexpr std::size_t kChecksumBytes = 8;

// Streaming receivers: the size of the whole header, known from its first kHeaderPrefixBytes.
// Validates magic, version, encoding, reserved fields and the counts against `limits`.
[[nodiscard]] std::uint64_t message_header_size(std::span<const std::byte> prefix,
                                                const DecodeLimits& limits = {});

// Per-thread scratch for decoding (zstd contexts, staging buffers); reuse it across frames.
// Its memory grows to at most 23 bytes per entry of the largest frame decoded with it (15
// without context frames; docs/wire-format.md, "Decoding memory"), plus 67 KiB of symbol models
// once it has decoded a context frame, plus the exponent_groups scratch per chunk element.
class DecodeScratch {
 public:
  DecodeScratch();
  ~DecodeScratch();
  DecodeScratch(DecodeScratch&&) noexcept;
  DecodeScratch& operator=(DecodeScratch&&) noexcept;

  struct Impl;
  [[nodiscard]] Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// A validated view of a complete message (the bytes must outlive it).
class MessageView {
 public:
  // Parses the header and the frame table; checks every length, tensor id and range against
  // the buffer and `limits`. Throws ProtocolError naming the reason and the byte offset.
  [[nodiscard]] static MessageView parse(std::span<const std::byte> message,
                                         const DecodeLimits& limits = {});

  // Streaming: parses a message that is still arriving. `received` must hold at least the
  // whole header (message_header_size); the view holds every frame complete in `received`
  // (frame_count() of them) and validates them exactly as parse() does. A trailing partial
  // frame is not an error; bytes beyond the last announced frame are.
  [[nodiscard]] static MessageView parse_prefix(std::span<const std::byte> received,
                                                const DecodeLimits& limits = {});

  [[nodiscard]] const MessageHeader& header() const noexcept { return header_; }
  [[nodiscard]] std::size_t frame_count() const noexcept { return frames_.size(); }
  [[nodiscard]] const FrameInfo& frame(std::size_t i) const { return frames_.at(i); }
  // Frames the header announces; frame_count() equals it once the message is complete.
  [[nodiscard]] std::uint32_t announced_frame_count() const noexcept { return announced_frames_; }
  [[nodiscard]] bool complete() const noexcept { return frames_.size() == announced_frames_; }
  // Streaming: the message bytes needed before one more frame can be parsed (the end of the
  // next frame when its prefix has arrived, else the end of that prefix); the message size
  // once complete().
  [[nodiscard]] std::uint64_t bytes_needed() const noexcept { return bytes_needed_; }

  // Decodes frame i into the caller's buffers (each with room for frame(i).entries). Verifies
  // the checksum, decompresses, and checks that offsets are strictly ascending and < length
  // and that values are finite, all before the first write to `out_offsets`/`out_values`.
  // Returns the entry count. Throws ProtocolError (with the byte offset) on any violation and
  // InvalidArgument when an output span is too small. A frame of encoding `context` decodes
  // against `context` (the chunk's θ_g as the receiver holds it, frame(i).length values;
  // InvalidArgument when it has another size); a receiver whose context differs from the
  // sender's gets a ProtocolError (the frame's value digest), never other values.
  std::uint64_t decode_frame(std::size_t i, std::span<std::uint32_t> out_offsets,
                             std::span<float> out_values, DecodeScratch& scratch,
                             std::span<const float> context = {}) const;

 private:
  static MessageView parse_impl(std::span<const std::byte> bytes, const DecodeLimits& limits,
                                bool require_complete);

  std::span<const std::byte> bytes_;
  MessageHeader header_;
  std::vector<FrameInfo> frames_;
  std::uint32_t announced_frames_ = 0;
  std::uint64_t bytes_needed_ = 0;
};

}  // namespace pulseloco::codec
