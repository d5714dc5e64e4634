// A worker's window message: a header (magic, format version, window, sender rank, encoding,
// tensor table) followed by independent frames, each covering one chunk of one tensor and
// carrying its own length and xxh3-64 checksum. docs/wire-format.md is the byte-level spec.
//
// Frames are encoded independently (in parallel, as the gate produces chunks) and decoded
// independently (as bytes arrive). The decoder treats every byte as hostile: it validates
// lengths, counts, checksums, tensor ids, index ranges and ordering against the real buffer
// and the configured limits before writing anything to the caller's output.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

namespace pulseloco::codec {

// How a frame's entries are represented.
enum class Encoding : std::uint8_t {
  pulse = 0,          // ours: gap-coded indices, fp32 values split into byte planes, zstd
  plain_i64_f32 = 1,  // the PULSE authors' exchange: int64 index + fp32 value, 12 B per entry
  plain_i32_f32 = 2,  // int32 index + fp32 value, 8 B per entry
};

[[nodiscard]] std::string_view encoding_name(Encoding encoding) noexcept;

struct EncodeOptions {
  Encoding encoding = Encoding::pulse;
  int zstd_level = 0;  // 0 = the measured default (see docs/benchmarks.md); 1..19 otherwise
};

struct MessageHeader {
  std::uint64_t window = 0;
  std::uint32_t sender_rank = 0;
  Encoding encoding = Encoding::pulse;
  std::vector<std::uint64_t> tensor_numels;  // the tensor table, in tensor order
};

// One chunk's entries as the gate produced them: offsets relative to `begin`, ascending.
struct FrameEntries {
  std::uint32_t tensor = 0;
  std::uint64_t begin = 0;   // first element of the chunk within the tensor
  std::uint64_t length = 0;  // elements the chunk covers; every offset is < length
  std::span<const std::uint32_t> offsets;
  std::span<const float> values;
};

// Encodes one frame. Pure and thread-safe: frames of one message may be encoded concurrently.
[[nodiscard]] std::vector<std::byte> encode_frame(const FrameEntries& entries,
                                                  const EncodeOptions& options);

// The message header announcing `frame_count` frames.
[[nodiscard]] std::vector<std::byte> encode_header(const MessageHeader& header,
                                                   std::uint32_t frame_count);

// Caps the decoder enforces before trusting any size field.
struct DecodeLimits {
  std::uint64_t max_message_bytes = std::uint64_t{1} << 36;
  std::uint32_t max_tensors = 1u << 20;
  std::uint32_t max_frames = 1u << 24;
  std::uint64_t max_frame_elements = std::uint64_t{1} << 31;  // chunk length cap
};

struct FrameInfo {
  std::uint32_t tensor = 0;
  std::uint64_t begin = 0;
  std::uint64_t length = 0;
  std::uint64_t entries = 0;      // validated against length
  std::uint64_t byte_offset = 0;  // where the frame starts in the message
  std::uint64_t byte_size = 0;    // the whole frame, header included
};

// Per-thread scratch for decoding (zstd contexts, staging buffers); reuse it across frames.
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

  [[nodiscard]] const MessageHeader& header() const noexcept { return header_; }
  [[nodiscard]] std::size_t frame_count() const noexcept { return frames_.size(); }
  [[nodiscard]] const FrameInfo& frame(std::size_t i) const { return frames_.at(i); }

  // Decodes frame i into the caller's buffers (each with room for frame(i).entries). Verifies
  // the checksum, decompresses, and checks that offsets are strictly ascending and < length
  // and that values are finite, all before the first write to `out_offsets`/`out_values`.
  // Returns the entry count. Throws ProtocolError (with the byte offset) on any violation.
  std::uint64_t decode_frame(std::size_t i, std::span<std::uint32_t> out_offsets,
                             std::span<float> out_values, DecodeScratch& scratch) const;

 private:
  std::span<const std::byte> bytes_;
  MessageHeader header_;
  std::vector<FrameInfo> frames_;
};

}  // namespace pulseloco::codec
