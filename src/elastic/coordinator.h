// Elastic membership over TCP: a coordinator that forms successive groups ("generations") of
// workers, and the client a worker uses to join, to ask for a new group after a failure, and to
// learn at each window boundary whether the group must be re-formed to admit new workers.
//
// The coordinator is deliberately small (as PCCL's master or torchelastic's rendezvous store):
// it never sees training data, only who is alive. Every generation gets a fresh group id; the
// workers then connect their data transport among themselves (peer_list rendezvous with
// group::TransportOptions::group_key = GroupAssignment::group_key), so a worker of an older
// generation can never be mistaken for a member of the current one. Every membership decision
// below is taken by membership_policy.h, a state machine without I/O; the coordinator carries
// its decisions out. The workers' side is membership_client.h; membership_messages.h has the
// messages.
//
// Protocol (docs/elastic.md has the full state machine and the failure cases):
//  - A worker opens one TCP connection to the coordinator, authenticates with the shared secret
//    (the HMAC-SHA256 challenge-response of transport/tcp/handshake.h, purpose `membership`)
//    and registers its stable worker id and the address of its data listener. The connection
//    stays open for the worker's life: its closing is how the coordinator learns that a worker
//    died.
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

#include <pulseloco/transport/tcp/tcp_options.h>

namespace pulseloco::elastic {

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
  // Shared secret (PULSELOCO_SECRET). Empty: connections are not authenticated, which is
  // refused (InvalidArgument) unless `host` is loopback or allow_insecure is set.
  std::string secret;
  // The job's run id (PULSELOCO_RUN_ID; transport/tcp/job_id.h): a worker of another job is
  // refused, naming both jobs. The workers must use the same one.
  std::string run_id;
  bool allow_insecure = false;  // listen beyond loopback without a secret (warned)
  // Encryption of the workers' connections (PULSELOCO_LINK_SECURITY, PULSELOCO_TLS_*), as
  // transport::TcpOptions.
  transport::LinkSecurity link_security = transport::LinkSecurity::automatic;
  transport::TlsFiles tls_files;
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
  // Connections refused so far (wrong secret, another job, malformed registration, duplicate
  // worker id).
  [[nodiscard]] int refused_connections() const noexcept;
  // Workers waiting to be placed in a group (not members of the current generation).
  [[nodiscard]] int waiting_workers() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pulseloco::elastic
