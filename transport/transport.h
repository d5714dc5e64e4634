// The transport interface: tagged point-to-point byte messages between the ranks of one group,
// non-blocking with deadlines, in the manner of NCCL's net plugins. Each backend implements it
// in a folder of its own (tcp/, inproc/, and the libraries mpi/ and nccl/). A transport moves
// bytes: it knows where its buffers must live (a Device) but nothing of tensors, windows or
// collectives.
//
// Failure semantics: every wait has a deadline. A dead, stalled or misbehaving peer turns into
// TimeoutError, PeerLostError or ProtocolError naming that peer; abort() makes every pending and
// future operation fail promptly. Nothing partial is ever reported as success.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <pulseloco/base/device.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::transport {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
using Tag = std::uint64_t;

[[nodiscard]] inline Deadline deadline_after(std::chrono::milliseconds timeout) {
  return Clock::now() + timeout;
}

// Bytes this transport moved since it was created. "payload" counts what callers handed to
// isend/received through irecv; "wire" adds every framing, header and handshake byte (over TLS:
// the bytes through the TLS stream, without TLS's own records and handshake).
struct TransportStats {
  std::uint64_t payload_bytes_sent = 0;
  std::uint64_t payload_bytes_received = 0;
  std::uint64_t wire_bytes_sent = 0;
  std::uint64_t wire_bytes_received = 0;
  std::uint64_t messages_sent = 0;
  std::uint64_t messages_received = 0;
};

// An operation in flight. Destroying an unfinished request cancels interest in it; the buffer
// may then be reused only after the transport is aborted or destroyed.
class Request {
 public:
  virtual ~Request() = default;
  // True once complete; throws the operation's error if it failed.
  [[nodiscard]] virtual bool test() = 0;
  // Blocks until complete; throws TimeoutError once `deadline` passes (naming the peer), or the
  // operation's error.
  virtual void wait(Deadline deadline) = 0;
};

class Transport {
 public:
  virtual ~Transport() = default;

  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int size() const noexcept = 0;
  [[nodiscard]] virtual std::string_view backend() const noexcept = 0;  // "tcp", "mpi", "nccl"
  // Where message buffers must live (the CPU, or the GPU for NCCL).
  [[nodiscard]] virtual Device buffer_device() const noexcept { return Device{}; }
  // True when messages between two ranks match by posting order, not by tag (NCCL): the k-th
  // message a rank sends to a peer fills the k-th receive that peer posts from it, whatever the
  // tags, and sizes must agree. Operations are launched in groups that complete as a whole, one
  // group after the other (a send completes only once its receive is launched). Such a
  // transport offers native collectives
  // (native_collectives.h); the collectives then post their point-to-point messages (headers
  // and the completion round) in an order both sides agree on, and move payloads through the
  // native collectives.
  [[nodiscard]] virtual bool matches_by_order() const noexcept { return false; }

  // Sends `data` to `peer` under `tag`. The buffer must stay valid and unchanged until done.
  [[nodiscard]] virtual std::unique_ptr<Request> isend(int peer, Tag tag,
                                                       std::span<const std::byte> data) = 0;
  // Receives the message `peer` sent under `tag` into `data`; the message must be exactly
  // data.size() bytes (else ProtocolError). Messages with equal (peer, tag) arrive in order.
  [[nodiscard]] virtual std::unique_ptr<Request> irecv(int peer, Tag tag,
                                                       std::span<std::byte> data) = 0;

  // Sends `data` as isend does, where `data` is exactly the bytes of `earlier` and has not
  // changed since: either a completed irecv into them (the ring collectives forward most of
  // what they receive) or an isend or iforward of them to another peer (the direct
  // collectives send the same bytes to every peer). A transport that checksums its frames may
  // then reuse the checksums it verified on arrival, or computed for the earlier send, instead
  // of computing them again. When `earlier` is neither for exactly `data`, this is a plain
  // isend.
  [[nodiscard]] virtual std::unique_ptr<Request> iforward(int peer, Tag tag,
                                                          std::span<const std::byte> data,
                                                          const Request& earlier) {
    (void)earlier;
    return isend(peer, tag, data);
  }

  // Says that no operation will be posted under `tag` again and that every one posted under it
  // has completed, so that the transport may forget what it keeps per tag (the TCP transport's
  // message counters, which would otherwise grow with every collective call, each of which
  // uses tags of its own). A message that still arrives under it is held unmatched, as any
  // message whose receive is never posted.
  virtual void retire_tag(Tag tag) noexcept { (void)tag; }

  // Fails every pending and future operation with AbortedError(reason).
  virtual void abort(std::string_view reason) noexcept = 0;
  // abort(), saying which peer the caller holds responsible and how it failed (the collectives'
  // verdict; -1: none). A view of a larger group (SubgroupTransport, subgroup.h) passes it to its
  // owner, who can tell the rest of the group before the parent goes down; any other transport
  // just aborts.
  virtual void abort_blaming(int peer, ErrorKind kind, std::string_view reason) noexcept {
    (void)peer;
    (void)kind;
    abort(reason);
  }

  // The peers this transport has lost, in the order in which it found out: their connections
  // closed without a goodbye (the peer died, or aborted), broke, or were failed by the transport
  // itself (a stalled or misbehaving peer). A peer that closed its transport in an orderly way
  // is not lost. When several peers are lost, the first is the likely cause: a survivor that
  // failed because of it leaves too. Empty for a backend that cannot tell (MPI: a dead rank
  // usually ends the whole job; NCCL).
  [[nodiscard]] virtual std::vector<int> lost_peers() const { return {}; }

  [[nodiscard]] virtual TransportStats stats() const = 0;

  // Blocking helpers.
  void send(int peer, Tag tag, std::span<const std::byte> data, Deadline deadline) {
    isend(peer, tag, data)->wait(deadline);
  }
  void recv(int peer, Tag tag, std::span<std::byte> data, Deadline deadline) {
    irecv(peer, tag, data)->wait(deadline);
  }

  // Numbers the collective calls made under base tag `base_tag` on this transport: 0, 1, 2, ...
  // Every rank makes the same calls in the same order under one base tag, so all ranks agree on
  // the numbers (as with Gloo's Context::nextSlot); collectives put them into their tags so that
  // a failed call's stragglers can never be taken for a later call's messages. A view over
  // another transport (SubgroupTransport, subgroup.h) numbers its calls from a first number of
  // its own, so that they do not reuse its parent's tags.
  [[nodiscard]] virtual std::uint64_t next_sequence(Tag base_tag) {
    const std::lock_guard lock(sequence_mutex_);
    return sequences_[base_tag]++;
  }

 private:
  std::mutex sequence_mutex_;
  std::unordered_map<Tag, std::uint64_t> sequences_;
};

}  // namespace pulseloco::transport
