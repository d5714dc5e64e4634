// The TCP backend: a full mesh of authenticated TCP connections driven by a Boost.Asio
// io_context, which a caller waiting on a request runs itself, and options.io_threads I/O
// threads run while nobody waits (tcp/progress.h says why). It is made of parts with one job
// each, all in tcp/:
//
//  - mesh formation (mesh.h): the data listener (listener.h), then the lower rank of every pair
//    opens options.connections_per_peer connections to the higher one, retrying until the
//    connect timeout; every connection passes the HMAC-SHA256 challenge-response
//    (handshake.h). The group's table (this rank, every rank's listener, the group id) comes
//    from the group layer (<pulseloco/group/make_transport.h> finds it by a rendezvous); the
//    transport only uses it.
//  - the connections (lane.h): framing (frame.h: a 64-byte header with xxh3-64 of the payload
//    chunk and of the header itself) and the reads and scatter-gather writes of one socket.
//    Messages above options.stripe_threshold_bytes are cut into chunks spread over all the
//    connections to the peer and reassembled in place.
//  - sending (sender.h) and receiving (receiver.h), and matching the messages that arrive with
//    the receives posted for them, early messages included (matcher.h).
//  - this front: requests, and the failure policy. EOF or reset on any connection to a peer
//    fails every pending and future operation with that peer with PeerLostError naming it
//    (messages that had fully arrived can still be received); a frame that breaks the protocol
//    is a ProtocolError naming the peer, which is told why and dropped; abort() tells the peers
//    why before closing. Destruction says goodbye to every peer and waits (at most 10 s) until
//    each has read everything sent to it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <pulseloco/transport/tcp/group_table.h>
#include <pulseloco/transport/tcp/tcp_options.h>
#include <pulseloco/transport/tcp/test_hooks.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

namespace tcp {
class Core;
struct Operation;
}  // namespace tcp

// Finds the group once this rank's data listener is bound: given the listener's port, returns
// the group's table (the group layer's rendezvous).
using FindGroup = std::function<GroupTable(std::uint16_t listen_port)>;

class TcpTransport final : public Transport {
 public:
  // Binds the data listener on options.listen_addr:options.listen_port, calls `find_group`
  // with its port and connects the mesh of the table it returns. Blocks until every connection
  // is authenticated; throws TimeoutError naming the missing peers when that takes longer than
  // `connect_timeout` from the call (the rendezvous included).
  TcpTransport(const TcpOptions& options, const FindGroup& find_group,
               std::chrono::milliseconds connect_timeout);
  // The same for a table known before this rank listens (a peer list): the listener binds the
  // port the table gives this rank (no listener for a group of one).
  TcpTransport(const TcpOptions& options, GroupTable table,
               std::chrono::milliseconds connect_timeout);
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
  // In the order in which their connections failed here (read, write or handshake errors, a
  // close without a goodbye, an abort frame, io_timeout, a protocol violation); a peer whose
  // every connection said goodbye is not lost.
  [[nodiscard]] std::vector<int> lost_peers() const override;

  // The port of the data listener (0 for a group of one).
  [[nodiscard]] std::uint16_t listen_port() const noexcept;
  // The id every connection of this group presents.
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
  // Message counters kept, one per (peer, tag, direction) in use (retire_tag drops them).
  [[nodiscard]] std::size_t tag_counters() const;

  // Test hook (test_hooks.h): flips one bit of the hook.frame_index-th data frame sent after
  // this call.
  void corrupt_outgoing_frame(CorruptFrame hook);
  // Test hook: the data plane writes at most `bytes` more (frame headers included) to its
  // peers, then holds every write until release_sends(), so that a test can have a message
  // arrive in part. Goodbye and abort frames are not held; a transport whose writes are held
  // cannot close cleanly (its goodbye waits for the held frames).
  void hold_sends_after(std::uint64_t bytes);
  void release_sends();

 private:
  // isend, and iforward with the earlier operation when it is one of this transport's.
  [[nodiscard]] std::unique_ptr<Request> post_send(int peer, Tag tag,
                                                   std::span<const std::byte> data,
                                                   const tcp::Operation* forwarded);

  std::shared_ptr<tcp::Core> core_;
};

}  // namespace pulseloco::transport
