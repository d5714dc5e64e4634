#include <pulseloco/transport/tcp/core.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include <pulseloco/base/log.h>
#include <pulseloco/transport/tcp/exposure.h>
#include <pulseloco/transport/waiting.h>

namespace pulseloco::transport::tcp {

Core::Core(const TcpOptions& options)
    : options_(options),
      tls_(TlsContext::make(options)),
      lanes_per_peer_(options.connections_per_peer),
      work_(asio::make_work_guard(io_)),
      progress_(io_, options.busy_poll),
      control_(asio::make_strand(io_)),
      unexpected_(options.max_unexpected_bytes) {}

Core::~Core() {
  shutdown();
}

void Core::form(GroupTable table, Deadline deadline) {
  rank_ = table.rank;
  size_ = table.size();
  group_id_ = table.group_id;
  addresses_ = std::move(table.peers);
  for (int peer = 0; peer < size_; ++peer) {
    peers_.push_back(std::make_unique<Peer>(io_, peer, context_for(peer), unexpected_));
    if (peer == rank_) continue;
    for (int index = 0; index < lanes_per_peer_; ++index)
      peers_.back()->lanes.push_back(std::make_unique<Lane>(io_, index));
  }
  // Without a secret, anyone who can reach a rank's port could join; a group whose every rank
  // is on loopback is reachable from this host only, so it is not worth a warning.
  const bool all_loopback = std::all_of(addresses_.begin(), addresses_.end(), [](const auto& peer) {
    return is_loopback_host(peer.host);
  });
  if (effective_link_security(options_) == LinkSecurity::none && size_ > 1 && rank_ == 0 &&
      !all_loopback)
    logger().warn(
        "tcp transport: no shared secret (PULSELOCO_SECRET): connections are not authenticated");
  if (tls_ && options_.same_host_plaintext && size_ > 1 && rank_ == 0)
    logger().info(
        "tcp transport: links between ranks of one host are not encrypted "
        "(PULSELOCO_SAME_HOST_PLAINTEXT); links to other hosts use TLS");
  if (size_ > 1) mesh_.start(deadline);
  if (options_.io_timeout.count() > 0) {
    progress_timer_.emplace(control_);
    check_progress();
  }
  progress_.start_threads(std::max(1, options_.io_threads), [](const std::exception& error) {
    logger().error("tcp transport: unexpected error on the I/O thread: {}", error.what());
  });
  mesh_.wait(deadline);
  {
    const std::lock_guard lock(mutex_);
    formed_ = true;
  }
  logger().debug("tcp transport: rank {} of {} connected ({} connections per peer)", rank_, size_,
                 lanes_per_peer_);
}

// ------------------------------------------------------------------------------------------------
// Requests

void Core::complete_receive_locked(Operation& op) {
  op.done = true;
  stats_.payload_bytes_received += op.bytes;
  ++stats_.messages_received;
}

bool Core::apply_locked(const MatchOutcome& outcome) {
  if (outcome.completed != nullptr) complete_receive_locked(*outcome.completed);
  if (outcome.released > 0) early_bytes_released_locked();
  return outcome.receive_changed;
}

void Core::early_bytes_released_locked() {
  if (paused_lanes_ == 0) return;
  for (auto& peer : peers_) {
    const bool has_paused = std::any_of(peer->lanes.begin(), peer->lanes.end(),
                                        [](const auto& lane) { return lane->paused; });
    if (has_paused)
      asio::post(peer->strand, [this, p = peer.get()] { receiver_.resume_lanes(*p); });
  }
}

bool Core::finish_if_ready(Operation& op, std::unique_lock<std::mutex>& lock) {
  if (op.error) std::rethrow_exception(op.error);
  if (op.done) return true;
  if (!op.stash_to_copy) return false;
  auto stash = std::move(op.stash_to_copy);
  const auto bytes = op.stash_bytes;
  const auto ranges = std::move(op.copy_ranges);
  lock.unlock();
  if (ranges.empty()) {
    std::memcpy(op.recv_buffer.data(), stash.get(), bytes);
    payload_copied_ += bytes;
  } else {
    for (const auto& [begin, end] : ranges) {
      std::memcpy(op.recv_buffer.data() + begin, stash.get() + begin, end - begin);
      payload_copied_ += end - begin;
    }
  }
  stash.reset();
  lock.lock();
  unexpected_.give_back(bytes);
  early_bytes_released_locked();
  if (op.error) std::rethrow_exception(op.error);
  complete_receive_locked(op);
  return true;
}

bool Core::test(Operation& op) {
  std::unique_lock lock(mutex_);
  return finish_if_ready(op, lock);
}

void Core::wait(Operation& op, Deadline deadline) {
  const auto ready = [&] { return op.done || op.error || op.stash_to_copy != nullptr; };
  // This thread runs the io_context until the operation is done (tcp/progress.h).
  (void)progress_.drive_until(
      [&] {
        const std::lock_guard lock(mutex_);
        return ready();
      },
      deadline);
  std::unique_lock lock(mutex_);
  changed_.wait_until(lock, deadline, ready);
  if (finish_if_ready(op, lock)) return;
  peers_[static_cast<std::size_t>(op.peer)]->stalled = true;
  const auto waited =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - op.posted_at);
  if (op.is_send)
    throw TimeoutError(fmt::format("send to peer {} (tag {}, {} bytes) did not complete within "
                                   "{} ms: {} bytes written",
                                   op.peer, op.tag, op.bytes, to_ms(waited), op.bytes_written),
                       context_for(op.peer));
  throw TimeoutError(fmt::format("receive from peer {} (tag {}, {} bytes) did not complete "
                                 "within {} ms: {} bytes arrived",
                                 op.peer, op.tag, op.bytes, to_ms(waited), op.bytes_arrived),
                     context_for(op.peer));
}

void Core::abandon(const std::shared_ptr<Operation>& op) noexcept {
  const std::lock_guard lock(mutex_);
  if (op->done || op->error || op->is_send) return;  // a send keeps going (see transport.h)
  if (op->stash_to_copy) {
    op->stash_to_copy.reset();
    unexpected_.give_back(op->stash_bytes);
    early_bytes_released_locked();
    return;
  }
  if (peers_.empty()) return;
  // Whatever still arrives for it is read and dropped.
  peers_[static_cast<std::size_t>(op->peer)]->messages.abandon(op);
}

TransportStats Core::stats() const {
  TransportStats result;
  {
    const std::lock_guard lock(mutex_);
    result = stats_;
  }
  result.wire_bytes_sent = wire_sent_.load();
  result.wire_bytes_received = wire_received_.load();
  return result;
}

void Core::retire_tag(Tag tag) noexcept {
  const std::lock_guard lock(mutex_);
  for (auto& peer : peers_)
    peer->messages.retire_tag(tag);
}

std::size_t Core::tag_counters() const {
  const std::lock_guard lock(mutex_);
  std::size_t count = 0;
  for (const auto& peer : peers_)
    count += peer->messages.tag_counters();
  return count;
}

std::size_t Core::unexpected_bytes() const {
  const std::lock_guard lock(mutex_);
  return unexpected_.held();
}

void Core::corrupt_outgoing_frame(CorruptFrame hook) {
  const std::lock_guard lock(mutex_);
  corrupt_at_ = data_frames_sent_ + hook.frame_index;
  corrupt_target_ = hook.target;
}

void Core::hold_sends_after(std::uint64_t bytes) {
  const std::lock_guard lock(mutex_);
  send_budget_ = bytes;
  sends_limited_ = true;
}

void Core::release_sends() {
  std::vector<std::pair<Peer*, Lane*>> held;
  {
    const std::lock_guard lock(mutex_);
    sends_limited_ = false;
    held.swap(held_writes_);
  }
  for (const auto& [peer, lane] : held)
    asio::post(peer->strand, [this, peer, lane] { sender_.continue_write(*peer, *lane); });
}

}  // namespace pulseloco::transport::tcp
