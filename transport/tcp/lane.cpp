#include <pulseloco/transport/tcp/lane.h>

#include <algorithm>
#include <cstring>

#include <pulseloco/base/log.h>

namespace pulseloco::transport::tcp {

Lane::Lane(asio::io_context& io, int lane_index)
    : index(lane_index),
      link(io),
      staging_(std::make_unique_for_overwrite<std::byte[]>(kStagingBytes)) {}

void Lane::prepare_batch_write(int peer) {
  write_buffers_.clear();
  write_first_ = 0;
  corrupted_headers_.clear();
  corrupted_bytes_.clear();
  corrupted_headers_.reserve(batch.size());
  corrupted_bytes_.reserve(batch.size());
  for (Chunk& chunk : batch) {
    if (chunk.frame.has_payload_checksum)
      chunk.frame.payload_checksum = chunk.checksums->get(chunk.index, chunk.payload);
    chunk.header = encode_header(chunk.frame);
  }
  for (const Chunk& chunk : batch) {
    const auto& payload = chunk.payload;
    const bool corrupt_header =
        chunk.corrupt && (*chunk.corrupt == FrameCorruption::header || payload.empty());
    if (corrupt_header) {
      corrupted_headers_.push_back(chunk.header);
      corrupted_headers_.back()[20] ^= std::byte{0x01};  // a bit of the sequence number
      write_buffers_.emplace_back(asio::buffer(corrupted_headers_.back()));
    } else {
      write_buffers_.emplace_back(asio::buffer(chunk.header));
    }
    if (payload.empty()) continue;
    if (chunk.corrupt && !corrupt_header) {
      const std::size_t middle = payload.size() / 2;
      corrupted_bytes_.push_back({payload[middle] ^ std::byte{0x01}});
      if (middle > 0) write_buffers_.emplace_back(payload.data(), middle);
      write_buffers_.emplace_back(asio::buffer(corrupted_bytes_.back()));
      if (middle + 1 < payload.size())
        write_buffers_.emplace_back(payload.data() + middle + 1, payload.size() - middle - 1);
      logger().warn("tcp transport: test hook: corrupting a payload byte of a frame to peer {}",
                    peer);
    } else {
      write_buffers_.emplace_back(payload.data(), payload.size());
    }
    if (corrupt_header)
      logger().warn("tcp transport: test hook: corrupting a frame header to peer {}", peer);
  }
}

bool Lane::wrote(std::size_t written) noexcept {
  while (written > 0) {
    auto& buffer = write_buffers_[write_first_];
    if (written >= buffer.size()) {
      written -= buffer.size();
      ++write_first_;
    } else {
      buffer += written;
      written = 0;
    }
  }
  return write_first_ == write_buffers_.size();
}

asio::const_buffer Lane::goodbye_frame() {
  FrameHeader header;
  header.kind = FrameKind::goodbye;
  control_header_ = encode_header(header);
  return asio::buffer(control_header_);
}

asio::mutable_buffer Lane::staging_read_buffer() noexcept {
  if (staging_begin_ > 0) {
    const std::size_t kept = staging_end_ - staging_begin_;
    std::memmove(staging_.get(), staging_.get() + staging_begin_, kept);
    staging_begin_ = 0;
    staging_end_ = kept;
  }
  // Reading as much as staging holds would take in up to 64 KiB of the next frame's payload, to
  // be copied out again; bounded, the rest of a large frame goes straight to its destination
  // while small frames still arrive whole with their header.
  const std::size_t rest_of_frame = in_payload ? static_cast<std::size_t>(remaining) : 0;
  const std::size_t room =
      std::min(kStagingBytes - staging_end_, rest_of_frame + kFrameHeaderBytes + kDirectReadBytes);
  return asio::buffer(staging_.get() + staging_end_, room);
}

void Lane::arrived_directly(std::size_t n) noexcept {
  const std::span<const std::byte> arrived(target, n);
  target += n;
  remaining -= n;
  // Hashed before the next read is started: Asio performs that read at once when data is
  // waiting, and its copy would push these bytes out of the cache first. (The kernel reopens
  // the receive window when a read drains the socket, not when the next one is posted.)
  if (hashing) payload_digest.update(arrived);
}

std::optional<std::span<const std::byte, kFrameHeaderBytes>> Lane::staged_header() const noexcept {
  if (staging_end_ - staging_begin_ < kFrameHeaderBytes) return std::nullopt;
  return std::span<const std::byte, kFrameHeaderBytes>(staging_.get() + staging_begin_,
                                                       kFrameHeaderBytes);
}

void Lane::consume_header(const FrameHeader& header) noexcept {
  staging_begin_ += kFrameHeaderBytes;
  frame = header;
}

void Lane::begin_payload(const MessageKey& message, std::byte* destination, bool stashed) noexcept {
  key = message;
  target = destination;
  remaining = frame.chunk_bytes;
  in_payload = true;
  // The checksum is computed piece by piece as the bytes arrive, while they are in the cache.
  hashing = frame.has_payload_checksum && target != nullptr && frame.chunk_bytes > 0;
  stashing = stashed && frame.chunk_bytes > 0;
  if (hashing) payload_digest.reset();
}

void Lane::begin_abort_reason() {
  abort_reason.assign(frame.chunk_bytes, '\0');
  target = reinterpret_cast<std::byte*>(abort_reason.data());
  hashing = false;
  remaining = frame.chunk_bytes;
  in_payload = true;
}

std::size_t Lane::take_staged_payload() noexcept {
  const std::size_t take = staged_payload();
  std::size_t copied = 0;
  if (target != nullptr) {
    std::memcpy(target, staging_.get() + staging_begin_, take);
    copied = take;
    if (hashing) payload_digest.update(std::span<const std::byte>(target, take));
    target += take;
  }
  staging_begin_ += take;
  remaining -= take;
  return copied;
}

}  // namespace pulseloco::transport::tcp
