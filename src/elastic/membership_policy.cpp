// The membership policy of the elastic coordinator (membership_policy.h has its rules).
#include <pulseloco/elastic/membership_policy.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <utility>
#include <variant>

#include <pulseloco/base/errors.h>
#include <pulseloco/elastic/membership_messages.h>

namespace pulseloco::elastic {
namespace {

bool is_wildcard_host(std::string_view host) {
  return host.empty() || host == "0.0.0.0" || host == "::";
}

std::string plural(std::size_t n, std::string_view word) {
  return fmt::format("{} {}{}", n, word, n == 1 ? "" : "s");
}

void note(Decisions& out, Note::Level level, std::string text) {
  out.notes.push_back(Note{level, std::move(text)});
}

void validate_rules(const MembershipRules& rules) {
  if (rules.initial_workers < 1)
    throw InvalidArgument(fmt::format("coordinator: initial_workers is {}; it must be at least 1",
                                      rules.initial_workers));
  if (rules.min_workers < 1 || rules.min_workers > rules.initial_workers)
    throw InvalidArgument(
        fmt::format("coordinator: min_workers is {}; it must be in 1..initial_workers ({})",
                    rules.min_workers, rules.initial_workers));
  if (rules.max_workers < 0 || (rules.max_workers > 0 && rules.max_workers < rules.initial_workers))
    throw InvalidArgument(fmt::format(
        "coordinator: max_workers is {}; it must be 0 (no limit) or at least initial_workers ({})",
        rules.max_workers, rules.initial_workers));
  if (rules.join_every_windows < 1)
    throw InvalidArgument("coordinator: join_every_windows must be at least 1");
  if (rules.regroup_timeout.count() <= 0)
    throw InvalidArgument(fmt::format("coordinator: regroup_timeout is {} ms; it must be positive",
                                      rules.regroup_timeout.count()));
}

}  // namespace

MembershipPolicy::MembershipPolicy(MembershipRules rules) : rules_(rules) {
  validate_rules(rules_);
}

// ------------------------------------------------------------------------------------------------
// Workers

const MembershipPolicy::Worker& MembershipPolicy::worker(WorkerKey key) const {
  const auto found = workers_.find(key);
  PULSELOCO_CHECK(found != workers_.end() && found->second.connected,
                  fmt::format("membership policy: an event of worker key {}, which is not "
                              "registered or whose connection closed",
                              key));
  return found->second;
}

MembershipPolicy::Worker& MembershipPolicy::worker(WorkerKey key) {
  return const_cast<Worker&>(std::as_const(*this).worker(key));
}

std::optional<Standing> MembershipPolicy::standing(WorkerKey key) const {
  const auto found = workers_.find(key);
  if (found == workers_.end()) return std::nullopt;
  return found->second.standing;
}

// A worker is kept while its connection is open or while it is a member of the current
// generation (the next one's `lost` list names it).
void MembershipPolicy::forget_if_done(WorkerKey key) {
  const auto found = workers_.find(key);
  if (found == workers_.end() || found->second.connected) return;
  if (std::find(members_.begin(), members_.end(), key) == members_.end()) workers_.erase(found);
}

namespace {

// The address a registration states, its wildcard host replaced by the connection's; or why it
// cannot be a data address.
std::variant<transport::PeerAddress, std::string> data_address(const StatedAddress& stated,
                                                               const std::string& remote,
                                                               std::string_view what) {
  if (stated.host.size() > kMaxNameBytes)
    return fmt::format("the {} host is longer than {} bytes", what, kMaxNameBytes);
  if (stated.port == 0 || stated.port > 65535)
    return fmt::format("{} port {} is not in 1..65535", what, stated.port);
  std::string host = stated.host;
  if (is_wildcard_host(host)) {
    if (remote.empty())
      return fmt::format("cannot tell the address of the connection for its wildcard {} host",
                         what);
    host = remote;
  }
  return transport::PeerAddress{std::move(host), static_cast<std::uint16_t>(stated.port)};
}

}  // namespace

Registration MembershipPolicy::register_worker(const RegistrationRequest& request) {
  if (auto problem = check_name(request.worker_id, "worker id"); !problem.empty())
    return {.refusal = problem};
  std::vector<transport::PeerAddress> addresses;
  for (std::size_t j = 0; j <= request.local_ranks.size(); ++j) {
    const StatedAddress& stated =
        j == 0 ? StatedAddress{request.data_host, request.data_port} : request.local_ranks[j - 1];
    auto address =
        data_address(stated, request.remote_address,
                     j == 0 ? std::string("data") : fmt::format("local rank {}'s data", j));
    if (auto* problem = std::get_if<std::string>(&address)) return {.refusal = *problem};
    addresses.push_back(std::get<transport::PeerAddress>(std::move(address)));
  }
  for (const auto& [key, other] : workers_) {
    if (other.connected && other.id == request.worker_id && other.standing != Standing::removed &&
        other.standing != Standing::left)
      return {.refusal = fmt::format("worker id '{}' is taken by a live worker (connected from {})",
                                     request.worker_id, other.from)};
  }
  const std::size_t ranks = addresses.size();
  if (ranks_per_worker_ && ranks_per_worker_->first != ranks)
    return {.refusal = fmt::format(
                "worker layouts differ: worker {} has {}; the run's workers have {} (worker {} "
                "registered first with that many)",
                request.worker_id, plural(ranks, "rank"), ranks_per_worker_->first,
                ranks_per_worker_->second)};
  if (!ranks_per_worker_) ranks_per_worker_.emplace(ranks, request.worker_id);
  const WorkerKey key = next_key_++;
  Worker& added = workers_[key];
  added.id = request.worker_id;
  added.data_address = addresses.front();
  added.local_rank_addresses.assign(addresses.begin() + 1, addresses.end());
  added.from = request.from;
  std::vector<std::string> shown;
  for (const auto& address : addresses)
    shown.push_back(to_string(address));
  return {.key = key,
          .note = {Note::Level::info,
                   fmt::format("worker {} registered from {} (data {} {})", added.id, added.from,
                               ranks == 1 ? "address" : "addresses of its local ranks",
                               fmt::join(shown, ", "))}};
}

// The error every request gets once the run is over or this worker was removed; "" if none.
std::string MembershipPolicy::refusal_for(const Worker& worker) const {
  if (phase_ == RunPhase::stopped) return end_reason_;
  if (phase_ == RunPhase::finished) return "the run has finished";
  if (worker.standing == Standing::removed)
    return fmt::format(
        "worker {} was removed from the group at generation {}: it did not ask for a new "
        "group within the regroup timeout ({} ms); register again to rejoin",
        worker.id, worker.removed_at, rules_.regroup_timeout.count());
  return {};
}

// One request at a time, none after leave. Once the run is over every pending request has been
// answered, so only the forming and running phases have requests pending.
void MembershipPolicy::check_request(const Worker& worker, std::string_view type) const {
  if (worker.standing == Standing::left)
    throw ProtocolError(fmt::format("a '{}' message after leave", type));
  const bool pending = worker.standing == Standing::waiting || worker.standing == Standing::asked;
  if (pending && (phase_ == RunPhase::forming || phase_ == RunPhase::running))
    throw ProtocolError(fmt::format("a '{}' request while its next_group is unanswered", type));
}

// ------------------------------------------------------------------------------------------------
// Events

Decisions MembershipPolicy::next_group(WorkerKey key, std::string_view reason, TimePoint now) {
  Worker& asking = worker(key);
  check_request(asking, "next_group");
  Decisions out;
  if (auto refusal = refusal_for(asking); !refusal.empty()) {
    out.errors.push_back({key, std::move(refusal)});
    return out;
  }
  if (asking.standing == Standing::member) {
    asking.standing = Standing::asked;
    note(out, Note::Level::info,
         fmt::format("worker {} asks for a new group after generation {}: {}", asking.id,
                     generation_, reason));
    if (!regroup_deadline_)
      start_regroup(fmt::format("worker {} asked ({})", asking.id, reason), now, out);
    check_regroup(out);
    return out;
  }
  PULSELOCO_CHECK(asking.standing == Standing::idle,
                  "membership policy: next_group of a worker "
                  "that is neither idle nor a member");
  asking.standing = Standing::waiting;
  joiners_.push_back(key);
  note(out, Note::Level::info,
       fmt::format("worker {} waits to join ({}); {} waiting", asking.id, reason,
                   plural(joiners_.size(), "worker")));
  if (phase_ == RunPhase::forming) form_first(out);
  return out;
}

Decisions MembershipPolicy::boundary(WorkerKey key, std::uint64_t window, TimePoint now) {
  const Worker& asking = worker(key);
  check_request(asking, "boundary");
  Decisions out;
  if (auto refusal = refusal_for(asking); !refusal.empty()) {
    out.errors.push_back({key, std::move(refusal)});
    return out;
  }
  if (asking.standing != Standing::member) {
    out.errors.push_back(
        {key, fmt::format("worker {} is not a member of generation {}; call next_group first",
                          asking.id, generation_)});
    return out;
  }
  bool regroup = true;  // while a regroup is pending
  if (!regroup_deadline_) {
    const auto recorded = boundary_decisions_.find(window);
    if (recorded != boundary_decisions_.end()) {
      regroup = recorded->second;
    } else {
      const auto in_group = static_cast<std::size_t>(std::count_if(
          members_.begin(), members_.end(),
          [this](WorkerKey m) { return workers_.at(m).standing == Standing::member; }));
      const std::size_t admissible = admissible_joiners(in_group);
      regroup = admissible > 0 && window % rules_.join_every_windows == 0;
      boundary_decisions_.emplace(window, regroup);
      if (regroup)
        start_regroup(fmt::format("admitting {} at the boundary before window {}",
                                  plural(admissible, "waiting worker"), window),
                      now, out);
    }
  }
  out.boundary_replies.push_back({key, regroup});
  return out;
}

Decisions MembershipPolicy::leave(WorkerKey key) {
  Worker& leaving = worker(key);
  if (leaving.standing == Standing::left) throw ProtocolError("a 'leave' message after leave");
  Decisions out;
  const Standing before = leaving.standing;
  leaving.standing = Standing::left;
  if (before == Standing::waiting) drop_joiner(key);
  const bool was_member = before == Standing::member || before == Standing::asked;
  note(out, Note::Level::info,
       fmt::format(
           "worker {} left{}", leaving.id,
           was_member ? fmt::format(" (a member of generation {})", generation_) : std::string()));
  if (was_member) member_gone(out);
  return out;
}

Decisions MembershipPolicy::connection_closed(WorkerKey key, std::string_view problem) {
  Worker& closed = worker(key);
  closed.connected = false;
  Decisions out;
  const Standing before = closed.standing;
  if (before != Standing::left && before != Standing::removed) {
    closed.standing = Standing::lost;
    if (before == Standing::waiting) {
      drop_joiner(key);
      note(out, Note::Level::info,
           fmt::format("worker {} lost while waiting to join ({})", closed.id, problem));
    } else if (before == Standing::member || before == Standing::asked) {
      note(out, Note::Level::info,
           fmt::format("worker {} lost (a member of generation {}: {})", closed.id, generation_,
                       problem));
      member_gone(out);  // may form a generation without it, and forget it
    } else {
      note(out, Note::Level::info, fmt::format("worker {} lost ({})", closed.id, problem));
    }
  }
  forget_if_done(key);
  return out;
}

Decisions MembershipPolicy::tick(TimePoint now) {
  Decisions out;
  if (regroup_deadline_ && now >= *regroup_deadline_) complete_regroup(out);
  return out;
}

// ------------------------------------------------------------------------------------------------
// Generations

std::size_t MembershipPolicy::admissible_joiners(std::size_t group_size) const {
  if (rules_.max_workers <= 0) return joiners_.size();
  const auto limit = static_cast<std::size_t>(rules_.max_workers);
  return group_size >= limit ? 0 : std::min(joiners_.size(), limit - group_size);
}

void MembershipPolicy::drop_joiner(WorkerKey key) {
  std::erase(joiners_, key);
}

void MembershipPolicy::start_regroup(std::string cause, TimePoint now, Decisions& out) {
  regroup_deadline_ = now + rules_.regroup_timeout;
  note(out, Note::Level::info,
       fmt::format("regroup of generation {} triggered: {}", generation_, cause));
}

// A member left or was lost.
void MembershipPolicy::member_gone(Decisions& out) {
  if (phase_ != RunPhase::running) return;
  if (regroup_deadline_) {
    check_regroup(out);
    return;
  }
  const auto standing_is = [this](Standing wanted) {
    return [this, wanted](WorkerKey m) { return workers_.at(m).standing == wanted; };
  };
  if (std::any_of(members_.begin(), members_.end(), standing_is(Standing::member)) ||
      std::any_of(members_.begin(), members_.end(), standing_is(Standing::asked)))
    return;
  if (std::any_of(members_.begin(), members_.end(), standing_is(Standing::left))) {
    finish(out);
  } else {
    stop(fmt::format("every worker of generation {} was lost", generation_), out);
  }
}

void MembershipPolicy::check_regroup(Decisions& out) {
  if (!regroup_deadline_) return;
  const bool still_waiting_for_one =
      std::any_of(members_.begin(), members_.end(),
                  [this](WorkerKey m) { return workers_.at(m).standing == Standing::member; });
  if (!still_waiting_for_one) complete_regroup(out);
}

void MembershipPolicy::complete_regroup(Decisions& out) {
  regroup_deadline_.reset();
  std::vector<WorkerKey> survivors;
  bool someone_left = false;
  for (const WorkerKey key : members_) {
    Worker& member = workers_.at(key);
    if (member.standing == Standing::asked) survivors.push_back(key);
    if (member.standing == Standing::left) someone_left = true;
    if (member.standing == Standing::member) {
      member.standing = Standing::removed;
      member.removed_at = generation_;
      note(out, Note::Level::warn,
           fmt::format("worker {} removed from the group at generation {}: it did not ask for a "
                       "new group within the regroup timeout ({} ms)",
                       member.id, generation_, rules_.regroup_timeout.count()));
    }
  }
  if (survivors.empty()) {
    if (someone_left) {
      finish(out);
    } else {
      stop(fmt::format("no member of generation {} asked for a new group", generation_), out);
    }
    return;
  }
  const std::size_t admitted = admissible_joiners(survivors.size());
  const std::size_t size = survivors.size() + admitted;
  if (size < static_cast<std::size_t>(rules_.min_workers)) {
    stop(fmt::format("the group fell to {}, below the minimum {}", plural(size, "worker"),
                     rules_.min_workers),
         out);
    return;
  }
  survivors.insert(survivors.end(), joiners_.begin(),
                   joiners_.begin() + static_cast<std::ptrdiff_t>(admitted));
  form(std::move(survivors), admitted, out);
}

void MembershipPolicy::form_first(Decisions& out) {
  const auto count = static_cast<std::size_t>(rules_.initial_workers);
  if (joiners_.size() < count) return;
  form(std::vector<WorkerKey>(joiners_.begin(),
                              joiners_.begin() + static_cast<std::ptrdiff_t>(count)),
       count, out);
  phase_ = RunPhase::running;
}

// Makes `group` (previous members first, then `admitted` joiners from the queue's front) the
// next generation.
void MembershipPolicy::form(std::vector<WorkerKey> group, std::size_t admitted, Decisions& out) {
  Generation formed;
  formed.number = generation_ + 1;
  for (const WorkerKey key : group) {
    const Worker& member = workers_.at(key);
    formed.worker_ids.push_back(member.id);
    formed.data_addresses.push_back(member.data_address);
    formed.local_rank_addresses.push_back(member.local_rank_addresses);
    if (member.standing == Standing::waiting) formed.joined.push_back(member.id);
  }
  for (const WorkerKey key : members_)
    if (std::find(group.begin(), group.end(), key) == group.end())
      formed.lost.push_back(workers_.at(key).id);

  joiners_.erase(joiners_.begin(), joiners_.begin() + static_cast<std::ptrdiff_t>(admitted));
  std::vector<WorkerKey> previous = std::exchange(members_, std::move(group));
  for (const WorkerKey key : previous)
    forget_if_done(key);
  boundary_decisions_.clear();
  generation_ = formed.number;
  for (const WorkerKey key : members_)
    workers_.at(key).standing = Standing::member;
  formed.members = members_;
  note(out, Note::Level::info,
       fmt::format("generation {} formed with {}: [{}]; joined [{}]; lost [{}]; {} waiting",
                   generation_, plural(members_.size(), "worker"),
                   fmt::join(formed.worker_ids, ", "), fmt::join(formed.joined, ", "),
                   fmt::join(formed.lost, ", "), joiners_.size()));
  out.formed = std::move(formed);
}

void MembershipPolicy::finish(Decisions& out) {
  phase_ = RunPhase::finished;
  regroup_deadline_.reset();
  note(out, Note::Level::info,
       fmt::format("the run has finished (generation {}); {} turned away", generation_,
                   plural(joiners_.size(), "waiting worker")));
  for (const WorkerKey joiner : joiners_)
    out.errors.push_back({joiner, "the run has finished"});
  joiners_.clear();
  out.ended = RunEnd{};
}

void MembershipPolicy::stop(std::string reason, Decisions& out) {
  phase_ = RunPhase::stopped;
  regroup_deadline_.reset();
  end_reason_ = std::move(reason);
  note(out, Note::Level::error, fmt::format("the run stops: {}", end_reason_));
  for (const WorkerKey key : members_)
    if (workers_.at(key).standing == Standing::asked) out.errors.push_back({key, end_reason_});
  for (const WorkerKey joiner : joiners_)
    out.errors.push_back({joiner, end_reason_});
  joiners_.clear();
  out.ended = RunEnd{end_reason_};
}

std::vector<std::string> MembershipPolicy::awaited_members() const {
  std::vector<std::string> ids;
  if (!regroup_deadline_) return ids;
  for (const WorkerKey key : members_) {
    const Worker& member = worker(key);
    if (member.standing == Standing::member) ids.push_back(member.id);
  }
  return ids;
}

}  // namespace pulseloco::elastic
