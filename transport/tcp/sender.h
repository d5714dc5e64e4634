// Sending for the TCP transport (internal header): an isend becomes frames queued for the peer
// (a message above the striping threshold is cut into chunks spread over all its connections),
// and each idle connection writes what is queued, several frames per system call (header and
// payload by one scatter-gather write, no copy). Payload checksums are computed on the I/O
// thread just before each write, or reused from the earlier operation an iforward names.
#pragma once

#include <boost/system/error_code.hpp>

#include <cstddef>
#include <memory>
#include <span>

#include <pulseloco/transport/tcp/operation.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport::tcp {

class Core;
class Lane;
struct Peer;

class Sender {
 public:
  explicit Sender(Core& core) noexcept : core_(core) {}

  // Queues a message for `op->peer` (or delivers it at once when that is this rank).
  // `forwarded`: an earlier operation on the same bytes whose checksums may serve (iforward):
  // a completed receive (the checksums verified on arrival) or a send (its checksums,
  // computed once for both); or null.
  void post(const std::shared_ptr<Operation>& op, std::span<const std::byte> data,
            const Operation* forwarded);

  // On the peer's strand: every idle connection to the peer takes frames from its queue.
  void pump(Peer& peer);
  // On the peer's strand: `lane` writes its next batch, its goodbye, or shuts its write side,
  // whichever is due.
  void start_write(Peer& peer, Lane& lane);
  // On the peer's strand: `lane` writes more of its batch.
  void continue_write(Peer& peer, Lane& lane);
  // On the peer's strand: sends FIN on `lane` (after its goodbye, or the peer's).
  void shut_write_side(Lane& lane);

 private:
  // A write gathers queued frames up to this many payload bytes / frames into one system call.
  static constexpr std::size_t kBatchBytes = 256 * 1024;
  static constexpr std::size_t kBatchFrames = 32;

  void deliver_to_self(Operation& op, std::span<const std::byte> data);
  // Under the test hook that holds writes (TcpTransport::hold_sends_after): what `lane` may
  // write now (none: it is held), taken off the hook's budget.
  [[nodiscard]] std::size_t limited_write(Peer& peer, Lane& lane, std::size_t wanted);
  void on_written(Peer& peer, Lane& lane, const boost::system::error_code& error,
                  std::size_t written);
  void batch_written(Peer& peer, Lane& lane);
  void write_goodbye(Peer& peer, Lane& lane);

  Core& core_;
};

}  // namespace pulseloco::transport::tcp
