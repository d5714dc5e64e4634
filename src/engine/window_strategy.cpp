#include <pulseloco/engine/window_strategy.h>

#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/ddp_sync.h>
#include <pulseloco/engine/diloco_window.h>
#include <pulseloco/engine/overlapped_window.h>
#include <pulseloco/engine/pulse_window.h>

namespace pulseloco::engine_detail {

void WindowStrategy::average_gradients(const AttachedGroup& /*group*/,
                                       std::span<const TensorView> /*gradients*/) {
  throw InvalidArgument("average_gradients() is for mode ddp; this run is mode " +
                        std::string(mode_name(mode())));
}

std::unique_ptr<WindowStrategy> make_window_strategy(ReplicatedState& state,
                                                     const EngineOptions& options,
                                                     ThreadPool& pool) {
  switch (options.mode) {
    case Mode::pulse:
      if (options.overlap != Overlap::blocking) {
        return std::make_unique<OverlappedPulseWindow>(state, options, pool);
      }
      return std::make_unique<PulseWindow>(state, options, pool);
    case Mode::diloco:
      return std::make_unique<DilocoWindow>(state, options, pool);
    case Mode::ddp:
      return std::make_unique<DdpSync>(state);
  }
  throw InvalidArgument("unknown mode");
}

void throw_non_finite(const ReplicatedState& state, int rank, const ChunkRef& chunk,
                      std::uint64_t offset) {
  throw NonFiniteError(
      "the pseudo-gradient is not finite (the local model diverged); nothing was sent",
      {.rank = rank, .tensor = state.name(chunk.tensor), .index = chunk.begin + offset});
}

std::vector<int> rejecting_ranks(const AttachedGroup& group, bool accepted) {
  const auto votes =
      collectives::allgather_u64(group.transport(), accepted ? 1u : 0u, group.collective());
  std::vector<int> rejecting;
  for (int r = 0; r < group.world(); ++r) {
    if (votes[static_cast<std::size_t>(r)] != 1) rejecting.push_back(r);
  }
  return rejecting;
}

void throw_rejected(const AttachedGroup& group, const std::vector<int>& rejecting,
                    const std::exception_ptr& local_error) {
  if (local_error) std::rethrow_exception(local_error);
  throw ProtocolError(
      "the window was rejected by other ranks (invalid messages); "
      "state left unchanged",
      {.rank = group.rank(), .ranks = rejecting});
}

void agree_to_commit(const AttachedGroup& group, bool accepted,
                     const std::exception_ptr& local_error) {
  const std::vector<int> rejecting = rejecting_ranks(group, accepted);
  if (local_error || !rejecting.empty()) throw_rejected(group, rejecting, local_error);
}

double density_of(const WindowReport& report) {
  return report.parameters > 0
             ? static_cast<double>(report.entries_sent) / static_cast<double>(report.parameters)
             : 0.0;
}

void set_overlap(WindowReport& report, const SetOverlap& overlap) {
  report.exchange = std::string(overlap.exchange);
  report.union_entries = overlap.union_entries;
  report.group_entries = overlap.group_entries;
  report.union_ratio = overlap.group_entries > 0 ? static_cast<double>(overlap.union_entries) /
                                                       static_cast<double>(overlap.group_entries)
                                                 : 0.0;
}

std::uint64_t DenseBuckets::allreduce(const AttachedGroup& group, std::uint64_t elements) const {
  transport::Transport& transport = group.transport();
  const std::uint64_t before = transport.stats().payload_bytes_received;
  collectives::allreduce_sum(transport, std::span<const float>(input(), elements),
                             std::span<float>(output(), elements), group.collective());
  return transport.stats().payload_bytes_received - before;
}

void DenseBuckets::prepare(StateMemory& memory, const transport::Transport& transport,
                           std::uint64_t elements) {
  const BucketMemory where =
      transport.buffer_device() == memory.device() ? BucketMemory::state : BucketMemory::host;
  if (input_.values != nullptr && input_.where == where && input_.capacity >= elements) return;
  input_ = {};  // freed before the next allocation, so two pairs never coexist
  output_ = {};
  const auto allocate = [&] {
    return where == BucketMemory::state ? memory.allocate_bucket(elements) : host_bucket(elements);
  };
  input_ = allocate();
  output_ = allocate();
}

}  // namespace pulseloco::engine_detail
