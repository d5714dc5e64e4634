#include <pulseloco/transport/tcp/tcp_transport.h>

#include <fmt/format.h>

#include <algorithm>
#include <future>
#include <latch>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/transport/tcp/core.h>
#include <pulseloco/transport/waiting.h>

namespace pulseloco::transport {

using tcp::Core;
using tcp::Lane;
using tcp::Operation;
using tcp::Peer;
namespace asio = boost::asio;

namespace {

// Destruction waits at most this long for the peers to read what was sent to them.
constexpr auto kCloseTimeout = std::chrono::seconds(10);

class TcpRequest final : public Request {
 public:
  TcpRequest(std::shared_ptr<Core> core, std::shared_ptr<Operation> op)
      : core_(std::move(core)), op_(std::move(op)) {}
  ~TcpRequest() override { core_->abandon(op_); }
  TcpRequest(const TcpRequest&) = delete;
  TcpRequest& operator=(const TcpRequest&) = delete;

  bool test() override { return core_->test(*op_); }
  void wait(Deadline deadline) override { core_->wait(*op_, deadline); }
  [[nodiscard]] const Core* core() const noexcept { return core_.get(); }
  [[nodiscard]] const Operation& operation() const noexcept { return *op_; }

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<Operation> op_;
};

// An isend or irecv (`call`) of `bytes` with `peer`, which must be a rank of the group.
std::shared_ptr<Operation> new_operation(const Core& core, std::string_view call, int peer, Tag tag,
                                         std::size_t bytes) {
  if (peer < 0 || peer >= core.size_)
    throw InvalidArgument(fmt::format("{}: peer {} is not in [0, {})", call, peer, core.size_),
                          ErrorContext{.rank = core.rank_});
  auto op = std::make_shared<Operation>();
  op->peer = peer;
  op->tag = tag;
  op->bytes = bytes;
  return op;
}

std::string what_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

namespace tcp {

// ------------------------------------------------------------------------------------------------
// The failure policy

void Core::on_lane_error(Peer& peer, Lane& lane, const boost::system::error_code& error,
                         std::string_view doing) {
  if (lane.closed || error == asio::error::operation_aborted) return;
  if (!peer.abort_reason.empty()) {
    // The peer announced its abort on another connection; this one has now ended too.
    end_lane_after_abort(peer, lane);
    return;
  }
  if (error == asio::error::eof) {
    bool orderly = false;
    bool close_now = false;
    {
      const std::lock_guard lock(mutex_);
      lane.eof = true;
      orderly = lane.goodbye_received || closing_;
      close_now = orderly && (lane.write_shut || closing_);
      if (close_now) lane.closed = true;
    }
    if (orderly) {
      if (close_now) {
        lane.link.close();
      }
      notify_waiters();
      return;
    }
    fail_peer_on_strand(
        peer, peer_lost(peer.rank, fmt::format("connection {} to peer {} closed without a "
                                               "goodbye (the peer process died or was killed)",
                                               lane.index, peer.rank)));
    return;
  }
  fail_peer_on_strand(
      peer, peer_lost(peer.rank, fmt::format("connection {} to peer {} failed while {}: {}",
                                             lane.index, peer.rank, doing, error.message())));
}

void Core::on_goodbye_from_all(Peer& peer) {
  // The peer sent everything it will ever send; complete early arrivals stay receivable.
  fail_peer_on_strand(
      peer, peer_lost(peer.rank, fmt::format("peer {} closed its transport", peer.rank)), false);
}

void Core::end_lane_after_abort(Peer& peer, Lane& lane) {
  // An aborting peer sends an abort frame on each idle connection and closes them all. Its
  // other connections may still hold frames it sent before (a collective's failure notice,
  // say): the peer fails only once every connection has ended, so that those are delivered.
  bool all_ended = true;
  {
    const std::lock_guard lock(mutex_);
    lane.closed = true;
    for (const auto& other : peer.lanes)
      all_ended = all_ended && (other->closed || other->abort_received || other->eof ||
                                other->paused || !other->connected);
  }
  lane.link.close();
  if (all_ended)
    fail_peer_on_strand(peer, peer_lost(peer.rank, fmt::format("peer {} aborted: {}", peer.rank,
                                                               peer.abort_reason)));
}

void Core::protocol_violation(Peer& peer, const std::string& problem,
                              std::optional<std::uint64_t> offset) {
  ErrorContext context = context_for(peer.rank);
  context.byte_offset = offset;
  tell_peer_why(peer, fmt::format("rank {} rejected its frames: {}", rank_, problem));
  fail_peer_on_strand(
      peer, std::make_exception_ptr(
                ProtocolError(fmt::format("peer {} violated the protocol: {}", peer.rank, problem),
                              std::move(context))));
}

void Core::fail_peer_locked(Peer& peer, const std::exception_ptr& error, bool lost) {
  if (peer.failure) return;
  peer.failure = error;
  if (lost && !closing_ && !aborted_) {
    lost_peers_.push_back(peer.rank);
    logger().warn("tcp transport: rank {}: {}", rank_, what_of(error));
  }
  // Lost before the whole mesh is connected: the group cannot form. Waiting on for the other
  // connections until the connect deadline would only delay this rank's next try at forming
  // one (in an elastic run, possibly past the coordinator's regroup timeout).
  if (!formed_ && !formation_error_) formation_error_ = error;
  const auto fail = [&](const std::shared_ptr<Operation>& op) {
    if (op && op->pending()) op->error = error;
  };
  for (const auto& chunk : peer.send_queue)
    fail(chunk.op);
  peer.send_queue.clear();
  for (const auto& lane : peer.lanes)
    for (const auto& chunk : lane->batch)
      fail(chunk.op);
  peer.messages.fail_receives(error);
}

void Core::close_lanes_on_strand(Peer& peer, const std::exception_ptr& orphan_error) {
  for (auto& lane : peer.lanes) {
    lane->link.close();
  }
  {
    const std::lock_guard lock(mutex_);
    for (auto& lane : peer.lanes) {
      lane->closed = true;
      if (lane->paused) {
        lane->paused = false;
        --paused_lanes_;
      }
    }
    // Messages that will never complete are dropped (their receives fail); complete ones stay
    // receivable.
    if (peer.messages.drop_incomplete(peer.failure ? peer.failure : orphan_error) > 0)
      early_bytes_released_locked();
  }
  notify_waiters();
}

void Core::fail_peer_on_strand(Peer& peer, const std::exception_ptr& error, bool lost) {
  // Close first: once the operations fail their buffers may be reused, and nothing may be read
  // into them any more.
  for (auto& lane : peer.lanes) {
    lane->link.close();
  }
  {
    const std::lock_guard lock(mutex_);
    fail_peer_locked(peer, error, lost);
  }
  close_lanes_on_strand(peer, error);
}

void Core::fail_everything_locked(const std::exception_ptr& error) {
  for (auto& peer : peers_) {
    const auto fail = [&](const std::shared_ptr<Operation>& op) {
      if (op && !op->done && !op->error) op->error = error;
    };
    for (const auto& chunk : peer->send_queue)
      fail(chunk.op);
    peer->send_queue.clear();
    for (const auto& lane : peer->lanes)
      for (const auto& chunk : lane->batch)
        fail(chunk.op);
    peer->messages.fail_receives(error);
    if (!peer->failure) peer->failure = error;
  }
}

void Core::tell_peer_why(Peer& peer, std::string_view reason) {
  // An abort frame on every idle connection (never inside a frame being written), without
  // blocking: the peer then fails with our reason instead of a bare "connection closed".
  const std::string_view text = reason.substr(0, kMaxAbortReasonBytes);
  FrameHeader header;
  header.kind = FrameKind::abort;
  header.message_bytes = header.chunk_bytes = text.size();
  const EncodedHeader encoded = encode_header(header);
  const std::array<asio::const_buffer, 2> frame{asio::buffer(encoded),
                                                asio::buffer(text.data(), text.size())};
  for (auto& lane : peer.lanes) {
    {
      const std::lock_guard lock(mutex_);
      if (!lane->idle_writer()) continue;
    }
    boost::system::error_code ignored;
    lane->link.socket().non_blocking(true, ignored);
    wire_sent_ += lane->link.write_some(frame, ignored);
  }
}

void Core::check_progress() {
  const auto period =
      std::max<std::chrono::milliseconds>(options_.io_timeout / 4, std::chrono::milliseconds(10));
  progress_timer_->expires_after(period);
  progress_timer_->async_wait([this](const boost::system::error_code& error) {
    if (error) return;
    for (auto& peer_ptr : peers_) {
      Peer& peer = *peer_ptr;
      if (peer.rank == rank_) continue;
      asio::post(peer.strand, [this, &peer] {
        const auto now = Clock::now();
        for (auto& lane_ptr : peer.lanes) {
          const Lane& lane = *lane_ptr;
          if (lane.closed || !lane.connected || lane.paused) continue;
          std::string stalled;
          if (lane.writing && now - lane.last_write_progress > options_.io_timeout) {
            stalled = "sending";
          } else if (lane.mid_frame() && now - lane.last_read_progress > options_.io_timeout) {
            stalled = "receiving a frame";
          }
          if (stalled.empty()) continue;
          fail_peer_on_strand(
              peer, std::make_exception_ptr(TimeoutError(
                        fmt::format("connection {} to peer {} made no progress "
                                    "{} for {} ms (io_timeout)",
                                    lane.index, peer.rank, stalled, to_ms(options_.io_timeout)),
                        context_for(peer.rank))));
          return;
        }
      });
    }
    check_progress();
  });
}

// ------------------------------------------------------------------------------------------------
// Aborting and closing

void Core::run_on_every_strand_and_wait(const std::function<void(Peer&)>& work) noexcept {
  try {
    if (!progress_.has_threads()) {
      for (auto& peer : peers_)
        work(*peer);
      return;
    }
    std::latch done(static_cast<std::ptrdiff_t>(peers_.size()));
    for (auto& peer : peers_) {
      asio::post(peer->strand, [&work, &done, p = peer.get()] {
        try {
          work(*p);
        } catch (...) {
          // Closing is best effort; nothing here is allowed to stop the others.
        }
        done.count_down();
      });
    }
    done.wait();
  } catch (const std::exception& error) {
    logger().error("tcp transport: failed to reach the I/O threads: {}", error.what());
  }
}

void Core::abort(std::string_view reason) noexcept {
  try {
    std::exception_ptr error;
    {
      const std::lock_guard lock(mutex_);
      if (aborted_ || shut_down_) return;
      aborted_ = std::make_exception_ptr(AbortedError(reason, ErrorContext{.rank = rank_}));
      error = aborted_;
    }
    logger().warn("tcp transport: rank {} aborting: {}", rank_, reason);
    run_on_every_strand_and_wait([&](Peer& peer) {
      tell_peer_why(peer, reason);
      close_lanes_on_strand(peer, error);
    });
    {
      const std::lock_guard lock(mutex_);
      fail_everything_locked(error);
    }
    notify_waiters();
  } catch (...) {
    // abort() must not throw; the operations have been failed as far as possible.
  }
}

void Core::graceful_close() noexcept {
  try {
    const auto deadline = Clock::now() + kCloseTimeout;
    std::unique_lock lock(mutex_);
    closing_ = true;
    // 1. Let what is queued go out.
    changed_.wait_until(lock, deadline, [&] {
      return std::all_of(peers_.begin(), peers_.end(), [](const auto& peer) {
        return peer->failure || peer->stalled ||
               (peer->send_queue.empty() &&
                std::none_of(peer->lanes.begin(), peer->lanes.end(),
                             [](const auto& lane) { return lane->writing; }));
      });
    });
    lock.unlock();
    // 2. Say goodbye on every connection, then half-close it.
    for (auto& peer_ptr : peers_) {
      Peer& peer = *peer_ptr;
      if (peer.rank == rank_) continue;
      asio::post(peer.strand, [this, &peer] {
        for (auto& lane_ptr : peer.lanes) {
          Lane& lane = *lane_ptr;
          {
            const std::lock_guard guard(mutex_);
            if (!lane.connected || lane.closed || lane.write_shut || peer.failure) continue;
            lane.goodbye_wanted = true;
          }
          sender_.start_write(peer, lane);
        }
      });
    }
    // 3. Wait until every peer has read it all and closed its side.
    lock.lock();
    changed_.wait_until(lock, deadline, [&] {
      return std::all_of(peers_.begin(), peers_.end(), [](const auto& peer) {
        return peer->failure || peer->stalled ||
               std::all_of(peer->lanes.begin(), peer->lanes.end(), [](const auto& lane) {
                 return lane->closed || !lane->connected || (lane->write_shut && lane->eof);
               });
      });
    });
  } catch (...) {
    // Closing is best effort.
  }
}

void Core::shutdown() noexcept {
  bool aborted = false;
  bool formed = false;
  {
    const std::lock_guard lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
    aborted = aborted_ != nullptr;
    formed = formed_;
  }
  // A group that never formed has no messages in flight to protect.
  if (!aborted && formed && size_ > 1 && progress_.has_threads()) graceful_close();
  {
    const std::lock_guard lock(mutex_);
    closing_ = true;
  }
  const auto destroyed = std::make_exception_ptr(
      PeerLostError("the transport was destroyed", ErrorContext{.rank = rank_}));
  run_on_every_strand_and_wait(
      [this, &destroyed](Peer& peer) { close_lanes_on_strand(peer, destroyed); });
  try {
    if (!progress_.has_threads()) {
      mesh_.close_listener();
    } else {
      std::promise<void> closed;
      asio::post(control_, [this, &closed] {
        mesh_.close_listener();
        if (progress_timer_) progress_timer_->cancel();
        closed.set_value();
      });
      closed.get_future().wait();
    }
  } catch (...) {
  }
  {
    const std::lock_guard lock(mutex_);
    fail_everything_locked(destroyed);
  }
  notify_waiters();
  work_.reset();
  io_.stop();
  progress_.join();
}

}  // namespace tcp

// ------------------------------------------------------------------------------------------------
// TcpTransport

TcpTransport::TcpTransport(const TcpOptions& options, const FindGroup& find_group,
                           std::chrono::milliseconds connect_timeout)
    : core_(std::make_shared<Core>(options)) {
  validate(options);
  // One budget for the whole formation: rendezvous, connections and handshakes.
  const Deadline deadline = deadline_after(connect_timeout);
  core_->connect_timeout_ = connect_timeout;
  core_->listen_port_ = core_->mesh_.listen(options.listen_addr, options.listen_port);
  core_->form(find_group(core_->listen_port_), deadline);
}

TcpTransport::TcpTransport(const TcpOptions& options, GroupTable table,
                           std::chrono::milliseconds connect_timeout)
    : core_(std::make_shared<Core>(options)) {
  validate(options);
  const Deadline deadline = deadline_after(connect_timeout);
  core_->connect_timeout_ = connect_timeout;
  if (table.size() > 1)
    core_->listen_port_ = core_->mesh_.listen(
        options.listen_addr, table.peers[static_cast<std::size_t>(table.rank)].port);
  core_->form(std::move(table), deadline);
}

TcpTransport::~TcpTransport() {
  core_->shutdown();
}

int TcpTransport::rank() const noexcept {
  return core_->rank_;
}
int TcpTransport::size() const noexcept {
  return core_->size_;
}

std::unique_ptr<Request> TcpTransport::isend(int peer, Tag tag, std::span<const std::byte> data) {
  return post_send(peer, tag, data, nullptr);
}

std::unique_ptr<Request> TcpTransport::post_send(int peer, Tag tag, std::span<const std::byte> data,
                                                 const Operation* forwarded) {
  auto op = new_operation(*core_, "isend", peer, tag, data.size());
  op->is_send = true;
  auto request = std::make_unique<TcpRequest>(core_, op);
  core_->sender_.post(op, data, forwarded);
  return request;
}

std::unique_ptr<Request> TcpTransport::irecv(int peer, Tag tag, std::span<std::byte> data) {
  auto op = new_operation(*core_, "irecv", peer, tag, data.size());
  op->recv_buffer = data;
  auto request = std::make_unique<TcpRequest>(core_, op);
  core_->receiver_.post(op);
  return request;
}

std::unique_ptr<Request> TcpTransport::iforward(int peer, Tag tag, std::span<const std::byte> data,
                                                const Request& earlier) {
  const auto* tcp = dynamic_cast<const TcpRequest*>(&earlier);
  const bool ours = tcp != nullptr && tcp->core() == core_.get();
  return post_send(peer, tag, data, ours ? &tcp->operation() : nullptr);
}

void TcpTransport::abort(std::string_view reason) noexcept {
  core_->abort(reason);
}

std::vector<int> TcpTransport::lost_peers() const {
  const std::lock_guard lock(core_->mutex_);
  return core_->lost_peers_;
}

TransportStats TcpTransport::stats() const {
  return core_->stats();
}

std::uint16_t TcpTransport::listen_port() const noexcept {
  return core_->listen_port_;
}

GroupId TcpTransport::group_id() const noexcept {
  return core_->group_id_;
}

int TcpTransport::refused_connections() const noexcept {
  return core_->mesh_.refused_connections();
}

std::size_t TcpTransport::unexpected_bytes() const {
  return core_->unexpected_bytes();
}

std::uint64_t TcpTransport::payload_bytes_copied() const noexcept {
  return core_->payload_copied_.load();
}

void TcpTransport::retire_tag(Tag tag) noexcept {
  core_->retire_tag(tag);
}

std::size_t TcpTransport::tag_counters() const {
  return core_->tag_counters();
}

void TcpTransport::corrupt_outgoing_frame(CorruptFrame hook) {
  core_->corrupt_outgoing_frame(hook);
}

void TcpTransport::hold_sends_after(std::uint64_t bytes) {
  core_->hold_sends_after(bytes);
}

void TcpTransport::release_sends() {
  core_->release_sends();
}

}  // namespace pulseloco::transport
