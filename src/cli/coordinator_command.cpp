// `pulseloco coordinator`: runs the elastic-membership coordinator (elastic/coordinator.h) that
// workers of an elastic run register with. It prints "coordinator listening on HOST:PORT" once
// it accepts connections, and runs until the run is over: exit status 0 when every member of
// the last generation has left, 1 (with the reason) when the run stopped because the group fell
// below the minimum or every worker was lost. The shared secret comes from PULSELOCO_SECRET or
// PULSELOCO_SECRET_FILE and the run id from PULSELOCO_RUN_ID, as for the workers; without a
// secret it listens only on loopback, unless --insecure (or PULSELOCO_ALLOW_INSECURE=1).
#include <fmt/format.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include <pulseloco/cli/commands.h>
#include <pulseloco/cli/flag_checks.h>
#include <pulseloco/elastic/coordinator.h>
#include <pulseloco/group/options.h>

namespace pulseloco::cli {

void add_coordinator_command(CLI::App& app) {
  auto* command = app.add_subcommand(
      "coordinator",
      "Run the elastic membership coordinator: forms successive groups of workers, re-forms "
      "them when a worker is lost, admits new workers at window boundaries");
  auto options = std::make_shared<elastic::CoordinatorOptions>();
  auto regroup_timeout_ms = std::make_shared<std::int64_t>(options->regroup_timeout.count());
  command->add_option("--host", options->host, "Address to listen on")->capture_default_str();
  command->add_option("--port", options->port, "Port to listen on (0: any free port)")
      ->check(flags::between(0, 65535))
      ->capture_default_str();
  command
      ->add_option("--initial-workers", options->initial_workers,
                   "The first generation forms once this many workers wait")
      ->check(flags::at_least(1))
      ->capture_default_str();
  command
      ->add_option("--min-workers", options->min_workers,
                   "The run stops when a new generation would be smaller than this")
      ->check(flags::at_least(1))
      ->capture_default_str();
  command
      ->add_option("--max-workers", options->max_workers,
                   "Largest group (0: no limit); further workers wait for a place")
      ->check(flags::at_least(0))
      ->capture_default_str();
  command
      ->add_option("--join-every", options->join_every_windows,
                   "Admit waiting workers at window boundaries that are multiples of this")
      ->check(flags::at_least(1))
      ->capture_default_str();
  // A week is far beyond any regroup; the bound keeps the regroup deadline (now + timeout on
  // the steady clock's nanoseconds) from overflowing into the past.
  constexpr std::int64_t max_regroup_timeout_ms = 7 * 24 * 3600 * std::int64_t{1000};
  command
      ->add_option("--regroup-timeout-ms", *regroup_timeout_ms,
                   "How long a regroup waits for every member to ask for a new group (must "
                   "exceed twice the workers' collective timeout and their connect timeout; at "
                   "most 7 days)")
      ->check(flags::between(std::int64_t{1}, max_regroup_timeout_ms))
      ->capture_default_str();
  command->add_flag("--insecure", options->allow_insecure,
                    "Listen beyond loopback without a shared secret (a trusted network only: "
                    "anyone who reaches the port can join); also PULSELOCO_ALLOW_INSECURE=1");
  command->callback([options, regroup_timeout_ms] {
    elastic::CoordinatorOptions run = *options;
    run.regroup_timeout = std::chrono::milliseconds(*regroup_timeout_ms);
    const group::TransportOptions environment = group::from_environment();
    run.secret = environment.tcp.secret;
    run.run_id = environment.run_id;
    run.allow_insecure = run.allow_insecure || environment.tcp.allow_insecure;
    run.link_security = environment.tcp.link_security;
    run.tls_files = environment.tcp.tls_files;
    elastic::Coordinator coordinator(run);
    // Scripts and tests wait for this line before starting workers.
    fmt::print("coordinator listening on {}:{}\n", run.host, coordinator.port());
    std::fflush(stdout);
    coordinator.wait();  // throws MembershipError when the run stopped (exit status 1)
    fmt::print("the run has finished after {} generation{}\n", coordinator.generation(),
               coordinator.generation() == 1 ? "" : "s");
    std::fflush(stdout);
  });
}

}  // namespace pulseloco::cli
