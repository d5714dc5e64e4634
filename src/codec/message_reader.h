// A window message read frame by frame from where it lies (a file of any size), never held whole:
// `pulseloco inspect` reads files with it. It validates as MessageView::parse and decode_frame do
// (docs/wire-format.md, "Validation a decoder must perform"), in an order that lets no size field
// cost memory before the bytes behind it are known to be there and intact:
//   - the header's first kHeaderPrefixBytes first (magic, version, counts), then the tensor table;
//   - each frame's prefix, checked against the limits and against the bytes left in the message,
//     before anything else of the frame is read;
//   - the frame's checksum, over pieces of at most kReadPieceBytes, before the frame is held
//     whole; then its streams and entries.
// So what a message costs in memory is the tensor table, one piece and the largest frame whose
// checksum matches (and decoding it), whatever its size or its header announce. A frame's
// stream directory is parsed once its checksum matched: an invalid directory is a frame that
// does not decode (next_frame() goes on), where MessageView::parse rejects the message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include <pulseloco/codec/message.h>

namespace pulseloco::codec {

class MessageReader {
 public:
  // Fills `destination` with the message's bytes from `offset`; throws when it cannot.
  using ReadAt = std::function<void(std::uint64_t offset, std::span<std::byte> destination)>;
  // The most bytes read at once while a frame is not yet known to be intact.
  static constexpr std::uint64_t kReadPieceBytes = std::uint64_t{1} << 20;

  // Reads and validates the header of a message of `size` bytes. ProtocolError as
  // MessageView::parse names it (bad magic, truncated, ...), with the byte offset.
  MessageReader(ReadAt read, std::uint64_t size, const DecodeLimits& limits);

  [[nodiscard]] const MessageHeader& header() const noexcept { return header_; }
  [[nodiscard]] std::uint64_t header_bytes() const noexcept { return header_bytes_; }
  [[nodiscard]] std::uint32_t announced_frame_count() const noexcept { return announced_frames_; }

  // Moves to the next frame and returns its prefix's description (index_bytes and value_bytes
  // are 0 until decode_frame()). ProtocolError when its prefix is invalid, it extends past the
  // message or it is out of order: the frames after it cannot be found. After the last announced
  // frame, nullopt when the message ends there, ProtocolError when bytes follow.
  [[nodiscard]] std::optional<FrameInfo> next_frame();

  // Goes back to before the first frame, for another pass over the message.
  void rewind() noexcept;

  // Verifies and decodes the frame next_frame() returned into `offsets` and `values`, resized to
  // its entries only once its checksum matched; returns its description with index_bytes and
  // value_bytes. ProtocolError when the frame does not decode; next_frame() can go on. A frame
  // of encoding `context` decodes against `context` (its chunk's θ_g, frame length values);
  // given none (a reader without the model's state), only its checksum and stream directory are
  // checked and no entries are returned.
  FrameInfo decode_frame(std::vector<std::uint32_t>& offsets, std::vector<float>& values,
                         DecodeScratch& scratch, std::span<const float> context = {});

 private:
  // The message's `n` bytes (at most one piece) from `offset`, from the read-ahead window, which
  // is refilled from `offset` when they are not in it. Valid until the next fetch.
  [[nodiscard]] std::span<const std::byte> fetch(std::uint64_t offset, std::uint64_t n);
  // ProtocolError unless the current frame's checksum matches, its bytes read piece by piece.
  void verify_checksum_in_pieces();

  ReadAt read_;
  std::uint64_t size_ = 0;
  DecodeLimits limits_;
  MessageHeader header_;
  std::uint64_t header_bytes_ = 0;
  std::uint32_t announced_frames_ = 0;
  std::uint32_t next_index_ = 0;  // frames moved past so far
  std::uint64_t next_offset_ = 0;
  std::optional<FrameInfo> current_;
  std::vector<std::byte> window_;  // read-ahead: the message's bytes from window_offset_
  std::uint64_t window_offset_ = 0;
  std::vector<std::byte> frame_;  // a frame larger than a piece, once its checksum matched
};

}  // namespace pulseloco::codec
