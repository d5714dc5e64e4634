#include <pulseloco/transport/tcp/receiver.h>

#include <fmt/format.h>

#include <optional>

#include <pulseloco/base/log.h>
#include <pulseloco/transport/tcp/core.h>

namespace pulseloco::transport::tcp {

void Receiver::post(const std::shared_ptr<Operation>& op) {
  Peer& peer = *core_.peers_[static_cast<std::size_t>(op->peer)];
  bool resume = false;
  bool notify = false;
  {
    const std::lock_guard lock(core_.mutex_);
    if (core_.aborted_) {
      op->error = core_.aborted_;
      return;
    }
    std::optional<MessageKey> nothing_arrived;
    const MatchOutcome outcome = peer.messages.post_receive(op, peer.failure, nothing_arrived);
    notify = core_.apply_locked(outcome);
    if (nothing_arrived)
      for (const auto& lane : peer.lanes)
        resume = resume || (lane->paused && lane->key == *nothing_arrived);
  }
  if (notify) core_.notify_waiters();
  if (resume) asio::post(peer.strand, [this, &peer] { resume_lanes(peer); });
}

void Receiver::read_more(Peer& peer, Lane& lane) {
  if (lane.closed || lane.paused) return;
  read_rest_into_receive_if_posted(peer, lane);
  if (lane.reads_directly()) {
    const auto destination = lane.direct_read_buffer();
    if (lane.inline_reads < kInlineDirectReads) {
      // What is waiting already is read now, so that its hash finds it in the cache.
      boost::system::error_code error;
      const std::size_t n = lane.link.read_some(destination, error);
      if (error != asio::error::would_block && error != asio::error::try_again) {
        ++lane.inline_reads;
        on_read(peer, lane, error, n, true);
        --lane.inline_reads;
        return;
      }
    }
    // Straight into the destination (the caller's buffer when its irecv is posted).
    lane.link.async_read_some(
        destination, asio::bind_executor(
                         peer.strand, [this, &peer, &lane](const boost::system::error_code& error,
                                                           std::size_t n) {
                           on_read(peer, lane, error, n, true);
                         }));
    return;
  }
  lane.link.async_read_some(
      lane.staging_read_buffer(),
      asio::bind_executor(
          peer.strand, [this, &peer, &lane](const boost::system::error_code& error, std::size_t n) {
            on_read(peer, lane, error, n, false);
          }));
}

void Receiver::on_read(Peer& peer, Lane& lane, const boost::system::error_code& error,
                       std::size_t n, bool direct) {
  if (lane.closed) return;
  if (error) {
    core_.on_lane_error(peer, lane, error, "receiving");
    return;
  }
  core_.wire_received_ += n;
  lane.last_read_progress = Clock::now();
  if (direct) {
    lane.arrived_directly(n);
  } else {
    lane.arrived_in_staging(n);
  }
  process(peer, lane);
}

void Receiver::process(Peer& peer, Lane& lane) {
  bool completed_a_receive = false;  // by a frame this call finished
  while (!lane.closed) {
    if (!lane.in_payload) {
      const auto bytes = lane.staged_header();
      if (!bytes) break;
      std::string problem;
      const auto header = decode_header(*bytes, problem);
      if (!header) {
        core_.protocol_violation(peer, fmt::format("{} on connection {}", problem, lane.index));
        return;
      }
      if (completed_a_receive && header->kind == FrameKind::data && header->message_bytes > 0) {
        bool posted = false;
        {
          const std::lock_guard lock(core_.mutex_);
          posted = peer.messages.receive_posted({header->tag, header->sequence});
        }
        if (!posted) {
          // This frame would go to early memory, and be copied out again later; but a receive
          // completed just now, and the caller waiting for it often posts this frame's receive
          // next (a collective's payload after its header). It runs first if this connection
          // goes on in a new handler (drive_until looks at its operation after every handler).
          asio::post(peer.strand, [this, &peer, &lane] { process(peer, lane); });
          return;
        }
      }
      lane.consume_header(*header);
      if (!begin_frame(peer, lane)) return;  // paused, or the peer failed
      continue;
    }
    if (lane.staged_payload() > 0) {
      read_rest_into_receive_if_posted(peer, lane);
      core_.payload_copied_ += lane.take_staged_payload();
    }
    if (lane.remaining > 0) break;
    if (finish_frame(peer, lane)) completed_a_receive = true;
  }
  read_more(peer, lane);
}

bool Receiver::begin_frame(Peer& peer, Lane& lane) {
  const FrameHeader& frame = lane.frame;
  if (frame.kind == FrameKind::goodbye) {
    bool everyone = true;
    bool shut_now = false;
    {
      const std::lock_guard lock(core_.mutex_);
      lane.goodbye_received = true;
      for (const auto& other : peer.lanes)
        everyone = everyone && other->goodbye_received;
      if (!lane.writing) {
        shut_now = !lane.write_shut;
      } else {
        lane.shut_after_write = true;
      }
    }
    if (everyone) {
      core_.on_goodbye_from_all(peer);
      return false;
    }
    if (shut_now) core_.sender_.shut_write_side(lane);
    return !lane.closed;
  }
  if (frame.kind == FrameKind::abort) {
    lane.begin_abort_reason();
    return true;
  }

  std::unique_lock lock(core_.mutex_);
  if (peer.failure) return false;
  const MessageKey key{frame.tag, frame.sequence};
  const FrameTarget target = peer.messages.begin_frame(frame);
  switch (target.action) {
    case FrameTarget::Action::pause:
      // Stop reading this connection until a matching irecv is posted or room is made.
      lane.paused = true;
      lane.key = key;
      ++core_.paused_lanes_;
      logger().debug(
          "tcp transport: {} early bytes held; pausing connection {} from peer {} until a "
          "receive for tag {} is posted",
          core_.unexpected_.held(), lane.index, peer.rank, frame.tag);
      return false;
    case FrameTarget::Action::violate:
      lock.unlock();
      core_.protocol_violation(peer, target.violation, target.violation_offset);
      return false;
    case FrameTarget::Action::read:
      break;
  }
  lane.begin_payload(key, target.target, target.stashed);
  lock.unlock();
  if (target.receive_failed) core_.notify_waiters();
  return true;
}

void Receiver::read_rest_into_receive_if_posted(Peer& peer, Lane& lane) {
  // A frame that began arriving before its irecv was posted goes to early memory; once the irecv
  // is posted, the rest of the frame goes straight into the receive's buffer, so that only what
  // had arrived is copied (a message sent before its receiver knew its size, as a collective's
  // first step may be, usually overtakes its receive by little).
  if (!lane.stashing || !lane.in_payload || lane.remaining == 0) return;
  const std::lock_guard lock(core_.mutex_);
  std::byte* rest = peer.messages.redirect_rest(lane.key, lane.frame, lane.remaining);
  if (rest == nullptr) return;
  lane.target = rest;
  lane.stashing = false;
}

bool Receiver::finish_frame(Peer& peer, Lane& lane) {
  lane.in_payload = false;
  lane.stashing = false;
  const FrameHeader& frame = lane.frame;
  if (frame.kind == FrameKind::abort) {
    lane.abort_received = true;
    if (peer.abort_reason.empty()) peer.abort_reason = lane.abort_reason;
    core_.end_lane_after_abort(peer, lane);
    return false;
  }
  const bool verified = lane.hashing;
  if (lane.hashing) {
    lane.hashing = false;
    if (lane.payload_digest.finish() != frame.payload_checksum) {
      core_.protocol_violation(
          peer,
          fmt::format("payload checksum mismatch in message (tag {}, sequence {}) bytes [{}, {}) "
                      "on connection {}: the frame was corrupted",
                      frame.tag, frame.sequence, frame.chunk_offset,
                      frame.chunk_offset + frame.chunk_bytes, lane.index),
          frame.chunk_offset);
      return false;
    }
  }
  bool notify = false;
  {
    const std::lock_guard lock(core_.mutex_);
    notify = core_.apply_locked(peer.messages.finish_frame(lane.key, frame, verified));
  }
  if (notify) core_.notify_waiters();
  return notify;
}

void Receiver::resume_lanes(Peer& peer) {
  for (auto& lane_ptr : peer.lanes) {
    Lane& lane = *lane_ptr;
    {
      const std::lock_guard lock(core_.mutex_);
      if (!lane.paused || lane.closed) continue;
      lane.paused = false;
      --core_.paused_lanes_;
    }
    if (begin_frame(peer, lane)) process(peer, lane);
  }
}

}  // namespace pulseloco::transport::tcp
