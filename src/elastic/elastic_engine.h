// Elastic runs: an Engine whose group may lose and gain workers (docs/elastic.md).
//
//   ElasticOptions elastic;
//   elastic.coordinator = "10.0.0.1:29600";          // `pulseloco coordinator` runs there
//   ElasticEngine sync(parameters, engine_options, elastic);   // waits to be admitted
//   while (sync.engine().committed_windows() < windows) {
//     optimizer.step();
//     if (auto report = sync.after_optimizer_step()) log(*report);
//   }
//   sync.leave();
//
// Each worker registers with the coordinator (coordinator.h), which forms generations
// of the group; the data plane of each generation is a fresh TCP mesh among its members. When a
// window fails because a member died, stalled or was cut off, every survivor asks the
// coordinator for the next generation, attaches its engine to the new group (Engine::attach:
// state agreement, new members receive θ_g and m) and runs the window again with the remaining
// members (the aggregate divides by the new R; the lost worker's residual is gone). A window
// therefore commits on every member of one generation with identical bits or on none (the one
// exception, a failure during the final vote round, is repaired by attach()). New workers are
// admitted at window boundaries according to the coordinator's join policy.
//
// A worker of several ranks (ElasticOptions::ranks_per_worker) is one ElasticEngine per local
// rank, each over its share of the model; they join, regroup and leave as one worker
// (docs/elastic.md, "Workers of several ranks").
//
// Only the TCP transport can change membership: an MPI job aborts when a rank dies (see
// docs/elastic.md); NCCL communicators are fixed at creation.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pulseloco/elastic/membership_client.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/report.h>
#include <pulseloco/engine/window_runner.h>
#include <pulseloco/group/options.h>

namespace pulseloco {

class UniqueFd;
namespace elastic {
class WorkerLink;
}

struct ElasticOptions {
  std::string coordinator;  // "host:port" of the coordinator (PULSELOCO_COORDINATOR)
  std::string worker_id;    // unique in the run; "" = "<hostname>-<pid>"
  // Data-plane settings of every generation's TCP transport (connections per peer, buffers,
  // timeouts, secret, listen_addr/advertise_addr/socket_ifname). The rendezvous fields are
  // filled per generation from the coordinator's table; listen_port 0 picks a free port once.
  group::TransportOptions transport;
  // How long to wait to be admitted into a group (at start, or after a failure).
  std::chrono::milliseconds admission_timeout{600'000};
  // A window is attempted at most this many times (each attempt in a new generation).
  int max_attempts_per_window = 16;
  // Called once this worker is registered with the coordinator, just before it asks to be
  // admitted (for logs and tests). The coordinator counts it as waiting only once that request
  // has arrived (Coordinator::waiting_workers), which is a moment later.
  std::function<void()> on_registered;

  // A worker of several ranks (docs/elastic.md, "Workers of several ranks"): this process is
  // local rank `local_rank` of the worker's `ranks_per_worker` ranks. Each runs the window over
  // its own share of the model (its `parameters`) in the group of every member's same local
  // rank. Local rank 0 registers for the whole worker (its worker_id names the worker); the
  // worker's ranks talk over a link formed at `worker_link` ("host:port", where local rank 0
  // listens), and join, regroup and leave as one. Every worker of the run has the same
  // ranks_per_worker (the coordinator refuses another, naming both).
  // (transport.external_rendezvous_server: a group::RendezvousServer for the worker's ranks
  // runs there instead, as a launcher or a test may host it.)
  int local_rank = 0;
  int ranks_per_worker = 1;
  std::string worker_link;
  // How long a local rank waits for the others on that link: for their windows to end (the
  // slowest share's window), and beyond admission_timeout for local rank 0's admission. A local
  // rank that hangs is noticed after it.
  std::chrono::milliseconds worker_link_timeout{600'000};
};

// Fills coordinator, worker id and the transport options from the environment
// (PULSELOCO_COORDINATOR, PULSELOCO_WORKER_ID, and group::from_environment()).
[[nodiscard]] ElasticOptions elastic_options_from_environment(ElasticOptions defaults = {});

class ElasticEngine final : public WindowRunner {
 public:
  // Registers with the coordinator and blocks until admitted into a group (the first
  // generation, or a running one at a window boundary), then attaches the engine.
  ElasticEngine(std::vector<NamedTensor> parameters, EngineOptions options, ElasticOptions elastic);
  // Leaves the run (see leave()).
  ~ElasticEngine() override;
  ElasticEngine(const ElasticEngine&) = delete;
  ElasticEngine& operator=(const ElasticEngine&) = delete;

  // Call after every inner optimizer step. Every H-th call runs the window, re-forming the
  // group and retrying as often as members fail, and returns the report of the committed
  // window; after it, the worker may be asked to re-form the group to admit new workers (done
  // here). Throws MembershipError when the run cannot continue (below the minimum size, removed
  // by the coordinator), DivergenceError / NonFiniteError as Engine does.
  [[nodiscard]] std::optional<WindowReport> after_optimizer_step() override;

  // Runs a window now (with the same retries).
  [[nodiscard]] WindowReport run_window() override;

  // Overlapped windows: Engine::complete_in_flight(). When the group fails meanwhile, the group
  // is re-formed, which drops the window in flight on every member (its entries stay in each
  // member's residual), and nothing is returned.
  [[nodiscard]] std::optional<WindowReport> complete_in_flight() override;

  // Tells the coordinator this worker is done and closes the data plane. Idempotent.
  void leave() noexcept;

  [[nodiscard]] Engine& engine() noexcept override { return *engine_; }
  [[nodiscard]] const elastic::GroupAssignment& group() const noexcept { return group_; }
  // The worker's id (a worker of several ranks: its local rank 0's, on every local rank).
  [[nodiscard]] const std::string& worker_id() const noexcept { return worker_id_; }
  // The port of this worker's data listener, the same in every generation.
  [[nodiscard]] std::uint16_t data_port() const;
  // Generations this worker has been part of (1 for a run without membership changes).
  [[nodiscard]] int groups_joined() const noexcept { return groups_joined_; }

 private:
  // Asks for the next generation and attaches the engine to it, again until it works.
  void regroup(std::string reason);
  // The window, re-forming the group and retrying after recoverable failures.
  [[nodiscard]] WindowReport run_window_with_retries();
  // "worker w" or "worker w (local rank j)", for logs.
  [[nodiscard]] std::string who() const;
  // The answer of the coordinator to `ask`, which local rank 0 runs; passed on to the worker's
  // other local ranks (which wait up to `wait` + worker_link_timeout), errors included.
  [[nodiscard]] std::string ask_for_worker(const std::function<std::string()>& ask,
                                           std::chrono::milliseconds wait);
  // How one step went on this local rank, told to the worker's others: "" (done), or why it
  // must be retried in a new generation; `fatal`, an error that ends the worker. Returns the
  // first local rank's reason to retry ("" when every local rank is done); rethrows `fatal`
  // here, and throws the first other local rank's fatal error there.
  [[nodiscard]] std::string agree_across_local_ranks(const std::string& retry,
                                                     const std::exception_ptr& fatal);

  ElasticOptions elastic_;
  std::string worker_id_;
  std::unique_ptr<UniqueFd> data_socket_;      // this worker's data port, open for every generation
  std::unique_ptr<elastic::WorkerLink> link_;  // a worker of several ranks
  std::unique_ptr<elastic::MembershipClient> membership_;  // local rank 0's
  std::unique_ptr<Engine> engine_;
  elastic::GroupAssignment group_;
  int groups_joined_ = 0;
  bool left_ = false;
};

}  // namespace pulseloco
