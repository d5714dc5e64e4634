// Internal: one isend or irecv of the TCP transport, and the payload checksums a message's frames
// share (internal header of tcp_transport.cpp and its parts).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport::tcp {

// A message between two ranks: the n-th message sent to a peer under a tag is (tag, n).
struct MessageKey {
  Tag tag = 0;
  std::uint64_t sequence = 0;
  friend bool operator==(const MessageKey&, const MessageKey&) = default;
};

struct MessageKeyHash {
  std::size_t operator()(const MessageKey& key) const noexcept {
    return std::hash<std::uint64_t>{}(key.tag * 0x9E3779B97F4A7C15ULL ^ key.sequence);
  }
};

// A received frame whose payload checksum matched: forwarding the same bytes may reuse it.
struct VerifiedFrame {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  Digest checksum = 0;
};

// The payload checksums of one sent message, frame by frame, computed once by whichever write
// needs one first: sends of the same bytes to several peers (iforward of a send) share them,
// and a forwarded receive's frames start with the checksums verified on arrival.
//
// Why atomics and not std::call_once: glibc's pthread_once ends every first call with a
// futex_wake system call, whether or not anyone waits, which would cost one system call per
// frame sent. Writes to different peers run on different strands, so two threads may both find
// a cell unknown and both hash the frame: they store the same value (the digest of the same,
// unchanged bytes), so the race costs a duplicate hash and nothing else.
struct MessageChecksums {
  struct Cell {
    std::atomic<bool> known{false};
    std::atomic<Digest> value{0};
  };
  explicit MessageChecksums(std::size_t frames)
      : cells(std::make_unique<Cell[]>(frames)), count(frames) {}
  Digest get(std::size_t frame, std::span<const std::byte> payload) {
    Cell& cell = cells[frame];
    if (cell.known.load(std::memory_order_acquire))
      return cell.value.load(std::memory_order_relaxed);
    const Digest value = digest_bytes(payload);
    set_known(frame, value);
    return value;
  }
  void set_known(std::size_t frame, Digest value) {
    Cell& cell = cells[frame];
    cell.value.store(value, std::memory_order_relaxed);
    cell.known.store(true, std::memory_order_release);
  }
  std::unique_ptr<Cell[]> cells;
  std::size_t count;
};

// One isend or irecv. Guarded by the transport's lock.
struct Operation {
  bool is_send = false;
  int peer = 0;
  Tag tag = 0;
  std::uint64_t sequence = 0;
  std::uint64_t bytes = 0;
  Clock::time_point posted_at = Clock::now();
  bool done = false;
  std::exception_ptr error;
  // Sends.
  std::uint64_t chunks_left = 0;
  std::uint64_t bytes_written = 0;
  const std::byte* send_data = nullptr;
  std::shared_ptr<MessageChecksums> checksums;  // with payload checksums, to another rank
  // Receives.
  std::span<std::byte> recv_buffer;
  std::uint64_t bytes_arrived = 0;
  std::unique_ptr<std::byte[]> stash_to_copy;  // arrived early; the waiting thread copies it
  std::uint64_t stash_bytes = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> copy_ranges;  // [begin, end); none: all
  std::vector<VerifiedFrame> verified_frames;  // once complete: the frames checked on arrival

  // Still waiting for its bytes (neither done, failed, nor holding early bytes to copy).
  [[nodiscard]] bool pending() const noexcept { return !done && !error && !stash_to_copy; }
};

}  // namespace pulseloco::transport::tcp
