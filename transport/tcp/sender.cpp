#include <pulseloco/transport/tcp/sender.h>

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include <pulseloco/transport/tcp/core.h>

namespace pulseloco::transport::tcp {

void Sender::post(const std::shared_ptr<Operation>& op, std::span<const std::byte> data,
                  const Operation* forwarded) {
  if (op->peer == core_.rank_) {
    deliver_to_self(*op, data);
    return;
  }
  Peer& peer = *core_.peers_[static_cast<std::size_t>(op->peer)];
  const TcpOptions& options = core_.options_;
  const auto plan = plan_chunks(data.size(), core_.lanes_per_peer_, options.stripe_threshold_bytes,
                                options.stripe_chunk_bytes);
  {
    const std::lock_guard lock(core_.mutex_);
    if (core_.aborted_ || peer.failure) {
      op->error = core_.aborted_ ? core_.aborted_ : peer.failure;
      return;
    }
    op->sequence = peer.messages.next_send_sequence(op->tag);
    op->chunks_left = plan.count;
  }
  // The checksums verified when the forwarded bytes arrived, for frames cut the same way, or
  // those of an earlier send of the same bytes.
  std::vector<VerifiedFrame> verified;
  std::shared_ptr<MessageChecksums> checksums;
  if (forwarded != nullptr && options.payload_checksums) {
    const std::lock_guard lock(core_.mutex_);
    if (forwarded->is_send) {
      if (forwarded->send_data == data.data() && forwarded->bytes == data.size() &&
          forwarded->checksums && forwarded->checksums->count == plan.count)
        checksums = forwarded->checksums;
    } else if (forwarded->done && !forwarded->error &&
               forwarded->recv_buffer.data() == data.data() && forwarded->bytes == data.size()) {
      verified = forwarded->verified_frames;
    }
  }
  if (options.payload_checksums && !checksums)
    checksums = std::make_shared<MessageChecksums>(plan.count);
  op->send_data = data.data();
  op->checksums = checksums;
  std::vector<Chunk> chunks(plan.count);
  for (std::uint64_t i = 0; i < plan.count; ++i) {
    const std::uint64_t offset = i * plan.chunk_bytes;
    const std::uint64_t length = std::min<std::uint64_t>(plan.chunk_bytes, data.size() - offset);
    Chunk& chunk = chunks[i];
    chunk.op = op;
    chunk.payload = data.subspan(offset, length);
    chunk.frame.kind = FrameKind::data;
    chunk.frame.tag = op->tag;
    chunk.frame.sequence = op->sequence;
    chunk.frame.message_bytes = data.size();
    chunk.frame.chunk_offset = offset;
    chunk.frame.chunk_bytes = length;
    chunk.frame.has_payload_checksum = options.payload_checksums;
    chunk.checksums = checksums;
    chunk.index = i;
    for (const VerifiedFrame& frame : verified) {
      if (frame.offset == offset && frame.bytes == length) {
        checksums->set_known(i, frame.checksum);
        break;
      }
    }
  }
  bool kick = false;
  {
    const std::lock_guard lock(core_.mutex_);
    if (core_.aborted_ || peer.failure) {
      if (!op->done && !op->error) op->error = core_.aborted_ ? core_.aborted_ : peer.failure;
      return;
    }
    for (auto& chunk : chunks)
      peer.send_queue.push_back(std::move(chunk));
    // A busy connection picks the new frames up when its current write completes.
    for (const auto& lane : peer.lanes)
      kick = kick || lane->idle_writer();
  }
  if (kick) asio::post(peer.strand, [this, &peer] { pump(peer); });
}

void Sender::deliver_to_self(Operation& op, std::span<const std::byte> data) {
  {
    const std::lock_guard lock(core_.mutex_);
    if (core_.aborted_) {
      op.error = core_.aborted_;
      return;
    }
    Peer& self = *core_.peers_[static_cast<std::size_t>(core_.rank_)];
    op.sequence = self.messages.next_send_sequence(op.tag);
    MatchOutcome outcome;
    core_.payload_copied_ +=
        self.messages.deliver_to_self(MessageKey{op.tag, op.sequence}, data, outcome);
    (void)core_.apply_locked(outcome);
    op.done = true;
    core_.stats_.payload_bytes_sent += data.size();
    ++core_.stats_.messages_sent;
  }
  core_.notify_waiters();
}

void Sender::pump(Peer& peer) {
  for (auto& lane : peer.lanes)
    start_write(peer, *lane);
}

void Sender::start_write(Peer& peer, Lane& lane) {
  bool goodbye = false;
  bool shut = false;
  {
    const std::lock_guard lock(core_.mutex_);
    if (lane.writing || lane.closed || lane.write_shut || !lane.connected || peer.failure) return;
    std::size_t bytes = 0;
    while (!peer.send_queue.empty() && lane.batch.size() < kBatchFrames) {
      Chunk& next = peer.send_queue.front();
      if (!lane.batch.empty() && bytes + next.payload.size() > kBatchBytes) break;
      bytes += next.payload.size();
      lane.batch.push_back(std::move(next));
      peer.send_queue.pop_front();
      if (core_.corrupt_at_ && core_.data_frames_sent_ == *core_.corrupt_at_) {
        lane.batch.back().corrupt = core_.corrupt_target_;
        core_.corrupt_at_.reset();
      }
      ++core_.data_frames_sent_;
    }
    if (lane.batch.empty()) {
      goodbye = lane.goodbye_wanted;
      shut = !goodbye && lane.shut_after_write;
      if (!goodbye && !shut) return;
    }
    lane.writing = true;
  }
  if (goodbye) {
    write_goodbye(peer, lane);
    return;
  }
  if (shut) {
    {
      const std::lock_guard lock(core_.mutex_);
      lane.writing = false;
    }
    shut_write_side(lane);
    return;
  }
  lane.prepare_batch_write(peer.rank);
  continue_write(peer, lane);
}

void Sender::continue_write(Peer& peer, Lane& lane) {
  if (core_.sends_limited_) {
    const auto unwritten = lane.unwritten();
    if (unwritten.empty()) return;
    const asio::const_buffer first = unwritten.front();
    const std::size_t allowed = limited_write(peer, lane, first.size());
    if (allowed == 0) return;
    lane.link.async_write_some(
        asio::buffer(first.data(), allowed),
        asio::bind_executor(peer.strand,
                            [this, &peer, &lane, allowed](const boost::system::error_code& error,
                                                          std::size_t written) {
                              {
                                const std::lock_guard lock(core_.mutex_);
                                core_.send_budget_ += allowed - written;
                              }
                              on_written(peer, lane, error, written);
                            }));
    return;
  }
  lane.link.async_write_some(
      lane.unwritten(),
      asio::bind_executor(peer.strand, [this, &peer, &lane](const boost::system::error_code& error,
                                                            std::size_t written) {
        on_written(peer, lane, error, written);
      }));
}

std::size_t Sender::limited_write(Peer& peer, Lane& lane, std::size_t wanted) {
  const std::lock_guard lock(core_.mutex_);
  if (!core_.sends_limited_) return wanted;
  const std::size_t allowed =
      static_cast<std::size_t>(std::min<std::uint64_t>(wanted, core_.send_budget_));
  if (allowed == 0) core_.held_writes_.emplace_back(&peer, &lane);
  core_.send_budget_ -= allowed;
  return allowed;
}

void Sender::on_written(Peer& peer, Lane& lane, const boost::system::error_code& error,
                        std::size_t written) {
  if (error) {
    core_.on_lane_error(peer, lane, error, "sending");
    return;
  }
  core_.wire_sent_ += written;
  lane.last_write_progress = Clock::now();
  if (lane.wrote(written)) {
    batch_written(peer, lane);
  } else {
    continue_write(peer, lane);
  }
}

void Sender::batch_written(Peer& peer, Lane& lane) {
  bool completed = false;
  {
    const std::lock_guard lock(core_.mutex_);
    for (const Chunk& chunk : lane.batch) {
      Operation& op = *chunk.op;
      --op.chunks_left;
      op.bytes_written += chunk.payload.size();
      if (op.chunks_left == 0 && !op.done && !op.error) {
        op.done = true;
        core_.stats_.payload_bytes_sent += op.bytes;
        ++core_.stats_.messages_sent;
        completed = true;
      }
    }
    lane.batch.clear();
    lane.writing = false;
  }
  if (completed) core_.notify_waiters();
  start_write(peer, lane);
}

void Sender::write_goodbye(Peer& peer, Lane& lane) {
  {
    const std::lock_guard lock(core_.mutex_);
    lane.goodbye_wanted = false;
  }
  asio::async_write(
      lane.link, lane.goodbye_frame(),
      asio::bind_executor(peer.strand, [this, &peer, &lane](const boost::system::error_code& error,
                                                            std::size_t written) {
        core_.wire_sent_ += written;
        {
          const std::lock_guard lock(core_.mutex_);
          lane.writing = false;
        }
        if (error) {
          core_.on_lane_error(peer, lane, error, "saying goodbye");
          return;
        }
        shut_write_side(lane);
      }));
}

void Sender::shut_write_side(Lane& lane) {
  boost::system::error_code ignored;
  lane.link.socket().shutdown(Socket::shutdown_send, ignored);
  bool close_now = false;
  {
    const std::lock_guard lock(core_.mutex_);
    lane.write_shut = true;
    close_now = lane.eof;
    if (close_now) lane.closed = true;
  }
  if (close_now) lane.link.close();
  core_.notify_waiters();
}

}  // namespace pulseloco::transport::tcp
