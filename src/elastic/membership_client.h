// The client a worker of an elastic run uses to talk to the coordinator (coordinator.h): to join,
// to ask for a new group after a failure, and to learn at each window boundary whether the group
// must be re-formed to admit new workers.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/tcp/group_table.h>
#include <pulseloco/transport/tcp/tcp_options.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::elastic {

// One generation, as seen by one of its members.
struct GroupAssignment {
  std::uint64_t generation = 0;
  int rank = 0;
  std::vector<std::string> worker_ids;        // every member, in rank order
  std::vector<transport::PeerAddress> peers;  // every member's data listener, in rank order
  std::string group_key;            // group::TransportOptions::group_key for this generation
  std::vector<std::string> joined;  // members new in this generation
  std::vector<std::string> lost;    // members of the previous generation not in this one
  // Workers of G ranks: every member's local ranks 1 .. G-1's data listeners, in rank order
  // (empty lists for workers of one rank). `peers` holds the local ranks 0.
  std::vector<std::vector<transport::PeerAddress>> local_rank_peers;

  [[nodiscard]] int size() const noexcept { return static_cast<int>(worker_ids.size()); }
  // Local rank `local_rank`'s data listener of every member, in rank order: the group those
  // local ranks form. InvalidArgument when a member has no such local rank.
  [[nodiscard]] std::vector<transport::PeerAddress> peers_of_local_rank(int local_rank) const;
};

struct MembershipClientOptions {
  std::string coordinator;  // "host:port"
  std::string worker_id;    // stable and unique in the run (e.g. hostname-pid)
  // Where this worker's data listener will listen. An empty or wildcard host (0.0.0.0, ::) is
  // replaced by the address the coordinator sees this worker's connection come from.
  transport::PeerAddress data_address;
  // A worker of G ranks: the data listeners of its local ranks 1 .. G-1 (data_address is local
  // rank 0's, and this client speaks for the whole worker).
  std::vector<transport::PeerAddress> local_rank_addresses;
  std::string secret;  // shared secret
  std::string run_id;  // the job's run id; the coordinator's must be the same (job_id.h)
  // Encryption of the connection, as transport::TcpOptions (and the coordinator's).
  transport::LinkSecurity link_security = transport::LinkSecurity::automatic;
  transport::TlsFiles tls_files;
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
  [[nodiscard]] GroupAssignment next_group(std::string_view reason, transport::Deadline deadline);

  // At the boundary before window `window` of the current generation: true when the group must
  // be re-formed now (call next_group). Every member gets the same answer for the same window,
  // except that once a regroup of the generation is pending (a member saw a failure) the
  // answer is true: that window's collective could not complete anyway. Throws InvalidArgument
  // before the first group or while a next_group request is unanswered.
  [[nodiscard]] bool boundary(std::uint64_t window, transport::Deadline deadline);

  // Tells the coordinator this worker is done (waiting up to 5 s for its acknowledgement);
  // closes the connection. Idempotent; later calls of the other functions throw
  // MembershipError.
  void leave() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pulseloco::elastic
