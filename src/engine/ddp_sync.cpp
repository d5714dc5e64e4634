#include <pulseloco/engine/ddp_sync.h>

#include <fmt/format.h>

#include <pulseloco/base/errors.h>

namespace pulseloco::engine_detail {

void DdpSync::run(const AttachedGroup& group, WindowReport& report) {
  report.entries_sent = payload_bytes_ / sizeof(float);
  report.payload_bytes = payload_bytes_;
  report.received_bytes = received_bytes_;
  report.seconds.exchange = exchange_seconds_;
  report.seconds.exchange_wait = exchange_wait_seconds_;
  report.density = 1.0;  // every element, every step
  set_overlap(report,
              {report.entries_sent, report.entries_sent * static_cast<std::uint64_t>(group.world()),
               "allreduce"});
  payload_bytes_ = 0;
  received_bytes_ = 0;
  exchange_seconds_ = 0;
  exchange_wait_seconds_ = 0;
}

void DdpSync::average_gradients(const AttachedGroup& group, std::span<const TensorView> gradients) {
  const std::size_t tensors = state_.tensor_count();
  if (gradients.size() != tensors) {
    throw InvalidArgument(
        fmt::format("{} gradients given for {} parameters", gradients.size(), tensors));
  }
  const Layout& layout = state_.layout();
  StateMemory& memory = state_.memory();
  const Device home = memory.device();
  for (std::size_t t = 0; t < tensors; ++t) {
    const TensorView& g = gradients[t];
    if (g.numel != layout.tensors()[t].numel || g.dtype != state_.local_dtype(t) ||
        (home.is_cpu() ? !g.device.is_cpu() : g.device != home) ||
        (g.numel > 0 && g.data == nullptr)) {
      throw InvalidArgument("gradient does not match its parameter (size, dtype, device)",
                            {.tensor = state_.name(t)});
    }
  }
  const auto start = SteadyClock::now();
  const double waited_before = collectives::header_wait_seconds();
  const auto& chunks = layout.chunks();
  const auto divisor = static_cast<float>(group.world());
  for (const BucketRef& bucket : layout.buckets()) {
    buckets_.prepare(memory, group.transport(), bucket.elements);
    const BucketMemory where = buckets_.where();
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < bucket.chunk_count; ++i) {
      const ChunkRef& chunk = chunks[bucket.first_chunk + i];
      memory.load_gradient(chunk, gradients[chunk.tensor], buckets_.input() + at, where);
      at += chunk.length;
    }
    received_bytes_ += buckets_.allreduce(group, bucket.elements);
    at = 0;
    for (std::size_t i = 0; i < bucket.chunk_count; ++i) {
      const ChunkRef& chunk = chunks[bucket.first_chunk + i];
      memory.store_average(chunk, buckets_.output() + at, divisor, gradients[chunk.tensor], where);
      at += chunk.length;
    }
  }
  payload_bytes_ += layout.parameters() * sizeof(float);
  exchange_seconds_ += seconds_since(start);
  exchange_wait_seconds_ += collectives::header_wait_seconds() - waited_before;
}

}  // namespace pulseloco::engine_detail
