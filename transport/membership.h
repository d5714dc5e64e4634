// Elastic membership over TCP: a coordinator that forms successive groups ("generations") of
// workers, and the client a worker uses to join, to ask for a new group after a failure, and to
// learn at each window boundary whether the group must be re-formed to admit new workers.
//
// The coordinator is deliberately small (as PCCL's master or torchelastic's rendezvous store):
// it never sees training data, only who is alive. Every generation gets a fresh group id; the
// workers then connect their data transport among themselves (peer_list rendezvous with
// TransportOptions::group_key = GroupAssignment::group_key), so a worker of an older generation
// can never be mistaken for a member of the current one.
//
// Protocol (docs/elastic.md has the full state machine and the failure cases):
//  - A worker opens one TCP connection to the coordinator, authenticates with the shared secret
//    (the HMAC-SHA256 challenge-response of tcp/handshake.h, purpose `membership`) and registers
//    its stable worker id and the address of its data listener. The connection stays open for
//    the worker's life: its closing is how the coordinator learns that a worker died.
//  - next_group(): "place me in the next generation". A new worker waits until it is admitted;
//    a member whose collective failed waits until the coordinator has heard from every member
//    of its generation (or the regroup timeout passed, or their connections closed).
//  - boundary(window): a member at a window boundary asks whether to re-form the group now
//    (new workers are waiting and the join policy admits them at this window). The coordinator
//    decides once per (generation, window); every member gets the same answer.
//  - leave(): the worker finished the run (or gives up); it is no longer waited for.
//
// Forming generation g+1 from generation g: members that asked for a new group keep their
// relative order (rank 0 is the lowest surviving rank), then waiting new workers are appended in
// arrival order (up to max_workers). Members that neither asked nor left within the regroup
// timeout (stalled, partitioned) are removed; a removed worker that talks again is told so
// (MembershipError, base/errors.h) and may register again as a new worker. Below min_workers the
// run stops: every waiting worker gets MembershipError naming the reason.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/rendezvous.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

struct CoordinatorOptions {
  std::string host = "0.0.0.0";  // where to listen
  std::uint16_t port = 0;        // 0 = any free port (see Coordinator::port())
  int initial_workers = 1;       // generation 1 forms once this many workers wait
  int min_workers = 1;           // a new generation smaller than this stops the run
  int max_workers = 0;           // 0 = no limit; further workers wait for a free place
  // Join policy: waiting workers are admitted at window boundaries that are multiples of this
  // (1 = at the next boundary), and at every regroup after a failure.
  std::uint64_t join_every_windows = 1;
  // How long a regroup waits for the members of the failed generation to ask for a new group.
  // Must exceed the collectives' timeout x 2 (the time a survivor needs to notice a failure) and
  // the workers' connect timeout (the time a member of a new generation waits for a peer it
  // cannot reach). The default suits the workers' defaults: 60 s for both.
  std::chrono::milliseconds regroup_timeout{150'000};
  std::string secret;  // shared secret (PULSELOCO_SECRET); empty = unauthenticated, warned
};

// Runs the coordinator on a background thread until destroyed.
class Coordinator {
 public:
  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  [[nodiscard]] std::uint16_t port() const noexcept;
  // The latest generation formed (0 before the first).
  [[nodiscard]] std::uint64_t generation() const;
  // Blocks until the run is over: every member of the current generation has left (returns),
  // or the run stopped below min_workers (throws MembershipError with the reason).
  void wait();
  // Connections refused so far (wrong secret, malformed registration, duplicate worker id).
  [[nodiscard]] int refused_connections() const noexcept;
  // Workers waiting to be placed in a group (not members of the current generation).
  [[nodiscard]] int waiting_workers() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One generation, as seen by one of its members.
struct GroupAssignment {
  std::uint64_t generation = 0;
  int rank = 0;
  std::vector<std::string> worker_ids;  // every member, in rank order
  std::vector<PeerAddress> peers;       // every member's data listener, in rank order
  std::string group_key;                // TransportOptions::group_key for this generation
  std::vector<std::string> joined;      // members new in this generation
  std::vector<std::string> lost;        // members of the previous generation not in this one

  [[nodiscard]] int size() const noexcept { return static_cast<int>(worker_ids.size()); }
};

struct MembershipClientOptions {
  std::string coordinator;  // "host:port"
  std::string worker_id;    // stable and unique in the run (e.g. hostname-pid)
  // Where this worker's data listener will listen. An empty or wildcard host (0.0.0.0, ::) is
  // replaced by the address the coordinator sees this worker's connection come from.
  PeerAddress data_address;
  std::string secret;                                 // shared secret
  std::chrono::milliseconds connect_timeout{60'000};  // connecting and registering
};

// Calls are serialised (a call made while another is in progress waits for it). Errors:
// MembershipError leaves the client usable (every later request gets the same answer);
// PeerLostError ("coordinator lost": the coordinator closed the connection or it failed) and
// ProtocolError make it unusable (every later call rethrows them).
class MembershipClient {
 public:
  // Connects, authenticates and registers. Throws TimeoutError (coordinator unreachable until
  // the connect timeout), ProtocolError (authentication failed, or the id is taken),
  // InvalidArgument (bad options).
  explicit MembershipClient(MembershipClientOptions options);
  // Closes the connection without leaving: the coordinator sees this worker as lost, as after
  // a crash. Call leave() when the worker is done.
  ~MembershipClient();
  MembershipClient(const MembershipClient&) = delete;
  MembershipClient& operator=(const MembershipClient&) = delete;

  // Blocks until this worker is placed in a new generation, or `deadline` passes
  // (TimeoutError). `reason` is logged by the coordinator ("join", or the failure seen). Throws
  // MembershipError when the run stopped or finished, or this worker was removed. After a
  // TimeoutError the request stays with the coordinator: calling next_group again resumes
  // waiting for the same placement (so a joiner may wait in short slices).
  [[nodiscard]] GroupAssignment next_group(std::string_view reason, Deadline deadline);

  // At the boundary before window `window` of the current generation: true when the group must
  // be re-formed now (call next_group). Every member gets the same answer for the same window,
  // except that once a regroup of the generation is pending (a member saw a failure) the
  // answer is true: that window's collective could not complete anyway. Throws InvalidArgument
  // before the first group or while a next_group request is unanswered.
  [[nodiscard]] bool boundary(std::uint64_t window, Deadline deadline);

  // Tells the coordinator this worker is done (waiting up to 5 s for its acknowledgement);
  // closes the connection. Idempotent; later calls of the other functions throw
  // MembershipError.
  void leave() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pulseloco::transport
