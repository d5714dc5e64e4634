// Receiving for the TCP transport (internal header): an irecv is matched with what has arrived
// (matcher.h), and each connection reads frames on its peer's strand, putting every payload
// where the matcher says (the receive's buffer, the early memory, or nowhere) and checking its
// checksum piece by piece as the bytes arrive.
//
// Large payloads are read straight into their destination (the caller's buffer when its irecv
// is posted); a read that completes is followed at once by the next one, tried without blocking
// and hashed while its bytes are in the cache, a few times in a row before the connection goes
// back to Asio. Right after a frame completes a receive, a frame that would be kept early waits
// for a new handler, so that the caller waiting for that receive runs first: it often posts
// that frame's irecv next.
#pragma once

#include <cstddef>
#include <memory>
#include <span>

#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/operation.h>

namespace pulseloco::transport::tcp {

class Core;
class Lane;
struct Peer;

class Receiver {
 public:
  explicit Receiver(Core& core) noexcept : core_(core) {}

  // Matches a receive for `op->peer` with what has arrived.
  void post(const std::shared_ptr<Operation>& op);

  // On the peer's strand: starts the next read on `lane`, unless it is closed or paused.
  void read_more(Peer& peer, Lane& lane);
  // On the peer's strand: the connections paused for lack of early memory go on.
  void resume_lanes(Peer& peer);

 private:
  // When a direct read completes, the next one is first tried at once (a non-blocking read on
  // the strand) and its bytes hashed right after, at most this many times in a row before the
  // lane goes back to Asio (fairness with the other connections, and a bounded stack): through
  // Asio, a completion handler runs behind whatever else is queued, and by then the bytes have
  // left the cache.
  static constexpr int kInlineDirectReads = 8;

  void on_read(Peer& peer, Lane& lane, const boost::system::error_code& error, std::size_t n,
               bool direct);
  // Takes every frame the bytes at hand complete, then reads on.
  void process(Peer& peer, Lane& lane);
  // Sets `lane` up for the payload of the frame whose header it just read; false: stop reading
  // (the lane paused, or the peer failed).
  bool begin_frame(Peer& peer, Lane& lane);
  // When the receive of a frame that is arriving into early memory has been posted since, the
  // rest goes straight into the receive's buffer.
  void read_rest_into_receive_if_posted(Peer& peer, Lane& lane);
  // The frame is complete: verifies its checksum and hands it to the matcher. True when it
  // completed a posted receive.
  [[nodiscard]] bool finish_frame(Peer& peer, Lane& lane);

  Core& core_;
};

}  // namespace pulseloco::transport::tcp
