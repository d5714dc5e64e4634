// Internal: the link between the local ranks of one elastic worker of several ranks
// (ElasticOptions::ranks_per_worker). Local rank 0 speaks to the coordinator for the whole
// worker; over this link it passes the coordinator's answers on, and the local ranks tell each
// other how each step of a window went, so that they regroup together (elastic_engine.cpp).
//
// The link is a TCP group of the worker's ranks, formed once at the worker's rendezvous address
// (local rank 0 hosts it). It lives as long as the worker: a local rank whose process ends
// closes its connections, and every call of the others then fails naming it. A worker with a
// lost local rank cannot go on (its share of the model has no owner): the error is not one
// that a new generation cures.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/group/options.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::elastic {

class WorkerLink {
 public:
  // Forms the link (blocks until every local rank is connected, or `options.connect_timeout`):
  // `options` are the worker's transport settings (secret, link security, run id, timeouts;
  // external_rendezvous_server: a group::RendezvousServer runs at `rendezvous` instead of on
  // local rank 0) with the rendezvous at `rendezvous` ("host:port"). `worker` names the worker
  // in errors.
  WorkerLink(group::TransportOptions options, std::string_view rendezvous, int local_rank,
             int ranks_per_worker, std::string worker);
  ~WorkerLink();
  WorkerLink(const WorkerLink&) = delete;
  WorkerLink& operator=(const WorkerLink&) = delete;

  [[nodiscard]] int local_rank() const noexcept { return local_rank_; }
  [[nodiscard]] int ranks_per_worker() const noexcept { return ranks_per_worker_; }

  // Every local rank's `mine`, in local rank order (collective over the worker's ranks).
  // Waits at most `timeout` for the others. PeerLostError or TimeoutError naming the local rank
  // that was lost or did not answer.
  [[nodiscard]] std::vector<std::string> allgather(std::string_view mine,
                                                   std::chrono::milliseconds timeout);
  // Local rank 0's `mine` on every local rank (the others pass "").
  [[nodiscard]] std::string from_local_rank_0(std::string_view mine,
                                              std::chrono::milliseconds timeout);

 private:
  std::unique_ptr<transport::Transport> transport_;
  int local_rank_;
  int ranks_per_worker_;
  std::string worker_;
};

}  // namespace pulseloco::elastic
