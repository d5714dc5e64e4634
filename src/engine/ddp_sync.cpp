#include <pulseloco/engine/ddp_sync.h>

#include <fmt/format.h>

#include <cstring>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>

namespace pulseloco::engine_detail {

void DdpSync::run(const AttachedGroup& group, WindowReport& report) {
  report.entries_sent = payload_bytes_ / sizeof(float);
  report.payload_bytes = payload_bytes_;
  report.received_bytes = payload_bytes_ * static_cast<std::uint64_t>(group.world() - 1);
  report.seconds.exchange = exchange_seconds_;
  report.density = 1.0;  // every element, every step
  payload_bytes_ = 0;
  exchange_seconds_ = 0;
}

void DdpSync::average_gradients(const AttachedGroup& group, std::span<const TensorView> gradients) {
  const std::size_t tensors = state_.tensor_count();
  if (gradients.size() != tensors) {
    throw InvalidArgument(
        fmt::format("{} gradients given for {} parameters", gradients.size(), tensors));
  }
  const Layout& layout = state_.layout();
  for (std::size_t t = 0; t < tensors; ++t) {
    const TensorView& g = gradients[t];
    if (g.numel != layout.tensors()[t].numel || g.dtype != state_.local_dtype(t) ||
        !g.device.is_cpu() || (g.numel > 0 && g.data == nullptr)) {
      throw InvalidArgument("gradient does not match its parameter (size, dtype, device)",
                            {.tensor = state_.name(t)});
    }
  }
  const auto start = SteadyClock::now();
  const auto& chunks = layout.chunks();
  const auto divisor = static_cast<float>(group.world());
  for (const BucketRef& bucket : layout.buckets()) {
    auto scratch = bucket_scratch_.acquire();
    scratch->input.resize(bucket.elements);
    scratch->output.resize(bucket.elements);
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < bucket.chunk_count; ++i) {
      const ChunkRef& chunk = chunks[bucket.first_chunk + i];
      const TensorView& g = gradients[chunk.tensor];
      if (g.dtype == DType::float32) {
        std::memcpy(scratch->input.data() + at, static_cast<const float*>(g.data) + chunk.begin,
                    chunk.length * sizeof(float));
      } else {
        bf16_to_float(
            std::span(static_cast<const std::uint16_t*>(g.data) + chunk.begin, chunk.length),
            std::span(scratch->input.data() + at, chunk.length));
      }
      at += chunk.length;
    }
    collectives::allreduce_sum(group.transport(), scratch->input, scratch->output,
                               group.collective());
    kernels::divide(scratch->output.data(), bucket.elements, divisor);
    at = 0;
    for (std::size_t i = 0; i < bucket.chunk_count; ++i) {
      const ChunkRef& chunk = chunks[bucket.first_chunk + i];
      const TensorView& g = gradients[chunk.tensor];
      if (g.dtype == DType::float32) {
        std::memcpy(static_cast<float*>(g.data) + chunk.begin, scratch->output.data() + at,
                    chunk.length * sizeof(float));
      } else {
        float_to_bf16(std::span(scratch->output.data() + at, chunk.length),
                      std::span(static_cast<std::uint16_t*>(g.data) + chunk.begin, chunk.length));
      }
      at += chunk.length;
    }
  }
  payload_bytes_ += layout.parameters() * sizeof(float);
  exchange_seconds_ += seconds_since(start);
}

}  // namespace pulseloco::engine_detail
