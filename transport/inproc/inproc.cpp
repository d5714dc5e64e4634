#include <pulseloco/transport/inproc/inproc.h>

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <string>
#include <unordered_map>
#include <utility>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::transport::inproc {

std::string_view fault_action_name(FaultAction action) noexcept {
  switch (action) {
    case FaultAction::deliver:
      return "deliver";
    case FaultAction::drop:
      return "drop";
    case FaultAction::corrupt:
      return "corrupt";
    case FaultAction::stall_sender:
      return "stall";
    case FaultAction::kill_sender:
      return "kill";
  }
  return "unknown";
}

struct Fabric;

struct FaultInjector::Impl {
  mutable std::mutex mutex;
  FaultHook hook;
  std::vector<InjectedFault> injected;
  std::weak_ptr<Fabric> fabric;
  int world_size = 0;

  void record(InjectedFault fault) {
    const std::lock_guard lock(mutex);
    injected.push_back(std::move(fault));
  }
  [[nodiscard]] FaultHook current_hook() const {
    const std::lock_guard lock(mutex);
    return hook;
  }
};

namespace {

enum class OpStatus : std::uint8_t {
  pending,  // posted (or held, for a stalled sender)
  claimed,  // a sender thread is copying into the receive buffer right now
  done,
  failed,
};

// One isend or irecv. Guarded by Fabric::mutex.
struct Op {
  bool is_send = false;
  int owner = 0;  // the rank that posted it
  int peer = 0;
  Tag tag = 0;
  std::span<std::byte> buffer;  // receive destination
  std::size_t bytes = 0;
  OpStatus status = OpStatus::pending;
  std::exception_ptr error;
  std::condition_variable changed;
};

struct Message {
  std::vector<std::byte> bytes;
  Digest checksum = 0;
};

struct ChannelKey {
  int from = 0;
  int to = 0;
  Tag tag = 0;
  friend bool operator==(const ChannelKey&, const ChannelKey&) = default;
};

struct ChannelKeyHash {
  std::size_t operator()(const ChannelKey& key) const noexcept {
    std::uint64_t h = key.tag * 0x9E3779B97F4A7C15ULL;
    h ^= (static_cast<std::uint64_t>(static_cast<std::uint32_t>(key.from)) << 32) |
         static_cast<std::uint32_t>(key.to);
    return static_cast<std::size_t>(h * 0xBF58476D1CE4E5B9ULL);
  }
};

// Messages from one rank to another under one tag. Invariant: `posted` is empty unless
// `unexpected` is, except for a stalled receiver (whose receives are never matched).
struct Channel {
  std::deque<Message> unexpected;
  std::deque<std::shared_ptr<Op>> posted;
};

struct RankInfo {
  bool closed = false;  // aborted, destroyed or killed
  bool frozen = false;  // stalled: peers see a silent but open connection
  std::string close_reason;
  std::vector<std::shared_ptr<Op>> held_sends;  // sends of a stalled rank: never complete
  std::vector<int> corrupt_from;                // peers whose frames to this rank were corrupt
  std::vector<int> lost;  // peers lost, in the order this rank saw it (Transport::lost_peers)
  std::uint64_t next_index = 0;
  std::uint64_t bytes_offered = 0;
  TransportStats stats;
  int copies_in_flight = 0;  // copies into this rank's receive buffers outside the lock
};

[[nodiscard]] std::string tag_text(Tag tag) {
  return fmt::format("{:#x}", tag);
}

}  // namespace

struct Fabric {
  explicit Fabric(int world_size, std::size_t header)
      : ranks(static_cast<std::size_t>(world_size)), header_bytes(header) {}

  std::mutex mutex;
  std::condition_variable copies_done;
  std::vector<RankInfo> ranks;
  std::unordered_map<ChannelKey, Channel, ChannelKeyHash> channels;
  std::shared_ptr<FaultInjector::Impl> faults;
  std::size_t header_bytes;

  [[nodiscard]] int world_size() const noexcept { return static_cast<int>(ranks.size()); }
  RankInfo& info(int rank) { return ranks[static_cast<std::size_t>(rank)]; }

  // Peers see a rank as gone once it closed, unless it is frozen (a stopped process keeps its
  // sockets open).
  [[nodiscard]] bool gone(int rank) {
    const RankInfo& r = info(rank);
    return r.closed && !r.frozen;
  }
  [[nodiscard]] bool corrupt_link(int from, int to) {
    const auto& list = info(to).corrupt_from;
    return std::find(list.begin(), list.end(), from) != list.end();
  }

  static void finish(Op& op) {
    op.status = OpStatus::done;
    op.changed.notify_all();
  }
  static void fail(Op& op, std::exception_ptr error) {
    op.status = OpStatus::failed;
    op.error = std::move(error);
    op.changed.notify_all();
  }

  [[nodiscard]] std::exception_ptr local_abort_error(int rank, const Op& op) {
    return std::make_exception_ptr(
        AbortedError(info(rank).close_reason, {.rank = rank, .peer = op.peer}));
  }
  [[nodiscard]] static std::exception_ptr peer_closed_error(int rank, int peer) {
    return std::make_exception_ptr(PeerLostError(fmt::format("peer {} closed the connection", peer),
                                                 {.rank = rank, .peer = peer}));
  }
  [[nodiscard]] static std::exception_ptr corrupt_link_error(int rank, int peer) {
    return std::make_exception_ptr(ProtocolError(
        fmt::format("the connection from peer {} was dropped after a corrupt frame", peer),
        {.rank = rank, .peer = peer}));
  }

  void erase_if_empty(const ChannelKey& key) {
    const auto it = channels.find(key);
    if (it != channels.end() && it->second.unexpected.empty() && it->second.posted.empty()) {
      channels.erase(it);
    }
  }

  // Fails the receives posted on channels matching `pred` with `make_error(op)`.
  template <typename Pred, typename MakeError>
  void fail_posted(Pred pred, MakeError make_error) {
    for (auto it = channels.begin(); it != channels.end();) {
      if (pred(it->first)) {
        for (const auto& op : it->second.posted)
          fail(*op, make_error(*op));
        it->second.posted.clear();
        if (it->second.unexpected.empty()) {
          it = channels.erase(it);
          continue;
        }
      }
      ++it;
    }
  }

  // Closes `rank` (abort, destruction or kill): its own operations fail with "aborted", and
  // unless it is frozen its peers see the connection close. `orderly` (destruction without an
  // abort, as a TCP transport says goodbye): its peers do not count it as lost. Returns once no
  // other thread is still copying into its receive buffers, so they may be reused.
  void close(std::unique_lock<std::mutex>& lock, int rank, std::string_view reason,
             bool orderly = false) {
    RankInfo& me = info(rank);
    if (!me.closed) {
      me.closed = true;
      me.close_reason = std::string(reason);
      fail_posted([rank](const ChannelKey& key) { return key.to == rank; },
                  [&](const Op& op) { return local_abort_error(rank, op); });
      for (const auto& op : me.held_sends)
        fail(*op, local_abort_error(rank, *op));
      me.held_sends.clear();
      if (!me.frozen) {
        fail_posted([rank](const ChannelKey& key) { return key.from == rank; },
                    [rank](const Op& op) { return peer_closed_error(op.owner, rank); });
        if (!orderly) tell_peers_lost(rank);
      }
    }
    copies_done.wait(lock, [&] { return info(rank).copies_in_flight == 0; });
  }

  void kill(std::unique_lock<std::mutex>& lock, int rank) {
    info(rank).frozen = false;  // SIGKILL ends a stopped process too: its sockets close
    if (info(rank).closed) {
      // Already closed while frozen: its peers must now see the connection go.
      fail_posted([rank](const ChannelKey& key) { return key.from == rank; },
                  [rank](const Op& op) { return peer_closed_error(op.owner, rank); });
      tell_peers_lost(rank);
      return;
    }
    close(lock, rank, "killed by fault injection");
  }

  // Every open rank sees `rank`'s connection close now (lock held).
  void tell_peers_lost(int rank) {
    for (int peer = 0; peer < world_size(); ++peer) {
      RankInfo& other = info(peer);
      if (peer != rank && !other.closed &&
          std::find(other.lost.begin(), other.lost.end(), rank) == other.lost.end()) {
        other.lost.push_back(rank);
      }
    }
  }

  void stall(int rank) { info(rank).frozen = true; }

  // Copies a message into a claimed receive and checks it as the receiving side of a wire would.
  // Runs without the lock. Returns the error for the receive, if any.
  // A copy's outcome: its error, and whether that is a failed checksum (the link is then
  // corrupt, as a wire transport drops the connection).
  struct CopyResult {
    std::exception_ptr error;
    bool checksum_failed = false;
  };

  [[nodiscard]] static CopyResult copy_into(const Op& recv, std::span<const std::byte> bytes,
                                            Digest checksum, bool corrupt_now) {
    if (bytes.size() != recv.buffer.size()) {
      return {std::make_exception_ptr(ProtocolError(
          fmt::format("message of {} bytes from peer {} under tag {} where {} bytes were "
                      "expected",
                      bytes.size(), recv.peer, tag_text(recv.tag), recv.buffer.size()),
          {.rank = recv.owner, .peer = recv.peer}))};
    }
    if (!bytes.empty()) std::memcpy(recv.buffer.data(), bytes.data(), bytes.size());
    if (corrupt_now) {
      if (recv.buffer.empty()) {
        checksum = ~checksum;  // nothing to flip in the payload: the header is hit instead
      } else {
        recv.buffer[recv.buffer.size() / 2] ^= std::byte{0x20};
      }
    }
    if (digest_bytes(recv.buffer) != checksum) {
      return {std::make_exception_ptr(
                  ProtocolError(fmt::format("frame of {} bytes from peer {} under tag {} failed "
                                            "its checksum (corrupted in flight)",
                                            recv.buffer.size(), recv.peer, tag_text(recv.tag)),
                                {.rank = recv.owner, .peer = recv.peer})),
              true};
    }
    return {};
  }

  // Finishes a receive after copy_into (lock held).
  void complete_receive(Op& recv, std::exception_ptr error, bool checksum_failed) {
    RankInfo& owner = info(recv.owner);
    --owner.copies_in_flight;
    copies_done.notify_all();
    if (error) {
      if (checksum_failed && !corrupt_link(recv.peer, recv.owner)) {
        owner.corrupt_from.push_back(recv.peer);
        if (std::find(owner.lost.begin(), owner.lost.end(), recv.peer) == owner.lost.end())
          owner.lost.push_back(recv.peer);  // as a wire transport drops the connection
        const int from = recv.peer;
        const int to = recv.owner;
        fail_posted([&](const ChannelKey& key) { return key.from == from && key.to == to; },
                    [&](const Op& op) { return corrupt_link_error(op.owner, from); });
      }
      fail(recv, std::move(error));
      return;
    }
    owner.stats.payload_bytes_received += recv.buffer.size();
    owner.stats.wire_bytes_received += recv.buffer.size() + header_bytes;
    ++owner.stats.messages_received;
    finish(recv);
  }

  // Claims the first posted receive of `key` when the receiver may match it.
  [[nodiscard]] std::shared_ptr<Op> claim_posted(const ChannelKey& key) {
    if (info(key.to).frozen || info(key.to).closed) return nullptr;
    const auto it = channels.find(key);
    if (it == channels.end() || it->second.posted.empty()) return nullptr;
    std::shared_ptr<Op> recv = std::move(it->second.posted.front());
    it->second.posted.pop_front();
    erase_if_empty(key);
    recv->status = OpStatus::claimed;
    ++info(key.to).copies_in_flight;
    return recv;
  }

  void record(FaultAction action, int rank, std::optional<MessageEvent> event) {
    if (faults) {
      faults->record({.when = Clock::now(), .action = action, .rank = rank, .event = event});
    }
  }
};

namespace {

class InprocRequest final : public Request {
 public:
  InprocRequest(std::shared_ptr<Fabric> fabric, std::shared_ptr<Op> op)
      : fabric_(std::move(fabric)), op_(std::move(op)) {}

  ~InprocRequest() override {
    std::unique_lock lock(fabric_->mutex);
    // A claimed receive is being written by a sender thread: wait for it, so that the buffer
    // may be reused as soon as the request is gone.
    op_->changed.wait(lock, [&] { return op_->status != OpStatus::claimed; });
    if (op_->status != OpStatus::pending) return;
    if (op_->is_send) {
      auto& held = fabric_->info(op_->owner).held_sends;
      std::erase(held, op_);
      return;
    }
    const ChannelKey key{op_->peer, op_->owner, op_->tag};
    const auto it = fabric_->channels.find(key);
    if (it == fabric_->channels.end()) return;
    std::erase(it->second.posted, op_);
    fabric_->erase_if_empty(key);
  }
  InprocRequest(const InprocRequest&) = delete;
  InprocRequest& operator=(const InprocRequest&) = delete;

  [[nodiscard]] bool test() override {
    const std::lock_guard lock(fabric_->mutex);
    return finished_or_throw();
  }

  void wait(Deadline deadline) override {
    std::unique_lock lock(fabric_->mutex);
    op_->changed.wait_until(lock, deadline, [&] {
      return op_->status == OpStatus::done || op_->status == OpStatus::failed;
    });
    if (finished_or_throw()) return;
    throw TimeoutError(
        fmt::format("deadline passed while waiting to {} {} bytes {} peer {} under tag {}",
                    op_->is_send ? "send" : "receive", op_->bytes, op_->is_send ? "to" : "from",
                    op_->peer, tag_text(op_->tag)),
        {.rank = op_->owner, .peer = op_->peer});
  }

 private:
  bool finished_or_throw() {
    if (op_->status == OpStatus::failed) std::rethrow_exception(op_->error);
    return op_->status == OpStatus::done;
  }

  std::shared_ptr<Fabric> fabric_;
  std::shared_ptr<Op> op_;
};

class InprocTransport final : public Transport {
 public:
  InprocTransport(std::shared_ptr<Fabric> fabric, int rank)
      : fabric_(std::move(fabric)), rank_(rank) {}
  ~InprocTransport() override {
    std::unique_lock lock(fabric_->mutex);
    fabric_->close(lock, rank_, "transport destroyed", /*orderly=*/true);
  }
  InprocTransport(const InprocTransport&) = delete;
  InprocTransport& operator=(const InprocTransport&) = delete;

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return fabric_->world_size(); }
  [[nodiscard]] std::string_view backend() const noexcept override { return "inproc"; }

  [[nodiscard]] std::unique_ptr<Request> isend(int peer, Tag tag,
                                               std::span<const std::byte> data) override {
    check_peer(peer, "isend");
    auto op = std::make_shared<Op>();
    op->is_send = true;
    op->owner = rank_;
    op->peer = peer;
    op->tag = tag;
    op->bytes = data.size();
    auto request = std::make_unique<InprocRequest>(fabric_, op);
    Fabric& f = *fabric_;

    MessageEvent event{.from = rank_, .to = peer, .tag = tag, .bytes = data.size()};
    {
      const std::lock_guard lock(f.mutex);
      RankInfo& me = f.info(rank_);
      event.index = me.next_index++;
      event.bytes_sent_before = me.bytes_offered;
      me.bytes_offered += data.size();
    }
    FaultAction action = FaultAction::deliver;
    if (f.faults) {
      if (const FaultHook hook = f.faults->current_hook()) action = hook(event);
    }
    const Digest checksum = digest_bytes(data);
    const bool corrupt = action == FaultAction::corrupt;

    std::unique_lock lock(f.mutex);
    RankInfo& me = f.info(rank_);
    if (me.closed) {
      Fabric::fail(*op, f.local_abort_error(rank_, *op));
      return request;
    }
    if (action == FaultAction::kill_sender) {
      f.record(action, rank_, event);
      f.kill(lock, rank_);
      Fabric::fail(*op, f.local_abort_error(rank_, *op));
      return request;
    }
    if (action == FaultAction::stall_sender) {
      f.record(action, rank_, event);
      f.stall(rank_);
    }
    if (me.frozen) {
      me.held_sends.push_back(op);  // a stopped process sends nothing
      return request;
    }
    if (f.gone(peer)) {
      Fabric::fail(*op, Fabric::peer_closed_error(rank_, peer));
      return request;
    }
    me.stats.payload_bytes_sent += data.size();
    me.stats.wire_bytes_sent += data.size() + f.header_bytes;
    ++me.stats.messages_sent;
    if (action == FaultAction::drop) {
      f.record(action, rank_, event);
      Fabric::finish(*op);
      return request;
    }
    if (corrupt) f.record(action, rank_, event);

    const ChannelKey key{rank_, peer, tag};
    if (std::shared_ptr<Op> recv = f.claim_posted(key)) {
      lock.unlock();
      auto [error, checksum_failed] = Fabric::copy_into(*recv, data, checksum, corrupt);
      lock.lock();
      f.complete_receive(*recv, std::move(error), checksum_failed);
      Fabric::finish(*op);
      return request;
    }

    // No receive posted yet: queue a copy (made without the lock).
    lock.unlock();
    Message message{.bytes = std::vector<std::byte>(data.begin(), data.end()),
                    .checksum = checksum};
    if (corrupt) {
      if (message.bytes.empty()) {
        message.checksum = ~message.checksum;
      } else {
        message.bytes[message.bytes.size() / 2] ^= std::byte{0x20};
      }
    }
    lock.lock();
    if (f.gone(peer)) {
      Fabric::fail(*op, Fabric::peer_closed_error(rank_, peer));
      return request;
    }
    if (std::shared_ptr<Op> recv = f.claim_posted(key)) {  // posted meanwhile
      lock.unlock();
      auto [error, checksum_failed] =
          Fabric::copy_into(*recv, message.bytes, message.checksum, false);
      lock.lock();
      f.complete_receive(*recv, std::move(error), checksum_failed);
    } else {
      f.channels[key].unexpected.push_back(std::move(message));
    }
    Fabric::finish(*op);
    return request;
  }

  [[nodiscard]] std::unique_ptr<Request> irecv(int peer, Tag tag,
                                               std::span<std::byte> data) override {
    check_peer(peer, "irecv");
    auto op = std::make_shared<Op>();
    op->owner = rank_;
    op->peer = peer;
    op->tag = tag;
    op->buffer = data;
    op->bytes = data.size();
    auto request = std::make_unique<InprocRequest>(fabric_, op);
    Fabric& f = *fabric_;

    std::unique_lock lock(f.mutex);
    RankInfo& me = f.info(rank_);
    if (me.closed) {
      Fabric::fail(*op, f.local_abort_error(rank_, *op));
      return request;
    }
    if (f.corrupt_link(peer, rank_)) {
      Fabric::fail(*op, Fabric::corrupt_link_error(rank_, peer));
      return request;
    }
    const ChannelKey key{peer, rank_, tag};
    Channel& channel = f.channels[key];
    if (me.frozen) {
      channel.posted.push_back(op);  // never matched while frozen
      return request;
    }
    if (!channel.unexpected.empty()) {
      Message message = std::move(channel.unexpected.front());
      channel.unexpected.pop_front();
      f.erase_if_empty(key);
      op->status = OpStatus::claimed;
      ++me.copies_in_flight;
      lock.unlock();
      auto [error, checksum_failed] =
          Fabric::copy_into(*op, message.bytes, message.checksum, false);
      lock.lock();
      f.complete_receive(*op, std::move(error), checksum_failed);
      return request;
    }
    if (f.gone(peer)) {
      f.erase_if_empty(key);
      Fabric::fail(*op, Fabric::peer_closed_error(rank_, peer));
      return request;
    }
    channel.posted.push_back(op);
    return request;
  }

  void abort(std::string_view reason) noexcept override {
    try {
      std::unique_lock lock(fabric_->mutex);
      fabric_->close(lock, rank_, reason);
    } catch (...) {
      // Formatting the reason could only fail on memory exhaustion; the rank stays usable.
    }
  }

  [[nodiscard]] TransportStats stats() const override {
    const std::lock_guard lock(fabric_->mutex);
    return fabric_->info(rank_).stats;
  }

  [[nodiscard]] std::vector<int> lost_peers() const override {
    const std::lock_guard lock(fabric_->mutex);
    return fabric_->info(rank_).lost;
  }

 private:
  void check_peer(int peer, std::string_view operation) const {
    if (peer < 0 || peer >= size() || peer == rank_) {
      throw InvalidArgument(fmt::format("{}: peer {} is not another rank of this group of {}",
                                        operation, peer, size()),
                            {.rank = rank_, .peer = peer});
    }
  }

  std::shared_ptr<Fabric> fabric_;
  int rank_;
};

}  // namespace

FaultInjector::FaultInjector() : impl_(std::make_shared<Impl>()) {}
FaultInjector::~FaultInjector() = default;

void FaultInjector::set_hook(FaultHook hook) {
  const std::lock_guard lock(impl_->mutex);
  impl_->hook = std::move(hook);
}

namespace {
void act_now(FaultInjector::Impl& impl, int rank, FaultAction action) {
  std::shared_ptr<Fabric> fabric = impl.fabric.lock();
  if (!fabric) {
    throw InvalidArgument("fault injector: not attached to a live inproc group");
  }
  if (rank < 0 || rank >= fabric->world_size()) {
    throw InvalidArgument(fmt::format("fault injector: rank {} is not in this group of {}", rank,
                                      fabric->world_size()),
                          {.peer = rank});
  }
  std::unique_lock lock(fabric->mutex);
  if (action == FaultAction::kill_sender) {
    fabric->kill(lock, rank);
  } else {
    fabric->stall(rank);
  }
  lock.unlock();
  impl.record({.when = Clock::now(), .action = action, .rank = rank, .event = std::nullopt});
}
}  // namespace

void FaultInjector::kill(int rank) {
  act_now(*impl_, rank, FaultAction::kill_sender);
}
void FaultInjector::stall(int rank) {
  act_now(*impl_, rank, FaultAction::stall_sender);
}

std::vector<InjectedFault> FaultInjector::injected() const {
  const std::lock_guard lock(impl_->mutex);
  return impl_->injected;
}

std::vector<std::unique_ptr<Transport>> make_group(int world_size, InprocOptions options) {
  if (world_size < 1) {
    throw InvalidArgument(
        fmt::format("inproc group: world size {} must be at least 1", world_size));
  }
  auto fabric = std::make_shared<Fabric>(world_size, options.header_bytes);
  if (options.faults) {
    const std::shared_ptr<FaultInjector::Impl>& impl = options.faults->impl();
    const std::lock_guard lock(impl->mutex);
    if (!impl->fabric.expired()) {
      throw InvalidArgument("inproc group: this fault injector already serves a live group");
    }
    impl->fabric = fabric;
    impl->world_size = world_size;
    fabric->faults = impl;
  }
  std::vector<std::unique_ptr<Transport>> transports;
  transports.reserve(static_cast<std::size_t>(world_size));
  for (int rank = 0; rank < world_size; ++rank) {
    transports.push_back(std::make_unique<InprocTransport>(fabric, rank));
  }
  return transports;
}

}  // namespace pulseloco::transport::inproc
