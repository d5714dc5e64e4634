#include <pulseloco/transport/inproc/ordered.h>

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/native_collectives.h>

namespace pulseloco::transport::inproc {
namespace {

enum class CollectiveKind : std::uint8_t { allgather, broadcast, barrier, allreduce };

// One point-to-point operation.
struct Op {
  bool is_send = false;
  int owner = 0;
  int peer = 0;
  std::span<std::byte> data;
  bool done = false;
  std::exception_ptr error;
};

// One rank's part of a native collective.
struct Collective {
  CollectiveKind kind = CollectiveKind::barrier;
  int root = 0;
  std::span<const std::byte> mine;                 // allgather, and allreduce's input
  std::span<const std::span<std::byte>> gathered;  // allgather
  std::span<std::byte> data;                       // broadcast, and allreduce's output
  bool done = false;
  std::exception_ptr error;
};

// What a rank launched: a group of point-to-point operations, or one native collective.
struct Launch {
  std::vector<std::shared_ptr<Op>> ops;
  std::shared_ptr<Collective> collective;
  std::uint64_t collective_index = 0;  // the rank's how-many-th collective
};

struct Rank {
  std::vector<std::shared_ptr<Op>> queued;
  std::deque<Launch> stream;  // the front is the running launch
  std::uint64_t collectives = 0;
  std::exception_ptr failure;  // aborted or destroyed
  TransportStats stats;
};

// The state every rank of a group shares; one lock for all.
struct World {
  explicit World(int n) : ranks(static_cast<std::size_t>(n)) {}
  std::mutex mutex;
  std::condition_variable changed;
  std::vector<Rank> ranks;
  // Per direction (from, to): sends and receives in posting order, not yet matched.
  std::map<std::pair<int, int>, std::deque<std::shared_ptr<Op>>> sends, receives;

  [[nodiscard]] int size() const { return static_cast<int>(ranks.size()); }
  Rank& rank(int r) { return ranks[static_cast<std::size_t>(r)]; }

  [[nodiscard]] bool running(const Rank& owner, const Op& op) const {
    if (owner.stream.empty()) return false;
    const auto& ops = owner.stream.front().ops;
    return std::any_of(ops.begin(), ops.end(), [&](const auto& o) { return o.get() == &op; });
  }

  void launch_locked(int r) {
    Rank& owner = rank(r);
    if (owner.queued.empty() || owner.failure) return;
    owner.stream.push_back({.ops = std::move(owner.queued)});
    owner.queued.clear();
    progress_locked();
  }

  // Moves every pair of matched, running operations and every collective all ranks run, then
  // retires completed launches, until nothing changes.
  void progress_locked() {
    for (bool changed_any = true; changed_any;) {
      changed_any = false;
      for (auto& [direction, queue] : sends) {
        auto& theirs = receives[direction];
        while (!queue.empty() && !theirs.empty()) {
          Op& send = *queue.front();
          Op& receive = *theirs.front();
          if (!running(rank(send.owner), send) || !running(rank(receive.owner), receive)) break;
          transfer(send, receive);
          queue.pop_front();
          theirs.pop_front();
          changed_any = true;
        }
      }
      changed_any = run_collective_locked() || changed_any;
      for (Rank& owner : ranks) {
        while (!owner.stream.empty() && finished(owner.stream.front())) {
          owner.stream.pop_front();
          changed_any = true;
        }
      }
    }
    changed.notify_all();
  }

  [[nodiscard]] static bool finished(const Launch& launch) {
    if (launch.collective) return launch.collective->done || launch.collective->error != nullptr;
    return std::all_of(launch.ops.begin(), launch.ops.end(),
                       [](const auto& op) { return op->done || op->error; });
  }

  void transfer(Op& send, Op& receive) {
    if (send.data.size() != receive.data.size()) {
      const std::string what = fmt::format(
          "order-matched message from rank {} to rank {}: the send has {} bytes, "
          "the receive {}",
          send.owner, receive.owner, send.data.size(), receive.data.size());
      send.error = std::make_exception_ptr(
          ProtocolError(what, ErrorContext{.rank = send.owner, .peer = receive.owner}));
      receive.error = std::make_exception_ptr(
          ProtocolError(what, ErrorContext{.rank = receive.owner, .peer = send.owner}));
      return;
    }
    std::memcpy(receive.data.data(), send.data.data(), send.data.size());
    send.done = receive.done = true;
    Rank& from = rank(send.owner);
    Rank& to = rank(receive.owner);
    from.stats.payload_bytes_sent += send.data.size();
    from.stats.wire_bytes_sent += send.data.size();
    ++from.stats.messages_sent;
    to.stats.payload_bytes_received += send.data.size();
    to.stats.wire_bytes_received += send.data.size();
    ++to.stats.messages_received;
  }

  // Runs the collective that is at the front of every rank's stream, if there is one.
  bool run_collective_locked() {
    std::vector<std::reference_wrapper<Collective>> parts;
    for (Rank& r : ranks) {
      if (r.stream.empty() || !r.stream.front().collective || r.stream.front().collective->done ||
          r.stream.front().collective->error)
        return false;
      parts.emplace_back(*r.stream.front().collective);
    }
    if (parts.empty()) return false;
    if (const std::string problem = mismatch(parts); !problem.empty()) {
      for (std::size_t r = 0; r < parts.size(); ++r)
        parts[r].get().error = std::make_exception_ptr(
            ProtocolError(problem, ErrorContext{.rank = static_cast<int>(r)}));
      return true;
    }
    execute(parts);
    for (Collective& part : parts)
      part.done = true;
    return true;
  }

  [[nodiscard]] static std::string mismatch(
      const std::vector<std::reference_wrapper<Collective>>& parts) {
    const Collective& first = parts.front();
    for (std::size_t r = 0; r < parts.size(); ++r) {
      const Collective& c = parts[r];
      bool same = c.kind == first.kind && c.root == first.root &&
                  c.data.size() == first.data.size() && c.mine.size() == first.mine.size();
      if (c.kind == CollectiveKind::allgather) {
        same = c.kind == first.kind && c.gathered.size() == parts.size() &&
               c.mine.size() == c.gathered[r].size();
        for (std::size_t k = 0; same && k < parts.size(); ++k)
          same = c.gathered[k].size() == first.gathered[k].size();
      }
      if (!same)
        return fmt::format("rank {}'s native collective differs from rank 0's (kind or sizes)", r);
    }
    return {};
  }

  static void execute(const std::vector<std::reference_wrapper<Collective>>& parts) {
    const Collective& first = parts.front();
    switch (first.kind) {
      case CollectiveKind::barrier:
        return;
      case CollectiveKind::broadcast: {
        const auto root = parts[static_cast<std::size_t>(first.root)].get().data;
        for (Collective& c : parts)
          if (c.data.data() != root.data() && !root.empty())
            std::memcpy(c.data.data(), root.data(), root.size());
        return;
      }
      case CollectiveKind::allgather:
        for (std::size_t from = 0; from < parts.size(); ++from) {
          const auto mine = parts[from].get().mine;
          for (Collective& c : parts)
            if (!mine.empty()) std::memcpy(c.gathered[from].data(), mine.data(), mine.size());
        }
        return;
      case CollectiveKind::allreduce: {
        const std::size_t count = first.mine.size() / sizeof(float);
        std::vector<float> sum(count);
        for (std::size_t r = 0; r < parts.size(); ++r) {
          const auto* in = reinterpret_cast<const float*>(parts[r].get().mine.data());
          for (std::size_t e = 0; e < count; ++e)
            sum[e] = r == 0 ? in[e] : sum[e] + in[e];
        }
        for (Collective& c : parts)
          if (count > 0) std::memcpy(c.data.data(), sum.data(), count * sizeof(float));
        return;
      }
    }
  }

  void fail_rank_locked(int r, std::exception_ptr error) {
    Rank& owner = rank(r);
    if (!owner.failure) owner.failure = error;
    const auto fail = [&](const std::shared_ptr<Op>& op) {
      if (!op->done && !op->error) op->error = error;
    };
    for (auto& op : owner.queued)
      fail(op);
    owner.queued.clear();
    for (Launch& launch : owner.stream) {
      for (auto& op : launch.ops)
        fail(op);
      if (launch.collective && !launch.collective->done) launch.collective->error = error;
    }
    owner.stream.clear();
    progress_locked();
  }
};

class OrderedRequest final : public Request {
 public:
  OrderedRequest(std::shared_ptr<World> world, std::shared_ptr<Op> op)
      : world_(std::move(world)), op_(std::move(op)) {}

  bool test() override {
    const std::lock_guard lock(world_->mutex);
    world_->launch_locked(op_->owner);
    if (op_->error) std::rethrow_exception(op_->error);
    return op_->done;
  }

  void wait(Deadline deadline) override {
    std::unique_lock lock(world_->mutex);
    world_->launch_locked(op_->owner);
    if (!world_->changed.wait_until(lock, deadline, [&] { return op_->done || op_->error; })) {
      throw TimeoutError(
          fmt::format("order-matched {} rank {} ({} bytes) did not complete in time",
                      op_->is_send ? "send to" : "receive from", op_->peer, op_->data.size()),
          ErrorContext{.rank = op_->owner, .peer = op_->peer});
    }
    if (op_->error) std::rethrow_exception(op_->error);
  }

 private:
  std::shared_ptr<World> world_;
  std::shared_ptr<Op> op_;
};

class OrderedTransport final : public Transport, public NativeCollectives {
 public:
  OrderedTransport(std::shared_ptr<World> world, int rank)
      : world_(std::move(world)), rank_(rank) {}
  ~OrderedTransport() override {
    const std::lock_guard lock(world_->mutex);
    world_->fail_rank_locked(rank_, std::make_exception_ptr(PeerLostError(
                                        "the transport was destroyed", {.rank = rank_})));
  }
  OrderedTransport(const OrderedTransport&) = delete;
  OrderedTransport& operator=(const OrderedTransport&) = delete;

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return world_->size(); }
  [[nodiscard]] std::string_view backend() const noexcept override { return "ordered"; }
  [[nodiscard]] bool matches_by_order() const noexcept override { return true; }

  std::unique_ptr<Request> isend(int peer, Tag /*tag*/, std::span<const std::byte> data) override {
    return post(true, peer, {const_cast<std::byte*>(data.data()), data.size()});
  }
  std::unique_ptr<Request> irecv(int peer, Tag /*tag*/, std::span<std::byte> data) override {
    return post(false, peer, data);
  }

  void abort(std::string_view reason) noexcept override {
    const std::lock_guard lock(world_->mutex);
    world_->fail_rank_locked(rank_, std::make_exception_ptr(AbortedError(reason, {.rank = rank_})));
  }

  [[nodiscard]] TransportStats stats() const override {
    const std::lock_guard lock(world_->mutex);
    return world_->rank(rank_).stats;
  }

  bool allgatherv(std::span<const std::byte> /*mine*/, std::span<const std::uint64_t> /*counts*/,
                  std::span<std::byte> /*out*/, Deadline /*deadline*/) override {
    return false;  // the collectives use allgather_into on order-matching transports
  }
  bool allgather_into(std::span<const std::byte> mine, std::span<const std::span<std::byte>> out,
                      Deadline deadline) override {
    run({.kind = CollectiveKind::allgather, .mine = mine, .gathered = out}, deadline);
    return true;
  }
  bool allreduce_sum(std::span<const float> input, std::span<float> output,
                     Deadline deadline) override {
    run({.kind = CollectiveKind::allreduce,
         .mine = std::as_bytes(input),
         .data = std::as_writable_bytes(output)},
        deadline);
    return true;
  }
  void broadcast(int root, std::span<std::byte> data, Deadline deadline) override {
    run({.kind = CollectiveKind::broadcast, .root = root, .data = data}, deadline);
  }
  void barrier(Deadline deadline) override { run({.kind = CollectiveKind::barrier}, deadline); }

 private:
  std::unique_ptr<Request> post(bool is_send, int peer, std::span<std::byte> data) {
    if (peer < 0 || peer >= size() || peer == rank_)
      throw InvalidArgument(fmt::format("peer {} is not another rank of {}", peer, size()),
                            {.rank = rank_});
    auto op =
        std::make_shared<Op>(Op{.is_send = is_send, .owner = rank_, .peer = peer, .data = data});
    const std::lock_guard lock(world_->mutex);
    Rank& me = world_->rank(rank_);
    if (me.failure) {
      op->error = me.failure;
    } else if (data.empty()) {
      op->done = true;
    } else {
      me.queued.push_back(op);
      auto& order = is_send ? world_->sends[{rank_, peer}] : world_->receives[{peer, rank_}];
      order.push_back(op);
    }
    return std::make_unique<OrderedRequest>(world_, op);
  }

  // Queues the collective behind everything launched so far and waits for it.
  void run(Collective part, Deadline deadline) {
    auto collective = std::make_shared<Collective>(part);
    std::unique_lock lock(world_->mutex);
    Rank& me = world_->rank(rank_);
    if (me.failure) std::rethrow_exception(me.failure);
    world_->launch_locked(rank_);
    me.stream.push_back({.collective = collective, .collective_index = me.collectives++});
    world_->progress_locked();
    if (!world_->changed.wait_until(lock, deadline,
                                    [&] { return collective->done || collective->error; })) {
      throw TimeoutError("order-matched native collective did not complete in time",
                         {.rank = rank_});
    }
    if (collective->error) std::rethrow_exception(collective->error);
  }

  std::shared_ptr<World> world_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Transport>> make_ordered_group(int world_size) {
  if (world_size < 1) throw InvalidArgument("make_ordered_group: world size must be positive");
  auto world = std::make_shared<World>(world_size);
  std::vector<std::unique_ptr<Transport>> group;
  for (int rank = 0; rank < world_size; ++rank)
    group.push_back(std::make_unique<OrderedTransport>(world, rank));
  return group;
}

}  // namespace pulseloco::transport::inproc
