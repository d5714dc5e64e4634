// Internal: the membership policy of the elastic coordinator (coordinator.h): who is admitted,
// who is waited for, when a generation forms, who gets which rank, when the run ends. It is a
// state machine with no sockets, threads or clock of its own: the coordinator turns what arrives
// on its connections into the events below, passes "now" where time matters, and sends what the
// returned Decisions say. docs/elastic.md ("The coordinator's states") is written from this block.
//
// Phases: forming (generation 0) -> running (generations 1, 2, ...) -> finished | stopped.
// A registered worker is, at any time, one of:
//   idle     registered, has not asked for a group yet
//   waiting  asked next_group and is not a member of the current generation (a joiner); joiners
//            queue in arrival order
//   member   in the current generation, in a window (no request pending)
//   asked    in the current generation, waiting in next_group for the next generation
//   left     sent leave (it is no longer waited for)
//   lost     its connection closed, or it violated the protocol
//   removed  excluded at a regroup for not asking within the regroup timeout; every later
//            request of it gets an error reply (MembershipError on the worker); the worker may
//            register again, on a new connection, as a new worker
// A waiting or asked worker has a request pending: another request from it (or any request
// after its leave) is a protocol violation (ProtocolError), which the coordinator answers by
// closing its connection.
//
// Registration: a worker id is refused while a live worker (idle, waiting, member, asked) holds
//   it. An empty or wildcard data host is replaced by the address the connection comes from.
//   A worker of G ranks states one data address per local rank; the first registration sets
//   the run's G, and a worker with another G is refused, naming both.
// forming: generation 1 forms as soon as initial_workers workers wait; they are its members in
//   arrival order. A waiting worker whose connection closes leaves the queue.
// running, generation g:
//   * a regroup of g is TRIGGERED by a member asking next_group (it saw a failure; its reason is
//     logged), or by a boundary decision "regroup". Its deadline is then + regroup_timeout.
//   * boundary(window) from a member: while a regroup of g is pending the answer is "regroup".
//     Otherwise the decision for (g, window) is taken once, at the first member's question, and
//     recorded, so every member of g gets the same answer for that window: "regroup" iff
//     workers are waiting, there is room for at least one (max_workers), and
//     window % join_every_windows == 0.
//   * a member leaving or being lost does not trigger a regroup by itself (its peers' collectives
//     fail and they ask); it is simply not waited for.
//   * a pending regroup COMPLETES when every member of g has asked, left or been lost, or at
//     its deadline; members that did neither are removed. Then generation g+1 is formed from
//     the members that asked, in their rank order in g, followed by waiting workers in arrival
//     order up to max_workers. If no member asked, the run is finished when some member left,
//     else it stops ("no member of generation g asked for a new group"): a generation of new
//     workers alone would have no state to start from. If g+1 would have fewer than
//     min_workers members, the run stops ("the group fell to N workers, below the minimum M").
//   * with no regroup pending, once no member of g is still in a window (all left or were
//     lost): finished when at least one left, else stopped ("every worker of generation g was
//     lost").
// Each new generation lists its members' ids and data addresses in rank order, which workers
// joined and which members of g are no longer in it (the coordinator adds a fresh group key).
// finished: waiting workers (and any later request) get the error "the run has finished".
// stopped: every waiting worker (members that asked, and joiners) gets the reason as an error
//   reply, and so does any later request.
// Every transition leaves a note to log (warn for removals, error when the run stops).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <pulseloco/transport/tcp/group_table.h>

namespace pulseloco::elastic {

// The membership fields of CoordinatorOptions (coordinator.h says what each means).
struct MembershipRules {
  int initial_workers = 1;
  int min_workers = 1;
  int max_workers = 0;  // 0 = no limit
  std::uint64_t join_every_windows = 1;
  std::chrono::milliseconds regroup_timeout{150'000};
};

// One registration (one connection). Keys are never reused, so a worker that registers again
// under its old id is a new worker.
using WorkerKey = std::uint64_t;

enum class RunPhase : std::uint8_t { forming, running, finished, stopped };
enum class Standing : std::uint8_t { idle, waiting, member, asked, left, lost, removed };

// A line for the coordinator's log.
struct Note {
  enum class Level : std::uint8_t { info, warn, error };
  Level level = Level::info;
  std::string text;
};

// A generation the policy formed. Member i has rank i.
struct Generation {
  std::uint64_t number = 0;
  std::vector<WorkerKey> members;
  std::vector<std::string> worker_ids;
  std::vector<transport::PeerAddress> data_addresses;
  // Workers of several ranks: member i's local ranks 1 .. G-1's data addresses (empty for
  // workers of one rank); data_addresses[i] is its local rank 0's.
  std::vector<std::vector<transport::PeerAddress>> local_rank_addresses;
  std::vector<std::string> joined;  // members new in this generation
  std::vector<std::string> lost;    // members of the previous generation not in this one
};

struct ErrorReply {
  WorkerKey to = 0;
  std::string message;
};

struct BoundaryReply {
  WorkerKey to = 0;
  bool regroup = false;
};

// The run is over: finished (no reason) or stopped (the reason).
struct RunEnd {
  std::optional<std::string> stop_reason;
};

// What the coordinator must do after an event. Each worker gets at most one reply from one
// event.
struct Decisions {
  std::optional<Generation> formed;  // tell each member its place
  std::vector<BoundaryReply> boundary_replies;
  std::vector<ErrorReply> errors;
  std::optional<RunEnd> ended;
  std::vector<Note> notes;  // in the order the transitions happened
};

// A data address as a registration states it (checked by register_worker).
struct StatedAddress {
  std::string host;
  std::uint64_t port = 0;
};

struct RegistrationRequest {
  std::string worker_id;
  std::string data_host;
  std::uint64_t data_port = 0;
  // A worker of G ranks: the data addresses of its local ranks 1 .. G-1 (local rank 0's is
  // data_host:data_port). Every worker of a run has the same G: the first to register sets it.
  std::vector<StatedAddress> local_ranks;
  // The address the connection comes from ("" when it cannot be told): replaces an empty or
  // wildcard data host.
  std::string remote_address;
  std::string from;  // the connection's description, for messages
};

struct Registration {
  std::optional<WorkerKey> key;  // registered
  std::string refusal;           // why not (the worker is told, and its connection closed)
  Note note;                     // what to log when registered
};

class MembershipPolicy {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  // Throws InvalidArgument naming the field when `rules` cannot describe a run.
  explicit MembershipPolicy(MembershipRules rules);

  [[nodiscard]] Registration register_worker(const RegistrationRequest& request);

  // The worker's requests. Refusals (the run is over, the worker was removed, a boundary from a
  // non-member) are error replies; a request while its next_group is pending, or after its
  // leave, throws ProtocolError and changes nothing.
  [[nodiscard]] Decisions next_group(WorkerKey worker, std::string_view reason, TimePoint now);
  [[nodiscard]] Decisions boundary(WorkerKey worker, std::uint64_t window, TimePoint now);
  [[nodiscard]] Decisions leave(WorkerKey worker);
  // Its connection closed (or it violated the protocol); the key is not used again.
  [[nodiscard]] Decisions connection_closed(WorkerKey worker, std::string_view problem);
  // Completes a pending regroup whose deadline is at or before `now`.
  [[nodiscard]] Decisions tick(TimePoint now);

  // When tick() has something to do: the pending regroup's deadline.
  [[nodiscard]] std::optional<TimePoint> deadline() const noexcept { return regroup_deadline_; }
  [[nodiscard]] RunPhase phase() const noexcept { return phase_; }
  [[nodiscard]] std::uint64_t generation() const noexcept { return generation_; }
  [[nodiscard]] const std::vector<WorkerKey>& members() const noexcept { return members_; }
  [[nodiscard]] std::size_t waiting() const noexcept { return joiners_.size(); }
  // While a regroup is pending: the ids of the current generation's members that have not asked
  // for the next group, left or been lost, in rank order (whom the regroup waits for); else
  // none.
  [[nodiscard]] std::vector<std::string> awaited_members() const;
  // A worker's standing; nullopt once the policy has forgotten it (its connection closed and
  // it is not a member of the current generation).
  [[nodiscard]] std::optional<Standing> standing(WorkerKey worker) const;
  // Workers the policy still keeps (open connections, and departed members of the current
  // generation).
  [[nodiscard]] std::size_t known_workers() const noexcept { return workers_.size(); }

 private:
  struct Worker {
    std::string id;
    transport::PeerAddress data_address;
    std::vector<transport::PeerAddress> local_rank_addresses;  // local ranks 1 .. G-1
    std::string from;
    Standing standing = Standing::idle;
    std::uint64_t removed_at = 0;  // the generation it was removed from
    bool connected = true;
  };

  Worker& worker(WorkerKey key);
  const Worker& worker(WorkerKey key) const;
  void forget_if_done(WorkerKey key);
  [[nodiscard]] std::string refusal_for(const Worker& worker) const;
  void check_request(const Worker& worker, std::string_view type) const;
  [[nodiscard]] std::size_t admissible_joiners(std::size_t group_size) const;
  void drop_joiner(WorkerKey key);
  void start_regroup(std::string cause, TimePoint now, Decisions& out);
  void member_gone(Decisions& out);
  void check_regroup(Decisions& out);
  void complete_regroup(Decisions& out);
  void form_first(Decisions& out);
  void form(std::vector<WorkerKey> group, std::size_t admitted, Decisions& out);
  void finish(Decisions& out);
  void stop(std::string reason, Decisions& out);

  const MembershipRules rules_;
  std::map<WorkerKey, Worker> workers_;
  WorkerKey next_key_ = 1;
  RunPhase phase_ = RunPhase::forming;
  std::uint64_t generation_ = 0;
  std::vector<WorkerKey> members_;                    // the current generation, in rank order
  std::deque<WorkerKey> joiners_;                     // waiting workers, in arrival order
  std::optional<TimePoint> regroup_deadline_;         // set while a regroup is pending
  std::map<std::uint64_t, bool> boundary_decisions_;  // window -> regroup, this generation
  std::string end_reason_;                            // why the run stopped
  // Ranks per worker, set by the first registration, and that worker's id (for refusals).
  std::optional<std::pair<std::size_t, std::string>> ranks_per_worker_;
};

}  // namespace pulseloco::elastic
