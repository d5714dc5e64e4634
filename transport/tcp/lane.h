// Internal: one TCP connection of a transport to a peer (a "lane"; a peer has connections_per_peer
// of them), with the byte-level work of that one socket: cutting the incoming bytes into frames and
// putting each payload where it belongs, and writing queued frames with one scatter-gather write
// (internal header of the TCP transport). Whose bytes go where (the message matcher), when to
// read and write (the transport's sending and receiving units) and what a failure means (the
// transport's front) are decided elsewhere.
//
// Threading: the link and the reading and writing state belong to the peer's strand; the
// flags marked "lock" are read by other threads under the transport's lock.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/frame.h>
#include <pulseloco/transport/tcp/link_stream.h>
#include <pulseloco/transport/tcp/operation.h>
#include <pulseloco/transport/tcp/test_hooks.h>

namespace pulseloco::transport::tcp {

// A frame waiting to be written.
struct Chunk {
  std::shared_ptr<Operation> op;
  FrameHeader frame{};  // encoded (with the payload checksum) just before it is written
  EncodedHeader header{};
  std::span<const std::byte> payload;
  std::optional<FrameCorruption> corrupt;       // the test hook picked this frame
  std::shared_ptr<MessageChecksums> checksums;  // with payload checksums: frame `index` of these
  std::size_t index = 0;
};

class Lane {
 public:
  // Receive staging buffer: small frames are parsed out of it several at a time; payloads of at
  // least kDirectReadBytes are read straight into their destination.
  static constexpr std::size_t kStagingBytes = 64 * 1024;
  static constexpr std::size_t kDirectReadBytes = 16 * 1024;
  // A direct read takes at most this much, so that the payload checksum reads the bytes while
  // the kernel's copy has left them in this core's cache; uncapped, one read could take the
  // rest of a 512 KiB frame, and the hash then find much of it evicted (by the next read, or by
  // another process on the core).
  static constexpr std::size_t kDirectReadMaxBytes = 128 * 1024;

  Lane(asio::io_context& io, int index);

  const int index;  // which of the connections to its peer
  LinkStream link;  // the connection (TLS or plain)

  // --- State (lock) ----------------------------------------------------------------------------
  bool connected = false;
  bool closed = false;
  bool writing = false;
  bool write_shut = false;  // we sent FIN
  bool shut_after_write = false;
  bool goodbye_wanted = false;
  bool paused = false;  // too many early bytes: waiting for an irecv or for room
  bool goodbye_received = false;
  bool abort_received = false;
  bool eof = false;
  MessageKey key{};  // the message of the frame being read (the one a paused lane waits for)
  std::vector<Chunk> batch;  // the frames being written

  // Whether this lane can start writing now.
  [[nodiscard]] bool idle_writer() const noexcept {
    return connected && !closed && !writing && !write_shut;
  }

  // --- Writing (strand) ------------------------------------------------------------------------
  // Encodes the batch's headers (with their payload checksums, computed now so that the
  // kernel's copy finds the bytes in cache) and lays out header, payload, header, payload, ...
  // straight from the callers' buffers; the test hook swaps in a corrupted copy of one header
  // or one payload byte. `peer` only names the peer in the hook's log line.
  void prepare_batch_write(int peer);
  // What is left to write of the batch.
  [[nodiscard]] std::span<const asio::const_buffer> unwritten() const noexcept {
    return {write_buffers_.data() + write_first_, write_buffers_.size() - write_first_};
  }
  // `written` more bytes went out; true when the whole batch has.
  [[nodiscard]] bool wrote(std::size_t written) noexcept;
  // The goodbye frame, encoded in memory of the lane's own.
  [[nodiscard]] asio::const_buffer goodbye_frame();
  Clock::time_point last_write_progress{};

  // --- Reading (strand) ------------------------------------------------------------------------
  FrameHeader frame{};  // the frame being read
  bool in_payload = false;
  std::byte* target = nullptr;  // where the rest of the payload goes; null: drop it
  bool hashing = false;         // the frame's payload checksum is being computed
  bool stashing = false;        // the payload goes to early memory (no irecv when it began)
  int inline_reads = 0;         // nested inline direct reads in progress
  std::uint64_t remaining = 0;  // payload bytes of the frame still to come
  std::string abort_reason;     // the payload of an abort frame
  DigestStream payload_digest;
  Clock::time_point last_read_progress{};

  // Whether the next read goes straight to the payload's destination rather than to staging.
  [[nodiscard]] bool reads_directly() const noexcept {
    return in_payload && target != nullptr && staging_begin_ == staging_end_ &&
           remaining >= kDirectReadBytes;
  }
  [[nodiscard]] asio::mutable_buffer direct_read_buffer() const noexcept {
    return asio::buffer(
        target, static_cast<std::size_t>(std::min<std::uint64_t>(remaining, kDirectReadMaxBytes)));
  }
  // Room for the next read into staging (moving what is left to its front). Bounded to the
  // rest of the current frame, a header and a small frame, so that the rest of a large frame
  // goes straight to its destination rather than through staging.
  [[nodiscard]] asio::mutable_buffer staging_read_buffer() noexcept;
  // `n` bytes arrived by a direct read (hashed now, while they are in the cache) or into
  // staging.
  void arrived_directly(std::size_t n) noexcept;
  void arrived_in_staging(std::size_t n) noexcept { staging_end_ += n; }

  // The next frame header, when staging holds a whole one.
  [[nodiscard]] std::optional<std::span<const std::byte, kFrameHeaderBytes>> staged_header()
      const noexcept;
  // The header staged_header() showed is `header`: its payload follows.
  void consume_header(const FrameHeader& header) noexcept;
  // Starts the payload of a data frame: `chunk_bytes` bytes for `target` (null: drop them).
  void begin_payload(const MessageKey& message, std::byte* destination, bool stashed) noexcept;
  // Starts the payload of an abort frame (the reason).
  void begin_abort_reason();
  // Payload bytes of the current frame waiting in staging.
  [[nodiscard]] std::size_t staged_payload() const noexcept {
    return static_cast<std::size_t>(
        std::min<std::uint64_t>(remaining, staging_end_ - staging_begin_));
  }
  // Moves them to the target (hashing them); returns the bytes copied (0 when dropped).
  std::size_t take_staged_payload() noexcept;
  // In the middle of a frame (for the io_timeout check).
  [[nodiscard]] bool mid_frame() const noexcept {
    return in_payload || staging_end_ > staging_begin_;
  }

 private:
  std::vector<asio::const_buffer> write_buffers_;
  std::size_t write_first_ = 0;
  std::vector<EncodedHeader> corrupted_headers_;
  std::vector<std::array<std::byte, 1>> corrupted_bytes_;
  EncodedHeader control_header_{};

  std::unique_ptr<std::byte[]> staging_;
  std::size_t staging_begin_ = 0;
  std::size_t staging_end_ = 0;
};

}  // namespace pulseloco::transport::tcp
