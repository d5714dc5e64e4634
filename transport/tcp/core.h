// The state of one TCP transport, shared by its parts (internal header): the front
// (tcp_transport.cpp: construction, waiting, the failure policy and closing), mesh formation
// (mesh.h), sending (sender.h), receiving (receiver.h) and, per peer, the message matcher
// (matcher.h) and the connections (lane.h).
//
// Threading: the io_context is run by a caller waiting on a request or by the I/O threads
// (progress.h). Everything of a peer's connections runs on the peer's strand; the listener and
// the io_timeout check run on the control strand. The fields marked "lock" are guarded by
// mutex_; notify_waiters() is called without it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/group_table.h>
#include <pulseloco/transport/tcp/lane.h>
#include <pulseloco/transport/tcp/matcher.h>
#include <pulseloco/transport/tcp/mesh.h>
#include <pulseloco/transport/tcp/operation.h>
#include <pulseloco/transport/tcp/progress.h>
#include <pulseloco/transport/tcp/receiver.h>
#include <pulseloco/transport/tcp/sender.h>
#include <pulseloco/transport/tcp/tcp_options.h>
#include <pulseloco/transport/tcp/test_hooks.h>

namespace pulseloco::transport::tcp {

struct Peer {
  Peer(asio::io_context& io, int peer_rank, ErrorContext context, UnexpectedBytes& unexpected)
      : rank(peer_rank), strand(asio::make_strand(io)), messages(std::move(context), unexpected) {}
  const int rank;
  asio::strand<asio::io_context::executor_type> strand;
  std::vector<std::unique_ptr<Lane>> lanes;  // none for this rank itself
  MessageMatcher messages;                   // lock
  std::deque<Chunk> send_queue;              // lock
  std::exception_ptr failure;  // lock: every pending and future operation with it fails
  std::string abort_reason;    // strand: the peer sent an abort frame with this reason
  bool stalled = false;        // lock: an operation with it timed out; closing does not wait
};

class Core {
 public:
  explicit Core(const TcpOptions& options);
  ~Core();
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  // --- Formation -------------------------------------------------------------------------------
  // Connects the mesh of `table`; blocks until it is complete, or throws.
  void form(GroupTable table, Deadline deadline);

  // --- Requests (core.cpp) ---------------------------------------------------------------------
  [[nodiscard]] bool test(Operation& op);
  void wait(Operation& op, Deadline deadline);
  void abandon(const std::shared_ptr<Operation>& op) noexcept;
  // A receive completed: marks it done and counts it. Under the lock.
  void complete_receive_locked(Operation& op);
  // Applies what a matcher call changed (under the lock); true when a waiter must be woken.
  bool apply_locked(const MatchOutcome& outcome);
  // Early bytes were given back: connections paused for room go on. Under the lock.
  void early_bytes_released_locked();
  // Wakes whoever waits on an operation or on the transport's state: threads blocked on
  // changed_, and callers driving the io_context (tcp/progress.h). Call without mutex_ held.
  void notify_waiters() {
    changed_.notify_all();
    progress_.completion_happened();
  }
  [[nodiscard]] TransportStats stats() const;
  void retire_tag(Tag tag) noexcept;
  [[nodiscard]] std::size_t tag_counters() const;
  [[nodiscard]] std::size_t unexpected_bytes() const;
  void corrupt_outgoing_frame(CorruptFrame hook);
  void hold_sends_after(std::uint64_t bytes);
  void release_sends();

  // --- Failure policy and closing (tcp_transport.cpp) ------------------------------------------
  // A connection's read or write failed (EOF, reset, ...). On the peer's strand.
  void on_lane_error(Peer& peer, Lane& lane, const boost::system::error_code& error,
                     std::string_view doing);
  // The peer said goodbye on every connection: it sent everything it will send.
  void on_goodbye_from_all(Peer& peer);
  // The peer's abort frame arrived on `lane`. On the peer's strand.
  void end_lane_after_abort(Peer& peer, Lane& lane);
  // The peer's frames break the protocol: tell it why and fail it. On the peer's strand.
  void protocol_violation(Peer& peer, const std::string& problem,
                          std::optional<std::uint64_t> offset = std::nullopt);
  void abort(std::string_view reason) noexcept;
  // Destruction: says goodbye, waits for the peers to read everything, stops the threads.
  void shutdown() noexcept;

  // The TLS context of a data-plane link over `socket`: none when links are plaintext, or when
  // same-host links are (options_.same_host_plaintext) and this one is.
  [[nodiscard]] std::shared_ptr<TlsContext> link_tls(const Socket& socket) const {
    if (!tls_ || (options_.same_host_plaintext && same_host_link(socket))) return nullptr;
    return tls_;
  }

  [[nodiscard]] ErrorContext context_for(int peer) const {
    return ErrorContext{.rank = rank_, .peer = peer};
  }
  [[nodiscard]] std::exception_ptr peer_lost(int peer, std::string_view message) const {
    return std::make_exception_ptr(PeerLostError(message, context_for(peer)));
  }

  // --- State -----------------------------------------------------------------------------------
  const TcpOptions options_;
  const std::shared_ptr<TlsContext> tls_;  // null: plain links
  const int lanes_per_peer_;
  std::chrono::milliseconds connect_timeout_{0};  // the formation's budget, for its errors
  int rank_ = 0;
  int size_ = 1;
  GroupId group_id_{};
  std::vector<PeerAddress> addresses_;
  std::uint16_t listen_port_ = 0;

  asio::io_context io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  // Runs io_: the I/O threads, or a caller busy-polling in wait() (tcp/progress.h).
  Progress progress_;
  // The listener and the io_timeout check live on this strand (there may be several I/O
  // threads).
  asio::strand<asio::io_context::executor_type> control_;
  std::optional<asio::steady_timer> progress_timer_;
  std::vector<std::unique_ptr<Peer>> peers_;  // by rank; our own entry holds self-messages

  Mesh mesh_{*this};
  Sender sender_{*this};
  Receiver receiver_{*this};

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::exception_ptr aborted_;          // lock
  bool closing_ = false;                // lock
  bool shut_down_ = false;              // lock
  bool formed_ = false;                 // lock: the whole mesh was connected
  std::exception_ptr formation_error_;  // lock
  UnexpectedBytes unexpected_;          // lock
  std::vector<int> lost_peers_;         // lock: in the order they failed (Transport::lost_peers)
  int paused_lanes_ = 0;                // lock
  std::uint64_t data_frames_sent_ = 0;  // lock
  std::optional<std::uint64_t> corrupt_at_;                    // lock: the test hook's frame
  FrameCorruption corrupt_target_ = FrameCorruption::payload;  // lock
  // The test hook that holds writes: set while it is on; the bytes the data plane may still
  // write (what writes in flight were offered is taken off); the connections held.
  std::atomic<bool> sends_limited_{false};
  std::uint64_t send_budget_ = 0;                     // lock
  std::vector<std::pair<Peer*, Lane*>> held_writes_;  // lock
  TransportStats stats_;                              // lock: the payload and message counters
  std::atomic<std::uint64_t> wire_sent_{0};
  std::atomic<std::uint64_t> wire_received_{0};
  std::atomic<std::uint64_t> payload_copied_{0};  // TcpTransport::payload_bytes_copied()

 private:
  bool finish_if_ready(Operation& op, std::unique_lock<std::mutex>& lock);
  // Fails every operation with `peer`. `lost`: false for a peer that said goodbye, which is
  // neither logged nor counted in lost_peers_.
  void fail_peer_locked(Peer& peer, const std::exception_ptr& error, bool lost);
  void fail_peer_on_strand(Peer& peer, const std::exception_ptr& error, bool lost = true);
  void close_lanes_on_strand(Peer& peer, const std::exception_ptr& orphan_error);
  void tell_peer_why(Peer& peer, std::string_view reason);
  void graceful_close() noexcept;
  void check_progress();
  void run_on_every_strand_and_wait(const std::function<void(Peer&)>& work) noexcept;
  void fail_everything_locked(const std::exception_ptr& error);
};

}  // namespace pulseloco::transport::tcp
