#include <pulseloco/transport/subgroup.h>

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <utility>

namespace pulseloco::transport {

void throw_error_of_kind(ErrorKind kind, std::string_view message, ErrorContext context) {
  switch (kind) {
    case ErrorKind::invalid_argument:
      throw InvalidArgument(message, std::move(context));
    case ErrorKind::io:
      throw IoError(message, std::move(context));
    case ErrorKind::timeout:
      throw TimeoutError(message, std::move(context));
    case ErrorKind::peer_lost:
      throw PeerLostError(message, std::move(context));
    case ErrorKind::protocol:
      throw ProtocolError(message, std::move(context));
    case ErrorKind::divergence:
      throw DivergenceError(message, std::move(context));
    case ErrorKind::non_finite:
      throw NonFiniteError(message, std::move(context));
    case ErrorKind::membership:
      throw MembershipError(message, std::move(context));
    case ErrorKind::aborted:
      throw AbortedError(message, std::move(context));
  }
  throw PeerLostError(message, std::move(context));
}

namespace {

// A parent's operation seen through the view: its errors name the view's ranks.
class ViewRequest final : public Request {
 public:
  ViewRequest(const SubgroupTransport& view, std::unique_ptr<Request> inner)
      : view_(view), inner_(std::move(inner)) {}

  [[nodiscard]] bool test() override {
    try {
      return inner_->test();
    } catch (const Error& error) {
      rethrow_in_view_numbering(error);
    }
  }
  void wait(Deadline deadline) override {
    try {
      inner_->wait(deadline);
    } catch (const Error& error) {
      rethrow_in_view_numbering(error);
    }
  }
  [[nodiscard]] const Request& inner() const noexcept { return *inner_; }

 private:
  [[noreturn]] void rethrow_in_view_numbering(const Error& error) const {
    ErrorContext context = error.context();
    const auto to_view = [&](std::optional<int> parent_rank) -> std::optional<int> {
      if (!parent_rank) return std::nullopt;
      const int rank = view_.rank_of(*parent_rank);
      return rank < 0 ? std::nullopt : std::optional<int>(rank);
    };
    context.rank = to_view(context.rank);
    context.peer = to_view(context.peer);
    std::vector<int> ranks;
    for (const int parent_rank : context.ranks) {
      if (const int rank = view_.rank_of(parent_rank); rank >= 0) ranks.push_back(rank);
    }
    context.ranks = std::move(ranks);
    std::string note;
    if (const auto parent_peer = error.context().peer) {
      note = context.peer ? fmt::format(
                                " (said by the parent transport: its peer {} is rank {} "
                                "of this view of {})",
                                *parent_peer, *context.peer, view_.describe())
                          : fmt::format(
                                " (said by the parent transport; its peer {} is not in "
                                "this view of {})",
                                *parent_peer, view_.describe());
    }
    throw_error_of_kind(error.kind(), error.message() + note, std::move(context));
  }

  const SubgroupTransport& view_;
  std::unique_ptr<Request> inner_;
};

}  // namespace

SubgroupTransport::SubgroupTransport(Transport& parent, std::vector<int> members,
                                     std::uint64_t first_sequence, BeforeAbort before_abort)
    : parent_(parent),
      members_(std::move(members)),
      first_sequence_(first_sequence),
      before_abort_(std::move(before_abort)) {
  const int parent_size = parent_.size();
  for (std::size_t i = 0; i < members_.size(); ++i) {
    const int member = members_[i];
    if (member < 0 || member >= parent_size) {
      throw InvalidArgument(fmt::format("SubgroupTransport: member {} is not a rank of a group "
                                        "of {}",
                                        member, parent_size),
                            {.rank = parent_.rank()});
    }
    if (!rank_of_.emplace(member, static_cast<int>(i)).second) {
      throw InvalidArgument(fmt::format("SubgroupTransport: rank {} is listed twice", member),
                            {.rank = parent_.rank()});
    }
  }
  rank_ = rank_of(parent_.rank());
  if (rank_ < 0) {
    throw InvalidArgument(
        fmt::format("SubgroupTransport: this rank is not among the members ({})", describe()),
        {.rank = parent_.rank()});
  }
}

void SubgroupTransport::check_peer(int peer) const {
  if (peer < 0 || peer >= size()) {
    throw InvalidArgument(
        fmt::format("SubgroupTransport: peer {} is not a rank of a view of {}", peer, size()),
        {.rank = rank_, .peer = peer});
  }
}

int SubgroupTransport::parent_rank(int rank) const {
  check_peer(rank);
  return members_[static_cast<std::size_t>(rank)];
}

int SubgroupTransport::rank_of(int parent_rank) const noexcept {
  const auto found = rank_of_.find(parent_rank);
  return found == rank_of_.end() ? -1 : found->second;
}

std::string SubgroupTransport::describe() const {
  return fmt::format("ranks {} of the parent group", fmt::join(members_, ", "));
}

std::unique_ptr<Request> SubgroupTransport::isend(int peer, Tag tag,
                                                  std::span<const std::byte> data) {
  return std::make_unique<ViewRequest>(*this, parent_.isend(parent_rank(peer), tag, data));
}

std::unique_ptr<Request> SubgroupTransport::irecv(int peer, Tag tag, std::span<std::byte> data) {
  return std::make_unique<ViewRequest>(*this, parent_.irecv(parent_rank(peer), tag, data));
}

std::unique_ptr<Request> SubgroupTransport::iforward(int peer, Tag tag,
                                                     std::span<const std::byte> data,
                                                     const Request& earlier) {
  const int to = parent_rank(peer);
  if (const auto* view_request = dynamic_cast<const ViewRequest*>(&earlier)) {
    return std::make_unique<ViewRequest>(*this,
                                         parent_.iforward(to, tag, data, view_request->inner()));
  }
  return std::make_unique<ViewRequest>(*this, parent_.isend(to, tag, data));
}

void SubgroupTransport::abort(std::string_view reason) noexcept {
  abort_blaming(-1, ErrorKind::peer_lost, reason);
}

void SubgroupTransport::abort_blaming(int peer, ErrorKind kind, std::string_view reason) noexcept {
  if (before_abort_) {
    const int culprit = peer >= 0 && peer < size() ? members_[static_cast<std::size_t>(peer)] : -1;
    std::call_once(before_abort_once_, [&] {
      try {
        before_abort_(culprit, kind, reason);
      } catch (...) {
        // Best effort: the abort below is what must happen.
      }
    });
  }
  // The reason travels to the parent's peers (TCP tells them why), and it numbers the view's
  // ranks: say which they are.
  std::string said;
  try {
    said = fmt::format("{} (ranks numbered within the view of {})", reason, describe());
  } catch (...) {
    said.clear();
  }
  parent_.abort(said.empty() ? reason : std::string_view(said));
}

std::vector<int> SubgroupTransport::lost_peers() const {
  std::vector<int> lost;
  for (const int parent_rank : parent_.lost_peers()) {
    if (const int rank = rank_of(parent_rank); rank >= 0) lost.push_back(rank);
  }
  return lost;
}

std::uint64_t SubgroupTransport::next_sequence(Tag base_tag) {
  const std::lock_guard lock(sequence_mutex_);
  return first_sequence_ + sequences_[base_tag]++;
}

void SubgroupTransport::rethrow_in_parent_numbering(const Error& error,
                                                    std::string_view what) const {
  ErrorContext context = error.context();
  const auto to_parent = [&](std::optional<int> rank) -> std::optional<int> {
    if (!rank || *rank < 0 || *rank >= size()) return std::nullopt;
    return members_[static_cast<std::size_t>(*rank)];
  };
  context.rank = parent_.rank();
  context.peer = to_parent(context.peer);
  std::vector<int> ranks;
  for (const int rank : context.ranks) {
    if (const auto parent = to_parent(rank)) ranks.push_back(*parent);
  }
  context.ranks = std::move(ranks);
  std::string culprit;
  if (context.peer) culprit = fmt::format(", blaming rank {}", *context.peer);
  throw_error_of_kind(error.kind(),
                      fmt::format("{} among {} failed{}; in the view's numbering (rank i is the "
                                  "i-th of those ranks): {}",
                                  what, describe(), culprit, error.message()),
                      std::move(context));
}

}  // namespace pulseloco::transport
