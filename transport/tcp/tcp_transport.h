// The TCP backend: a full mesh of authenticated TCP connections driven by a Boost.Asio
// io_context, which a caller waiting on a request runs itself, and options.io_threads I/O
// threads run while nobody waits (tcp/progress.h says why).
//
//  - Group formation: bind the data listener, run the rendezvous (rendezvous.h), then the lower
//    rank of every pair opens options.connections_per_peer connections to the higher one,
//    retrying until options.connect_timeout; every connection passes the HMAC-SHA256
//    challenge-response (tcp/handshake.h). The listener keeps refusing (and logging) strangers
//    for the transport's whole life without disturbing the group.
//  - Framing (tcp/frame.h): 64-byte header with xxh3-64 of the payload chunk and of the header
//    itself; any violation becomes a ProtocolError naming the peer and ends the connections to
//    it. Messages above options.stripe_threshold_bytes are cut into chunks spread over all the
//    connections to the peer and reassembled in place.
//  - Matching: the n-th message sent to a peer under a tag matches the n-th irecv posted for that
//    (peer, tag). A frame whose irecv is posted is read straight into the caller's buffer; an
//    early one is kept (up to options.max_unexpected_bytes in all, then reading from that
//    connection pauses until a matching irecv is posted) and copied when the receive completes;
//    when the irecv is posted while its message is arriving, the remaining chunks go straight
//    into the caller's buffer and only the early ones are copied. Right after a frame completes
//    a receive, a frame that would be kept early waits for a new handler, so that the caller
//    waiting for that receive runs first: it often posts that frame's irecv next.
//  - Sending writes header and payload with one scatter-gather write (no copy), several small
//    frames per system call when they queue up. Payload checksums are computed on the I/O
//    thread just before each write (the kernel then copies bytes that are in cache), and on the
//    receiving side piece by piece as the bytes arrive.
//  - Failures: EOF or reset on any connection to a peer fails every pending and future
//    operation with that peer with PeerLostError naming it (messages that had fully arrived can
//    still be received); abort() tells the peers why before closing. Destruction says goodbye
//    to every peer and waits (at most 10 s) until each has read everything sent to it.
#pragma once

#include <cstdint>
#include <memory>

#include <pulseloco/transport/factory.h>
#include <pulseloco/transport/rendezvous.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

class TcpTransport final : public Transport {
 public:
  // Binds the listener, runs the rendezvous `options` select (resolve_rendezvous) and connects
  // the mesh. Blocks until every connection is authenticated or options.connect_timeout passes.
  explicit TcpTransport(const TransportOptions& options);
  ~TcpTransport() override;
  TcpTransport(const TcpTransport&) = delete;
  TcpTransport& operator=(const TcpTransport&) = delete;

  [[nodiscard]] int rank() const noexcept override;
  [[nodiscard]] int size() const noexcept override;
  [[nodiscard]] std::string_view backend() const noexcept override { return "tcp"; }

  [[nodiscard]] std::unique_ptr<Request> isend(int peer, Tag tag,
                                               std::span<const std::byte> data) override;
  [[nodiscard]] std::unique_ptr<Request> irecv(int peer, Tag tag,
                                               std::span<std::byte> data) override;
  // Reuses the payload checksums verified when `earlier`'s frames arrived, for the frames
  // whose offset and length the outgoing message repeats; or, when `earlier` is a send of the
  // same bytes, shares its checksums (each frame's is computed once, by the first write).
  [[nodiscard]] std::unique_ptr<Request> iforward(int peer, Tag tag,
                                                  std::span<const std::byte> data,
                                                  const Request& earlier) override;
  void retire_tag(Tag tag) noexcept override;
  void abort(std::string_view reason) noexcept override;
  [[nodiscard]] TransportStats stats() const override;

  // The port of the data listener.
  [[nodiscard]] std::uint16_t listen_port() const noexcept;
  // Every rank's data listener, in rank order.
  [[nodiscard]] const std::vector<PeerAddress>& peer_addresses() const noexcept;
  // The id every connection of this group presents (from the rendezvous).
  [[nodiscard]] GroupId group_id() const noexcept;
  // Connections refused by the data listener so far (authentication failures, strangers).
  [[nodiscard]] int refused_connections() const noexcept;
  // Bytes currently held for messages whose irecv is not posted yet.
  [[nodiscard]] std::size_t unexpected_bytes() const;
  // Payload bytes received so far that this transport copied itself (the rest the kernel wrote
  // straight into the receive's buffer), counted per copy: those that arrived in the staging
  // buffer with a frame header or a short frame tail, and what arrived of a message before its
  // irecv was posted, when copied out of the memory kept for it (bytes that also came through
  // the staging buffer count twice). Self-sends count too.
  [[nodiscard]] std::uint64_t payload_bytes_copied() const noexcept;
  // Callers now inside a request's wait() (they drive the io_context; tcp/progress.h).
  [[nodiscard]] int callers_waiting() const noexcept;
  // Message counters kept, one per (peer, tag, direction) in use (retire_tag drops them).
  [[nodiscard]] std::size_t tag_counters() const;

  // Test hook: flips one bit of the hook.frame_index-th data frame sent after this call.
  void corrupt_outgoing_frame(CorruptFrame hook);

  class Core;

 private:
  std::shared_ptr<Core> core_;
};

}  // namespace pulseloco::transport
