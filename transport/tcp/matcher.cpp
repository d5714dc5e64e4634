#include <pulseloco/transport/tcp/matcher.h>

#include <fmt/format.h>

#include <cstring>
#include <iterator>

#include <pulseloco/base/log.h>

namespace pulseloco::transport::tcp {

void MessageMatcher::retire_tag(Tag tag) noexcept {
  next_send_.erase(tag);
  next_receive_.erase(tag);
}

std::exception_ptr MessageMatcher::size_mismatch(Tag tag, std::uint64_t sent,
                                                 std::uint64_t expected) const {
  return std::make_exception_ptr(
      ProtocolError(fmt::format("peer {} sent {} bytes under tag {} but the matching receive "
                                "expects {} bytes",
                                context_.peer.value_or(-1), sent, tag, expected),
                    context_));
}

MatchOutcome MessageMatcher::post_receive(const std::shared_ptr<Operation>& op,
                                          const std::exception_ptr& failure,
                                          std::optional<MessageKey>& paused_for) {
  MatchOutcome outcome;
  op->sequence = next_receive_[op->tag]++;
  const MessageKey key{op->tag, op->sequence};
  auto it = slots_.find(key);
  if (it == slots_.end()) {
    if (failure) {
      op->error = failure;
      return outcome;
    }
    Slot slot;
    slot.op = op;
    slots_.emplace(key, std::move(slot));
    paused_for = key;
    return outcome;
  }
  Slot& slot = it->second;
  PULSELOCO_CHECK(slot.announced && !slot.op, "irecv matched a slot that is already posted");
  if (slot.message_bytes != op->bytes) {
    op->error = size_mismatch(op->tag, slot.message_bytes, op->bytes);
    if (slot.complete()) {
      if (slot.stash) {
        unexpected_.give_back(slot.message_bytes);
        outcome.released = slot.message_bytes;
      }
      slots_.erase(it);
    } else {
      slot.discard = true;
    }
  } else if (slot.complete()) {
    op->bytes_arrived = slot.message_bytes;
    op->verified_frames = std::move(slot.verified);
    if (slot.stash) {
      op->stash_to_copy = std::move(slot.stash);
      op->stash_bytes = slot.message_bytes;
    } else {
      outcome.completed = op.get();
      outcome.receive_changed = true;
    }
    slots_.erase(it);
  } else {
    // Still arriving: the chunks to come go straight into the caller's buffer, those that went
    // to the stash are copied over once the message is complete.
    slot.op = op;
    slot.to_user = true;
    op->bytes_arrived = slot.received;
  }
  return outcome;
}

bool MessageMatcher::receive_posted(const MessageKey& key) const {
  const auto it = slots_.find(key);
  return it != slots_.end() && it->second.op != nullptr;
}

std::uint64_t MessageMatcher::deliver_to_self(const MessageKey& key,
                                              std::span<const std::byte> data,
                                              MatchOutcome& outcome) {
  auto it = slots_.find(key);
  if (it != slots_.end()) {
    // The irecv was posted first (or posted and abandoned): hand the bytes over now.
    auto recv = std::move(it->second.op);
    slots_.erase(it);
    if (recv && recv->recv_buffer.size() != data.size()) {
      recv->error = size_mismatch(key.tag, data.size(), recv->recv_buffer.size());
    } else if (recv) {
      if (!data.empty()) std::memcpy(recv->recv_buffer.data(), data.data(), data.size());
      recv->bytes_arrived = data.size();
      outcome.completed = recv.get();
      return data.size();
    }
    return 0;
  }
  Slot slot;
  slot.announced = true;
  slot.message_bytes = slot.claimed = slot.received = data.size();
  if (!data.empty()) {
    slot.stash = std::make_unique_for_overwrite<std::byte[]>(data.size());
    std::memcpy(slot.stash.get(), data.data(), data.size());
    unexpected_.take(data.size());
  }
  slots_.emplace(key, std::move(slot));
  return data.size();
}

FrameTarget MessageMatcher::begin_frame(const FrameHeader& frame) {
  FrameTarget result;
  const MessageKey key{frame.tag, frame.sequence};
  auto it = slots_.find(key);
  if (it == slots_.end()) {
    // Arrived before its irecv: keep it, unless that would exceed the cap.
    if (frame.message_bytes > 0 && !unexpected_.fits(frame.message_bytes)) {
      result.action = FrameTarget::Action::pause;
      return result;
    }
    Slot slot;
    slot.announced = true;
    slot.message_bytes = frame.message_bytes;
    if (frame.message_bytes > 0) {
      slot.stash = std::make_unique_for_overwrite<std::byte[]>(frame.message_bytes);
      unexpected_.take(frame.message_bytes);
    }
    it = slots_.emplace(key, std::move(slot)).first;
  } else if (!it->second.announced) {
    Slot& slot = it->second;
    slot.announced = true;
    slot.message_bytes = frame.message_bytes;
    if (slot.op && slot.op->recv_buffer.size() != frame.message_bytes) {
      slot.op->error = size_mismatch(frame.tag, frame.message_bytes, slot.op->recv_buffer.size());
      slot.op.reset();
      slot.discard = true;
      result.receive_failed = true;
    }
  } else if (it->second.message_bytes != frame.message_bytes) {
    result.action = FrameTarget::Action::violate;
    result.violation =
        fmt::format("frames of message (tag {}, sequence {}) announce {} and {} bytes", frame.tag,
                    frame.sequence, it->second.message_bytes, frame.message_bytes);
    return result;
  }
  Slot& slot = it->second;
  std::byte* base = nullptr;
  if (!slot.discard) {
    if (slot.stash && !slot.to_user) {
      base = slot.stash.get();
      result.stashed = true;
    } else if (slot.op) {
      base = slot.op->recv_buffer.data();
    }
  }
  // Chunks must not overlap: together they cover the message exactly once.
  bool overlaps = slot.claimed + frame.chunk_bytes > slot.message_bytes;
  if (!overlaps && frame.chunk_bytes > 0 && frame.chunk_bytes < slot.message_bytes) {
    const std::uint64_t end = frame.chunk_offset + frame.chunk_bytes;
    auto next = slot.ranges.lower_bound(frame.chunk_offset);
    if (next != slot.ranges.end() && next->first < end) overlaps = true;
    if (next != slot.ranges.begin() && std::prev(next)->second.end > frame.chunk_offset)
      overlaps = true;
    if (!overlaps) slot.ranges.emplace(frame.chunk_offset, Slot::Range{end, result.stashed});
  }
  if (overlaps) {
    result.action = FrameTarget::Action::violate;
    result.violation =
        fmt::format("frame of message (tag {}, sequence {}) overlaps bytes already received",
                    frame.tag, frame.sequence);
    result.violation_offset = frame.chunk_offset;
    return result;
  }
  slot.claimed += frame.chunk_bytes;
  if (result.stashed) slot.stashed_bytes += frame.chunk_bytes;
  result.target = base == nullptr ? nullptr : base + frame.chunk_offset;
  return result;
}

std::byte* MessageMatcher::redirect_rest(const MessageKey& key, const FrameHeader& frame,
                                         std::uint64_t remaining) {
  const auto it = slots_.find(key);
  if (it == slots_.end()) return nullptr;
  Slot& slot = it->second;
  if (!slot.to_user || !slot.op || slot.discard) return nullptr;
  const std::uint64_t split = frame.chunk_offset + (frame.chunk_bytes - remaining);
  const std::uint64_t end = frame.chunk_offset + frame.chunk_bytes;
  // The frame's arrived part stays in the stash, the rest does not (finish_frame copies the
  // stashed ranges).
  slot.stashed_bytes -= remaining;
  if (split > frame.chunk_offset) {
    slot.ranges.insert_or_assign(frame.chunk_offset, Slot::Range{split, true});
    slot.ranges.insert_or_assign(split, Slot::Range{end, false});
  } else {
    slot.ranges.insert_or_assign(frame.chunk_offset, Slot::Range{end, false});
  }
  return slot.op->recv_buffer.data() + split;
}

MatchOutcome MessageMatcher::finish_frame(const MessageKey& key, const FrameHeader& frame,
                                          bool verified) {
  MatchOutcome outcome;
  auto it = slots_.find(key);
  if (it == slots_.end()) return outcome;  // the peer failed meanwhile
  Slot& slot = it->second;
  slot.received += frame.chunk_bytes;
  if (verified)
    slot.verified.push_back({frame.chunk_offset, frame.chunk_bytes, frame.payload_checksum});
  if (slot.op) slot.op->bytes_arrived = slot.received;
  if (!slot.complete()) return outcome;
  if (slot.discard) {
    if (slot.stash) {
      unexpected_.give_back(slot.message_bytes);
      outcome.released = slot.message_bytes;
    }
    slots_.erase(it);
    return outcome;
  }
  if (!slot.op) return outcome;  // it arrived before its irecv and waits for it
  Operation& op = *slot.op;
  op.verified_frames = std::move(slot.verified);
  if (slot.stash && slot.stashed_bytes > 0) {
    op.stash_to_copy = std::move(slot.stash);
    op.stash_bytes = slot.message_bytes;
    if (slot.stashed_bytes < slot.message_bytes) {
      for (const auto& [offset, range] : slot.ranges)
        if (range.stashed) op.copy_ranges.emplace_back(offset, range.end);
      logger().debug(
          "tcp transport: message (tag {}, sequence {}) from peer {}: {} early bytes to copy, "
          "{} received in place",
          frame.tag, frame.sequence, context_.peer.value_or(-1), slot.stashed_bytes,
          slot.message_bytes - slot.stashed_bytes);
    }
  } else {
    if (slot.stash) {  // nothing went there
      unexpected_.give_back(slot.message_bytes);
      outcome.released = slot.message_bytes;
    }
    outcome.completed = &op;
  }
  slots_.erase(it);
  outcome.receive_changed = true;
  return outcome;
}

void MessageMatcher::abandon(const std::shared_ptr<Operation>& op) noexcept {
  auto it = slots_.find(MessageKey{op->tag, op->sequence});
  if (it != slots_.end() && it->second.op == op) {
    it->second.op.reset();
    it->second.discard = true;
  }
}

void MessageMatcher::fail_receives(const std::exception_ptr& error) noexcept {
  // A posted receive leaves its slot once its message is complete, so every one still here
  // waits for bytes.
  for (auto& [key, slot] : slots_)
    if (slot.op && slot.op->pending()) slot.op->error = error;
}

std::uint64_t MessageMatcher::drop_incomplete(const std::exception_ptr& error) {
  std::uint64_t released = 0;
  for (auto it = slots_.begin(); it != slots_.end();) {
    Slot& slot = it->second;
    if (slot.complete() && !slot.op && !slot.discard) {
      ++it;
      continue;
    }
    if (slot.op && slot.op->pending()) slot.op->error = error;
    if (slot.stash) {
      unexpected_.give_back(slot.message_bytes);
      released += slot.message_bytes;
    }
    it = slots_.erase(it);
  }
  return released;
}

}  // namespace pulseloco::transport::tcp
