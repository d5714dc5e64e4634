// A view of some ranks of a transport as a transport of their own: the collectives then run
// among those ranks only (a node's ranks, or one rank of every node) over the parent's links.
//
//   SubgroupTransport rail(parent, {1, 3, 5});  // rank 0 of the view is parent rank 1, ...
//   collectives::sparse_allgather(rail, mine, options);
//
// Numbering: the view's rank r is parent rank members[r]; every peer the view is given or
// reports (operations, errors' ErrorContext, lost_peers()) is in the view's numbering, and
// parent_rank() / rethrow_in_parent_numbering() translate back.
//
// Failure: abort() aborts the parent (with a reason that names the view's members), so that a
// failure in any view ends every exchange over the parent (a collective aborts its transport
// when it fails, and the parent's operations posted through the view can be withdrawn no other
// way). An optional hook runs first, while the parent can still send.
//
// Sequence numbers: the view numbers its own collective calls from `first_sequence` (every
// base tag alike). Collectives put these numbers into their tags, so two views with a pair of
// members in common, or a view and its parent, must not run calls with the same (base tag,
// number): draw `first_sequence` from the parent (parent.next_sequence(tag), on every member
// alike) for each view that runs one call. Views whose calls have distinct tags may run at the
// same time from different threads, as collectives with distinct base tags may on the parent.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

class SubgroupTransport final : public Transport {
 public:
  // Runs before the parent is aborted (once), with the peer the caller blamed in the parent's
  // numbering (abort_blaming; -1 for none, a non-member, or a plain abort()), the kind of its
  // failure and the abort's reason.
  using BeforeAbort = std::function<void(int culprit, ErrorKind kind, std::string_view reason)>;

  // `members`: the parent ranks of the view's ranks, in order, without repeats, the parent's
  // own rank among them (InvalidArgument otherwise). `parent` must outlive the view.
  SubgroupTransport(Transport& parent, std::vector<int> members, std::uint64_t first_sequence = 0,
                    BeforeAbort before_abort = {});

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return static_cast<int>(members_.size()); }
  [[nodiscard]] std::string_view backend() const noexcept override { return parent_.backend(); }
  [[nodiscard]] Device buffer_device() const noexcept override { return parent_.buffer_device(); }
  [[nodiscard]] bool matches_by_order() const noexcept override {
    return parent_.matches_by_order();
  }

  [[nodiscard]] std::unique_ptr<Request> isend(int peer, Tag tag,
                                               std::span<const std::byte> data) override;
  [[nodiscard]] std::unique_ptr<Request> irecv(int peer, Tag tag,
                                               std::span<std::byte> data) override;
  [[nodiscard]] std::unique_ptr<Request> iforward(int peer, Tag tag,
                                                  std::span<const std::byte> data,
                                                  const Request& earlier) override;
  void retire_tag(Tag tag) noexcept override { parent_.retire_tag(tag); }
  void abort(std::string_view reason) noexcept override;
  void abort_blaming(int peer, ErrorKind kind, std::string_view reason) noexcept override;
  // The parent's lost peers that are members, in the view's numbering and the parent's order.
  // A lost non-member is left out: it is no peer of the view (its loss shows in the parent and
  // in the views it belongs to).
  [[nodiscard]] std::vector<int> lost_peers() const override;
  // The parent's: the view moves its bytes.
  [[nodiscard]] TransportStats stats() const override { return parent_.stats(); }
  [[nodiscard]] std::uint64_t next_sequence(Tag base_tag) override;

  [[nodiscard]] Transport& parent() const noexcept { return parent_; }
  [[nodiscard]] const std::vector<int>& members() const noexcept { return members_; }
  // The parent rank of the view's rank `rank` (InvalidArgument when out of range).
  [[nodiscard]] int parent_rank(int rank) const;
  // The view's rank of parent rank `parent_rank`, or -1 for a non-member.
  [[nodiscard]] int rank_of(int parent_rank) const noexcept;
  // "ranks 1, 3, 5 of the parent group": for messages.
  [[nodiscard]] std::string describe() const;

  // Throws `error` again with the same kind, its ErrorContext's rank, peer and ranks in the
  // parent's numbering, and a message that says so: the message of an error raised over the
  // view numbers the view's ranks. `what` names the exchange that ran over the view.
  [[noreturn]] void rethrow_in_parent_numbering(const Error& error, std::string_view what) const;

 private:
  void check_peer(int peer) const;

  Transport& parent_;
  std::vector<int> members_;
  std::unordered_map<int, int> rank_of_;  // parent rank -> view rank
  int rank_ = -1;
  std::uint64_t first_sequence_;
  BeforeAbort before_abort_;
  std::once_flag before_abort_once_;
  std::mutex sequence_mutex_;
  std::unordered_map<Tag, std::uint64_t> sequences_;
};

// Throws an error of `kind` (the class that fixes it: TimeoutError for timeout, ...).
[[noreturn]] void throw_error_of_kind(ErrorKind kind, std::string_view message,
                                      ErrorContext context);

}  // namespace pulseloco::transport
