#include <pulseloco/engine/diloco_window.h>

#include <optional>
#include <span>
#include <vector>

namespace pulseloco::engine_detail {

void DilocoWindow::run(const AttachedGroup& group, WindowReport& report) {
  group.reached(WindowPhase::gate, report.window);
  auto phase = SteadyClock::now();
  const double waited_before = collectives::header_wait_seconds();
  const Exchanged exchanged = exchange(group);
  double exchange_seconds = exchanged.seconds;
  const auto agree_start = SteadyClock::now();
  state_.accept_window();
  agree_to_commit(group, true, nullptr);
  exchange_seconds += seconds_since(agree_start);
  report.seconds.exchange = exchange_seconds;
  report.seconds.exchange_wait = collectives::header_wait_seconds() - waited_before;
  report.seconds.gate = seconds_since(phase) - exchange_seconds;
  group.reached(WindowPhase::aggregate, report.window);
  const std::uint64_t parameters = state_.layout().parameters();
  report.entries_sent = parameters;
  report.payload_bytes = parameters * sizeof(float);
  report.received_bytes = exchanged.received_bytes;
  report.density = density_of(report);
  set_overlap(report,
              {parameters, parameters * static_cast<std::uint64_t>(group.world()), "allreduce"});

  phase = SteadyClock::now();
  apply(group.world());
  report.seconds.apply = seconds_since(phase);
}

DilocoWindow::Exchanged DilocoWindow::exchange(const AttachedGroup& group) {
  const auto& chunks = state_.layout().chunks();
  StateMemory& memory = state_.memory();
  Exchanged exchanged;
  for (const BucketRef& bucket : state_.layout().buckets()) {
    buckets_.prepare(memory, group.transport(), bucket.elements);
    const BucketMemory where = buckets_.where();
    std::vector<std::uint64_t> offsets(bucket.chunk_count);
    for (std::size_t i = 1; i < bucket.chunk_count; ++i) {
      offsets[i] = offsets[i - 1] + chunks[bucket.first_chunk + i - 1].length;
    }
    pool_.parallel_for(bucket.chunk_count, [&](std::size_t i) {
      const ChunkRef& chunk = chunks[bucket.first_chunk + i];
      const std::optional<std::uint64_t> non_finite =
          memory.pseudo_gradient(chunk, buckets_.input() + offsets[i], where);
      if (non_finite) throw_non_finite(state_, group.rank(), chunk, *non_finite);
    });
    const auto start = SteadyClock::now();
    exchanged.received_bytes += buckets_.allreduce(group, bucket.elements);
    exchanged.seconds += seconds_since(start);
    group.reached(WindowPhase::exchange, state_.next_window());
    for (std::size_t i = 0; i < bucket.chunk_count; ++i) {
      memory.hold_dense_sum(chunks[bucket.first_chunk + i], buckets_.output() + offsets[i], where);
    }
  }
  return exchanged;
}

void DilocoWindow::apply(int world) {
  const auto& chunks = state_.layout().chunks();
  const kernels::OuterStepParams params{options_.outer_lr, options_.outer_momentum,
                                        !state_.momentum_initialised()};
  const auto divisor = static_cast<float>(world);
  pool_.parallel_for(chunks.size(), [&](std::size_t c) {
    state_.apply_dense_average(chunks[c], divisor, params);
  });
}

}  // namespace pulseloco::engine_detail
