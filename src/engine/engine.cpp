// The engine's front: what every mode's window has in common (the report, traces, the window
// counter, the digests and their comparison) around the mode's strategy, and Engine's calls.
#include <pulseloco/engine/engine.h>

#include <pulseloco/engine/bucket_transport.h>
#include <pulseloco/engine/engine_impl.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/log_lines.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/checkpoint.h>
#include <pulseloco/engine/checkpoint_commit.h>
#include <pulseloco/engine/fault_injection.h>
#include <pulseloco/engine/group_join.h>
#include <pulseloco/engine/node_layout.h>
#include <pulseloco/engine/trace.h>

namespace pulseloco {

using engine_detail::AttachedGroup;
using engine_detail::seconds_since;
using engine_detail::StateBuffer;
using engine_detail::SteadyClock;

void Engine::Impl::prepare(std::vector<NamedTensor> parameters) {
  // Invalid options are refused before any communication (the timeout itself may be invalid).
  options.validate();
  try {
    phase_observer = fault_injector_from_environment();
    state = engine_detail::ReplicatedState(std::move(parameters), options);
    if (options.codec.encoding == codec::Encoding::context &&
        options.overlap != Overlap::blocking && state.memory().device().kind != DeviceKind::cpu) {
      // An overlapped window's exchange decodes context frames against θ_g on its own thread,
      // which a device state does not serve beside the training thread's stream.
      throw InvalidArgument(fmt::format(
          "encoding context with overlap '{}' needs the state in host memory (state_location "
          "host); this run keeps it on the device",
          overlap_name(options.overlap)));
    }
  } catch (...) {
    setup_error = std::current_exception();
  }
}

AttachedGroup Engine::Impl::attached_group() const {
  if (!transport) {
    throw InvalidArgument(
        "this engine is not attached to a group (call attach() with a connected transport)",
        {.rank = rank});
  }
  return AttachedGroup(*transport, options, group, nodes ? &*nodes : nullptr, phase_observer.get());
}

void Engine::Impl::attach(std::unique_ptr<transport::Transport> replacement, GroupInfo info) {
  if (!replacement) throw InvalidArgument("attach() needs a connected transport");
  if (is_bucket_group(*replacement) && options.overlap != Overlap::blocking) {
    // The bucket's object names carry the window, which an exchange in flight across a
    // boundary would see change under it.
    throw InvalidArgument(fmt::format("overlap '{}' is not supported through an exchange bucket "
                                      "(use overlap blocking)",
                                      overlap_name(options.overlap)),
                          {.rank = replacement->rank()});
  }
  wait_in_flight();  // an exchange still running on the old transport
  transport = std::move(replacement);
  rank = transport->rank();
  world = transport->size();
  group = std::move(info);
  nodes.reset();
  committed_report.reset();
  strategy = engine_detail::make_window_strategy(state, options, pool);
  const engine_detail::StateAccess access(state);
  if (engine_detail::join_group(attached_group(), state, options, pool, setup_error)) {
    steps_in_window = 0;
    publishing.state_loaded();  // the group's state, and so its publications, are this rank's
  }
  nodes = engine_detail::agree_on_nodes(
      *transport, attached_group().collective(), options.node_aware,
      options.node_aware ? engine_detail::node_name(group.node) : std::string());
  stats_at_window_start = transport->stats();
  logger().log(
      shared_line_level(rank),
      "engine ready: rank {}/{} (group generation {}), mode {}, {} windows committed, next window "
      "{}, {} tensors, {} parameters, H={}, {} chunks, state on {}, exchange {}",
      rank, world, group.generation, mode_name(options.mode), state.committed_windows(),
      state.next_window(), state.tensor_count(), state.layout().parameters(),
      options.steps_per_window, state.layout().chunks().size(), state.location(),
      nodes ? fmt::format("node-aware over {} nodes", engine_detail::node_count(*nodes))
            : std::string("flat"));
}

void Engine::Impl::verify(const AttachedGroup& attached, WindowReport& report) const {
  const auto start = SteadyClock::now();
  if (options.verify_digests) {
    report.rank_digests =
        collectives::allgather_u64(attached.transport(), report.digest, attached.collective());
    // Ranks per digest, in order of their first rank.
    std::vector<std::pair<Digest, std::vector<int>>> holders;
    for (int r = 0; r < world; ++r) {
      const Digest d = report.rank_digests[static_cast<std::size_t>(r)];
      auto found = std::find_if(holders.begin(), holders.end(),
                                [&](const auto& entry) { return entry.first == d; });
      if (found == holders.end()) {
        holders.push_back({d, {r}});
      } else {
        found->second.push_back(r);
      }
    }
    report.replicas_identical = holders.size() == 1;
    if (!report.replicas_identical) {
      Digest majority = 0;
      std::size_t majority_count = 0;
      for (const auto& [digest, ranks] : holders) {
        if (ranks.size() > majority_count) {
          majority = digest;
          majority_count = ranks.size();
        }
      }
      std::vector<int> diverging;
      std::string which;
      if (2 * majority_count > static_cast<std::size_t>(world)) {
        for (int r = 0; r < world; ++r) {
          if (report.rank_digests[static_cast<std::size_t>(r)] != majority) diverging.push_back(r);
        }
        which = fmt::format("{} {} differ from the majority's digest {}",
                            diverging.size() == 1 ? "rank" : "ranks", fmt::join(diverging, ", "),
                            digest_hex(majority));
      } else {
        // No majority (e.g. two ranks): no digest is more right than another.
        for (int r = 0; r < world; ++r)
          diverging.push_back(r);
        std::vector<std::string> groups;
        for (const auto& [digest, ranks] : holders)
          groups.push_back(fmt::format("{} on {} {}", digest_hex(digest),
                                       ranks.size() == 1 ? "rank" : "ranks",
                                       fmt::join(ranks, ", ")));
        which = fmt::format("no digest is held by a majority: {}", fmt::join(groups, "; "));
      }
      std::string cause;
      if (options.mode == Mode::ddp) {
        // The usual cause in ddp mode: gradients that were not averaged on some rank.
        const auto missed = collectives::allgather_u64(
            attached.transport(), gradients_not_averaged ? 1 : 0, attached.collective());
        std::vector<int> missing;
        for (int r = 0; r < world; ++r) {
          if (missed[static_cast<std::size_t>(r)] != 0) missing.push_back(r);
        }
        if (!missing.empty())
          cause = fmt::format(
              ". ddp mode averages the gradients in before_optimizer_step() "
              "(Engine::average_gradients()), and {} {} did not call it on every optimizer step of "
              "this window: call it after backward() and before optimizer.step() on every step",
              missing.size() == 1 ? "rank" : "ranks", fmt::join(missing, ", "));
      }
      throw DivergenceError(
          fmt::format("replica digests differ after window {}: {}{}", report.window, which, cause),
          {.rank = rank, .ranks = diverging});
    }
  }
  report.seconds.verify = seconds_since(start);
}

WindowReport Engine::Impl::new_report() const {
  WindowReport report;
  // Overlapped windows: the window whose inner steps end now follows the one in flight.
  report.window = state.next_window();
  report.mode = options.mode;
  report.overlap = options.overlap;
  report.rank = rank;
  report.world_size = world;
  report.generation = group.generation;
  report.members = group.members;
  report.parameters = state.layout().parameters();
  report.steps_per_window = options.steps_per_window;
  report.diloco_bytes = report.parameters * sizeof(float);
  report.ddp_bytes = options.steps_per_window * report.parameters * sizeof(float);
  report.state_location = state.location();
  return report;
}

WindowReport Engine::Impl::run_window() {
  const AttachedGroup attached = attached_group();
  if (!state.has_contents()) {
    throw InvalidArgument("this engine holds no state yet: attach() it to a group first",
                          {.rank = rank});
  }
  const auto start = SteadyClock::now();
  committed_report.reset();
  WindowReport report = new_report();
  const engine_detail::StateAccess access(state);

  const std::uint64_t averages = gradient_averages;
  // A window that averaged nothing counts too: a loop that runs its windows with run_window()
  // counts no optimizer steps, but still stepped on its own gradients if it trained at all.
  gradients_not_averaged =
      options.mode == Mode::ddp && (averages < steps_in_window || averages == 0);
  if (averages < steps_in_window && options.mode == Mode::ddp && !warned_gradients_not_averaged) {
    warned_gradients_not_averaged = true;
    logger().warn(
        "ddp mode: window {} ran {} optimizer steps but averaged the gradients {} times: call "
        "before_optimizer_step() (Engine::average_gradients()) after backward() and before "
        "optimizer.step() on every step, or the replicas diverge",
        report.window, steps_in_window, averages);
  }
  const bool tracing = !options.trace_dir.empty();
  if (tracing) engine_detail::write_trace_inputs(state, options, attached, report.window);
  label_bucket_window(attached.transport(), report.window);
  strategy->run(attached, report);
  if (options.overlap == Overlap::blocking) {
    // The window has committed on this rank: θ_g, m, e and θ_l hold its results. What follows
    // (digests, the trace) may still fail, but the window is not run again. (An overlapped
    // strategy counts the window it applied itself.)
    state.commit_window();
    report.applied_window = report.window;
  }
  steps_in_window = 0;
  gradient_averages = 0;
  if (tracing) {
    engine_detail::write_trace_outputs(state, options, attached, report);
  }
  finish_boundary(attached, report, start);
  return report;
}

void Engine::Impl::finish_boundary(const AttachedGroup& attached, WindowReport& report,
                                   SteadyClock::time_point start) {
  report.digest = state.digest(pool);
  committed_report = report;
  verify(attached, report);
  committed_report.reset();
  // Only a state every rank agrees on is published; a failure here is the report's, not the
  // window's (weight_publishing.h). A boundary that applied nothing has nothing new.
  if (report.applied_window) publishing.after_window(state, rank, report);

  const transport::TransportStats now = transport->stats();
  report.wire_bytes_sent = now.wire_bytes_sent - stats_at_window_start.wire_bytes_sent;
  report.wire_bytes_received = now.wire_bytes_received - stats_at_window_start.wire_bytes_received;
  stats_at_window_start = now;
  report.seconds.exchange_wait =
      std::clamp(report.seconds.exchange_wait, 0.0, report.seconds.exchange);
  report.seconds.exchange_transfer = report.seconds.exchange - report.seconds.exchange_wait;
  report.seconds.total =
      seconds_since(start) + (strategy->exchanges_during_steps() ? report.seconds.exchange : 0.0);
  logger().log(shared_line_level(rank), "{}", summary_line(report));
  // The window in flight's exchange runs from here until the next boundary (overlapped
  // windows): nothing else uses the transport meanwhile.
  strategy->start_in_flight(attached);
}

std::optional<WindowReport> Engine::Impl::complete_in_flight() {
  if (!strategy || !state.in_flight()) return std::nullopt;
  const AttachedGroup attached = attached_group();
  const auto start = SteadyClock::now();
  committed_report.reset();
  WindowReport report = new_report();
  report.window = state.in_flight()->window;
  const engine_detail::StateAccess access(state);
  if (!strategy->complete_in_flight(attached, report)) return std::nullopt;
  finish_boundary(attached, report, start);
  return report;
}

void Engine::Impl::wait_in_flight() noexcept {
  if (strategy) strategy->wait_in_flight();
}

Engine::Engine(std::vector<NamedTensor> parameters, EngineOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->prepare(std::move(parameters));
  if (impl_->setup_error) std::rethrow_exception(impl_->setup_error);
}

Engine::Engine(std::vector<NamedTensor> parameters, EngineOptions options,
               std::unique_ptr<transport::Transport> transport)
    : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->prepare(std::move(parameters));
  impl_->attach(std::move(transport), GroupInfo{});
}

Engine::~Engine() {
  impl_->wait_in_flight();  // before the transport it uses goes away
}

void Engine::attach(std::unique_ptr<transport::Transport> transport, GroupInfo group) {
  impl_->attach(std::move(transport), std::move(group));
}

void Engine::detach() noexcept {
  impl_->wait_in_flight();
  impl_->transport.reset();
}

std::optional<WindowReport> Engine::take_committed_report() {
  return std::exchange(impl_->committed_report, std::nullopt);
}

bool Engine::next_step_runs_window() const noexcept {
  return impl_->steps_in_window + 1 >= impl_->options.steps_per_window;
}

namespace {

// A checkpoint root as Impl::checkpoint_roots compares it: absolute, links resolved where it
// exists, without a trailing separator ("ck/" and "ck" are one root).
std::filesystem::path root_identity(const std::filesystem::path& root) {
  std::error_code error;
  std::filesystem::path path = std::filesystem::weakly_canonical(root, error);
  if (error) path = std::filesystem::absolute(root, error);
  path = path.lexically_normal();
  if (!path.has_filename() && path.has_parent_path()) path = path.parent_path();
  return path;
}

}  // namespace

std::filesystem::path Engine::save_checkpoint(const std::filesystem::path& root,
                                              const CheckpointSave& save) {
  const engine_detail::StateAccess access(impl_->state);
  impl_->wait_in_flight();  // the save's collectives must not run beside the exchange
  auto& roots = impl_->checkpoint_roots;
  const bool ours = std::find(roots.begin(), roots.end(), root_identity(root)) != roots.end();
  std::filesystem::path dir = engine_detail::save_checkpoint(
      impl_->state, impl_->options, impl_->attached_group(), impl_->pool, root, ours, save);
  if (!ours) roots.push_back(root_identity(root));  // it exists now: links resolved
  return dir;
}

std::optional<std::filesystem::path> newest_checkpoint(const std::filesystem::path& root) {
  return engine_detail::newest_committed_checkpoint(root);
}

LoadedCheckpoint Engine::load_checkpoint(const std::filesystem::path& path,
                                         std::span<const std::string> required_files) {
  const engine_detail::StateAccess access(impl_->state);
  impl_->wait_in_flight();
  const engine_detail::AttachedGroup group = impl_->attached_group();
  LoadedCheckpoint loaded = engine_detail::load_checkpoint(impl_->state, impl_->options, group,
                                                           impl_->pool, path, required_files);
  impl_->checkpoint_roots.push_back(root_identity(loaded.dir.parent_path()));
  impl_->steps_in_window = 0;
  impl_->publishing.state_loaded();
  if (impl_->strategy) {
    // A window in flight when the checkpoint was taken is sent again, as it was then.
    impl_->strategy->state_loaded();
    impl_->strategy->start_in_flight(group);
  }
  return loaded;
}

void Engine::save_global_weights(const std::filesystem::path& file) const {
  const engine_detail::StateAccess access(impl_->state);
  engine_detail::save_global_weights(impl_->state, impl_->options, impl_->rank, impl_->pool, file);
}

void Engine::load_trace_inputs(const std::filesystem::path& file) {
  const engine_detail::StateAccess access(impl_->state);
  impl_->wait_in_flight();
  engine_detail::load_trace_inputs(impl_->state, impl_->rank, impl_->world, file);
  impl_->steps_in_window = 0;
  if (impl_->strategy) impl_->strategy->state_loaded();
}

namespace {

// EngineOptions::on_report sees every report the engine returns.
WindowReport delivered(const EngineOptions& options, WindowReport report) {
  if (options.on_report) options.on_report(report);
  return report;
}

}  // namespace

std::optional<WindowReport> Engine::after_optimizer_step() {
  if (++impl_->steps_in_window < impl_->options.steps_per_window) return std::nullopt;
  return delivered(impl_->options, impl_->run_window());
}

WindowReport Engine::run_window() {
  return delivered(impl_->options, impl_->run_window());
}

std::optional<WindowReport> Engine::complete_in_flight() {
  std::optional<WindowReport> report = impl_->complete_in_flight();
  if (report) return delivered(impl_->options, std::move(*report));
  return report;
}

bool Engine::window_in_flight() const noexcept {
  return impl_->state.in_flight().has_value();
}

void Engine::average_gradients(std::span<const TensorView> gradients) {
  const AttachedGroup group = impl_->attached_group();
  const engine_detail::StateAccess access(impl_->state);  // device state: after the caller's stream
  impl_->strategy->average_gradients(group, gradients);
  ++impl_->gradient_averages;
}

int Engine::rank() const noexcept {
  return impl_->rank;
}
int Engine::world_size() const noexcept {
  return impl_->world;
}
std::uint64_t Engine::committed_windows() const noexcept {
  return impl_->state.committed_windows();
}
std::uint64_t Engine::next_window() const noexcept {
  return impl_->state.next_window();
}
std::uint64_t Engine::parameter_count() const noexcept {
  return impl_->state.layout().parameters();
}
const EngineOptions& Engine::options() const noexcept {
  return impl_->options;
}
transport::Transport& Engine::transport() {
  return impl_->attached_group().transport();
}
const GroupInfo& Engine::group() const noexcept {
  return impl_->group;
}

std::span<const float> Engine::global_weights(std::size_t tensor) const {
  return impl_->state.host_values(StateBuffer::global, tensor);
}
std::span<const float> Engine::momentum(std::size_t tensor) const {
  return impl_->state.host_values(StateBuffer::momentum, tensor);
}
std::span<const float> Engine::residual(std::size_t tensor) const {
  return impl_->state.host_values(StateBuffer::residual, tensor);
}
std::vector<float> Engine::copy_state(StateTensor which, std::size_t tensor) const {
  const StateBuffer buffer = which == StateTensor::global_weights ? StateBuffer::global
                             : which == StateTensor::momentum     ? StateBuffer::momentum
                                                                  : StateBuffer::residual;
  const engine_detail::StateAccess access(impl_->state);
  return impl_->state.copy_values(buffer, tensor);
}
Digest Engine::state_digest() const {
  const engine_detail::StateAccess access(impl_->state);
  return impl_->state.digest(impl_->pool);
}
std::string Engine::state_location() const {
  return impl_->state.location();
}
void Engine::set_cuda_stream(void* stream) {
  impl_->state.memory().set_caller_stream(stream);
}

}  // namespace pulseloco
