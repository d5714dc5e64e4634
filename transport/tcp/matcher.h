// Matching a peer's messages with the receives posted for them (internal header of the TCP
// transport). The n-th message a peer sends under a tag matches the n-th irecv posted for that
// (peer, tag). A message whose irecv is posted is read straight into the receive's buffer; one
// that arrives first (an early message) is kept in memory of its own, up to a cap shared by all
// peers, and copied once its receive is posted. When the receive is posted while the message
// arrives, the chunks still to come go straight into the receive's buffer and only those that
// came early are copied.
//
// A MessageMatcher keeps this for one peer. It only decides; the caller holds the transport's
// lock around every call, reads the bytes, and applies what a call returns (counting a
// completed receive, waking its waiter, resuming connections once early bytes are given back).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/tcp/frame.h>
#include <pulseloco/transport/tcp/operation.h>

namespace pulseloco::transport::tcp {

// The memory held for early messages, over all peers of a transport.
class UnexpectedBytes {
 public:
  explicit UnexpectedBytes(std::size_t cap) noexcept : cap_(cap) {}
  [[nodiscard]] bool fits(std::uint64_t bytes) const noexcept { return held_ + bytes <= cap_; }
  void take(std::uint64_t bytes) noexcept { held_ += bytes; }
  void give_back(std::uint64_t bytes) noexcept { held_ -= bytes; }
  [[nodiscard]] std::size_t held() const noexcept { return held_; }

 private:
  std::size_t held_ = 0;
  const std::size_t cap_;
};

// What a call changed, for the caller to apply.
struct MatchOutcome {
  Operation* completed = nullptr;  // this receive completed now: count it
  bool receive_changed = false;    // a receive completed, failed or got early bytes: wake it
  std::uint64_t released = 0;      // early bytes given back to UnexpectedBytes
};

// Where the payload of a data frame that starts arriving goes.
struct FrameTarget {
  enum class Action : std::uint8_t {
    read,     // read `chunk_bytes` into `target` (null: read and drop)
    pause,    // keeping it early would exceed the cap: stop reading this connection
    violate,  // the frame breaks the rules: `violation`, at `violation_offset`
  };
  Action action = Action::read;
  std::byte* target = nullptr;
  bool stashed = false;         // the target is the early memory, not the receive's buffer
  bool receive_failed = false;  // the frame failed the posted receive (size mismatch)
  std::string violation;
  std::optional<std::uint64_t> violation_offset;
};

class MessageMatcher {
 public:
  // `context` names this rank and the peer in the errors it makes.
  MessageMatcher(ErrorContext context, UnexpectedBytes& unexpected)
      : context_(std::move(context)), unexpected_(unexpected) {}

  // The sequence number of the next message sent to the peer under `tag`.
  [[nodiscard]] std::uint64_t next_send_sequence(Tag tag) { return next_send_[tag]++; }
  // Forgets the message counters of `tag` (Transport::retire_tag).
  void retire_tag(Tag tag) noexcept;
  // Message counters kept, one per tag and direction in use.
  [[nodiscard]] std::size_t tag_counters() const noexcept {
    return next_send_.size() + next_receive_.size();
  }

  // A receive posted (op->recv_buffer, op->tag set): numbers it and matches it with what has
  // arrived. `failure`: the peer has failed, so a receive of a message that never arrived
  // fails with it. `paused_for` is set to the message's key when nothing of it has arrived (a
  // paused connection may wait for exactly that message).
  MatchOutcome post_receive(const std::shared_ptr<Operation>& op, const std::exception_ptr& failure,
                            std::optional<MessageKey>& paused_for);
  // Whether the receive of message `key` is posted.
  [[nodiscard]] bool receive_posted(const MessageKey& key) const;
  // A self-send from this rank to itself: delivers `data` to the posted receive of `key`, or
  // keeps a copy until it is posted. Returns the bytes copied.
  std::uint64_t deliver_to_self(const MessageKey& key, std::span<const std::byte> data,
                                MatchOutcome& outcome);

  // A data frame starts arriving.
  [[nodiscard]] FrameTarget begin_frame(const FrameHeader& frame);
  // A frame that started arriving early (stashed) and still has `remaining` bytes to come: once
  // its receive is posted, the rest goes straight to the receive's buffer. Returns where, or
  // null while the rest must still go to the early memory.
  [[nodiscard]] std::byte* redirect_rest(const MessageKey& key, const FrameHeader& frame,
                                         std::uint64_t remaining);
  // A data frame arrived completely; `verified`: its payload checksum matched.
  MatchOutcome finish_frame(const MessageKey& key, const FrameHeader& frame, bool verified);

  // The receive `op` was abandoned: whatever still arrives for it is read and dropped.
  void abandon(const std::shared_ptr<Operation>& op) noexcept;
  // Every posted receive still waiting for its message fails with `error`.
  void fail_receives(const std::exception_ptr& error) noexcept;
  // The connections to the peer are closed: messages that can no longer complete are dropped
  // (their receives fail with `error`); complete early ones stay receivable. Returns the early
  // bytes given back.
  std::uint64_t drop_incomplete(const std::exception_ptr& error);

 private:
  // One message, identified by its key: a receive posted before anything arrived, a message
  // arriving, or a message that arrived before its receive (kept in `stash`).
  struct Slot {
    struct Range {
      std::uint64_t end = 0;
      bool stashed = false;  // went to the stash, not straight to the receive's buffer
    };
    std::shared_ptr<Operation> op;  // the irecv, once posted
    std::unique_ptr<std::byte[]> stash;
    std::uint64_t message_bytes = 0;
    std::uint64_t claimed = 0;              // bytes of chunks that have started arriving
    std::uint64_t received = 0;             // bytes of chunks that have arrived completely
    std::uint64_t stashed_bytes = 0;        // bytes of chunks that went to the stash
    std::map<std::uint64_t, Range> ranges;  // chunks of a striped message that started arriving
    bool announced = false;                 // a frame has arrived, so message_bytes is known
    bool discard = false;  // nobody wants it (size mismatch, abandoned): read and drop
    bool to_user = false;  // its irecv is posted: later chunks go straight to its buffer
    std::vector<VerifiedFrame> verified;  // frames whose checksum matched, in arrival order
    [[nodiscard]] bool complete() const noexcept { return announced && received == message_bytes; }
  };

  [[nodiscard]] std::exception_ptr size_mismatch(Tag tag, std::uint64_t sent,
                                                 std::uint64_t expected) const;

  ErrorContext context_;
  UnexpectedBytes& unexpected_;
  std::unordered_map<Tag, std::uint64_t> next_send_;
  std::unordered_map<Tag, std::uint64_t> next_receive_;
  std::unordered_map<MessageKey, Slot, MessageKeyHash> slots_;
};

}  // namespace pulseloco::transport::tcp
