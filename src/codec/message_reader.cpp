#include <pulseloco/codec/message_reader.h>

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <utility>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/codec/message_parse.h>
#include <pulseloco/codec/wire.h>

namespace pulseloco::codec {

MessageReader::MessageReader(ReadAt read, std::uint64_t size, const DecodeLimits& limits)
    : read_(std::move(read)), size_(size), limits_(limits) {
  detail::check_message_size(size_, limits_);
  const auto prefix_bytes = fetch(0, std::min<std::uint64_t>(size_, kHeaderPrefixBytes));
  const detail::HeaderPrefix prefix = detail::parse_header_prefix(prefix_bytes, limits_);
  // Bounded by limits.max_tensors (8 MiB for 2^20 tensors), and never beyond the message.
  std::vector<std::byte> header(std::min(prefix.header_bytes, size_));
  read_(0, header);
  header_ = detail::parse_header(header, prefix);
  header_bytes_ = prefix.header_bytes;
  announced_frames_ = prefix.frame_count;
  next_offset_ = header_bytes_;
}

std::span<const std::byte> MessageReader::fetch(std::uint64_t offset, std::uint64_t n) {
  PULSELOCO_CHECK(n <= kReadPieceBytes && offset <= size_ && n <= size_ - offset,
                  "message reader: a read beyond one piece or the message");
  if (offset < window_offset_ || offset + n > window_offset_ + window_.size()) {
    window_offset_ = offset;
    window_.resize(static_cast<std::size_t>(std::min(kReadPieceBytes, size_ - offset)));
    read_(offset, window_);
  }
  return std::span<const std::byte>(window_).subspan(
      static_cast<std::size_t>(offset - window_offset_), static_cast<std::size_t>(n));
}

std::optional<FrameInfo> MessageReader::next_frame() {
  if (next_index_ == announced_frames_) {
    if (next_offset_ != size_)
      detail::fail_bytes_after_frames(announced_frames_, next_offset_, size_);
    current_.reset();
    return std::nullopt;
  }
  if (size_ - next_offset_ < kFramePrefixBytes) {
    detail::fail_truncated_frame(next_index_, announced_frames_, next_offset_,
                                 next_offset_ + kFramePrefixBytes, size_);
  }
  const detail::FrameParse parsed = detail::parse_frame(
      fetch(next_offset_, kFramePrefixBytes), next_offset_, header_, limits_, next_index_);
  if (parsed.needed > size_) {
    detail::fail_truncated_frame(next_index_, announced_frames_, next_offset_, parsed.needed,
                                 size_);
  }
  detail::check_frame_order(current_ ? &*current_ : nullptr, parsed.info, next_index_);
  current_ = parsed.info;
  next_offset_ += parsed.info.byte_size;
  ++next_index_;
  return current_;
}

void MessageReader::rewind() noexcept {
  next_index_ = 0;
  next_offset_ = header_bytes_;
  current_.reset();
}

void MessageReader::verify_checksum_in_pieces() {
  const FrameInfo& info = *current_;
  const std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                       &XXH3_freeState);
  if (!state || XXH3_64bits_reset(state.get()) != XXH_OK) throw std::bad_alloc();
  const std::uint64_t covered = info.byte_size - kChecksumBytes;
  for (std::uint64_t at = 0; at < covered; at += kReadPieceBytes) {
    const auto piece = fetch(info.byte_offset + at, std::min(kReadPieceBytes, covered - at));
    (void)XXH3_64bits_update(state.get(), piece.data(), piece.size());
  }
  const auto recorded = fetch(info.byte_offset + covered, kChecksumBytes);
  if (load_le<std::uint64_t>(recorded.data()) != XXH3_64bits_digest(state.get())) {
    detail::fail_checksum(next_index_ - 1, info.byte_offset + covered);
  }
}

FrameInfo MessageReader::decode_frame(std::vector<std::uint32_t>& offsets,
                                      std::vector<float>& values, DecodeScratch& scratch,
                                      std::span<const float> context) {
  PULSELOCO_CHECK(current_.has_value(), "MessageReader::decode_frame without a frame");
  const std::size_t index = next_index_ - 1;
  const FrameInfo& announced = *current_;
  verify_checksum_in_pieces();
  // Intact: now it may be held whole (a frame within one piece is used where it was read).
  std::span<const std::byte> frame;
  if (announced.byte_size <= kReadPieceBytes) {
    frame = fetch(announced.byte_offset, announced.byte_size);
  } else {
    frame_.resize(static_cast<std::size_t>(announced.byte_size));
    read_(announced.byte_offset, frame_);
    frame = frame_;
  }
  const detail::FrameParse parsed =
      detail::parse_frame(frame, announced.byte_offset, header_, limits_, index);
  if (parsed.info.encoding == Encoding::context && context.empty()) {
    offsets.clear();
    values.clear();
    return parsed.info;
  }
  offsets.resize(static_cast<std::size_t>(parsed.info.entries));
  values.resize(static_cast<std::size_t>(parsed.info.entries));
  (void)detail::decode_frame(frame, parsed.info, index, offsets, values, scratch, context);
  return parsed.info;
}

}  // namespace pulseloco::codec
