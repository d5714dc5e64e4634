#include <pulseloco/kernels/argument_checks.h>

#include <fmt/format.h>

#include <pulseloco/base/errors.h>

namespace pulseloco::kernels {

std::string_view bf16_delta_name(Bf16Delta delta) noexcept {
  switch (delta) {
    case Bf16Delta::exact:
      return "exact";
    case Bf16Delta::authors:
      return "authors";
  }
  return "unknown";
}

Bf16Delta parse_bf16_delta(std::string_view name) {
  if (name == "exact") return Bf16Delta::exact;
  if (name == "authors") return Bf16Delta::authors;
  throw InvalidArgument(fmt::format("bf16_delta '{}' is not one of exact, authors", name));
}

}  // namespace pulseloco::kernels

namespace pulseloco::kernels::detail {

void check_count(std::uint64_t count, std::string_view kernel) {
  if (count > kMaxChunkElements) {
    throw InvalidArgument(fmt::format("{}: chunk of {} elements exceeds the maximum of {}", kernel,
                                      count, kMaxChunkElements));
  }
}

void check_dtype(DType dtype, std::string_view kernel) {
  if (dtype != DType::float32 && dtype != DType::bfloat16) {
    throw InvalidArgument(
        fmt::format("{}: unknown local dtype code {}", kernel, static_cast<int>(dtype)));
  }
}

void check_bf16_delta(Bf16Delta bf16_delta, std::string_view kernel) {
  if (bf16_delta != Bf16Delta::exact && bf16_delta != Bf16Delta::authors) {
    throw InvalidArgument(
        fmt::format("{}: unknown bf16_delta code {}", kernel, static_cast<int>(bf16_delta)));
  }
}

void check_pointer(const void* pointer, std::uint64_t count, std::string_view kernel,
                   std::string_view what) {
  if (pointer == nullptr && count > 0) {
    throw InvalidArgument(
        fmt::format("{}: {} is null for a chunk of {} elements", kernel, what, count));
  }
}

void check_patch_arguments(const PatchChunk& chunk, const PatchOutput& out,
                           std::string_view kernel) {
  check_count(chunk.count, kernel);
  check_dtype(chunk.current_dtype, kernel);
  check_pointer(chunk.snapshot, chunk.count, kernel, "snapshot");
  check_pointer(chunk.current, chunk.count, kernel, "current weights");
  check_pointer(out.offsets, chunk.count, kernel, "offset output");
  check_pointer(out.values, chunk.count, kernel, "value output");
}

void check_gate_chunk(const GateChunk& chunk, std::string_view kernel) {
  check_count(chunk.count, kernel);
  check_dtype(chunk.local_dtype, kernel);
  check_bf16_delta(chunk.bf16_delta, kernel);
  check_pointer(chunk.global, chunk.count, kernel, "global weights");
  check_pointer(chunk.local, chunk.count, kernel, "local weights");
  check_pointer(chunk.residual, chunk.count, kernel, "residual");
}

void check_window_chunk(const WindowChunk& chunk, std::string_view kernel) {
  check_count(chunk.count, kernel);
  check_dtype(chunk.local_dtype, kernel);
  check_bf16_delta(chunk.bf16_delta, kernel);
  check_pointer(chunk.global, chunk.count, kernel, "global weights");
  check_pointer(chunk.momentum, chunk.count, kernel, "momentum");
  check_pointer(chunk.residual, chunk.count, kernel, "residual");
  check_pointer(chunk.local, chunk.count, kernel, "local weights");
}

void check_outer_params(const OuterStepParams& params, std::string_view kernel) {
  const auto finite = [](float value) { return value - value == 0.0f; };
  if (!finite(params.lr) || !finite(params.momentum)) {
    throw InvalidArgument(fmt::format("{}: learning rate {} and momentum {} must be finite", kernel,
                                      params.lr, params.momentum));
  }
}

void check_ranks_shape(std::span<const SparseEntries> ranks_in_order, std::string_view kernel) {
  if (ranks_in_order.empty())
    throw InvalidArgument(fmt::format("{}: no ranks to average over", kernel));
  for (std::size_t r = 0; r < ranks_in_order.size(); ++r) {
    const SparseEntries& entries = ranks_in_order[r];
    if (entries.offsets.size() != entries.values.size()) {
      throw InvalidArgument(fmt::format("{}: {} offsets but {} values", kernel,
                                        entries.offsets.size(), entries.values.size()),
                            ErrorContext{.peer = static_cast<int>(r)});
    }
    if (!entries.offsets.empty() &&
        (entries.offsets.data() == nullptr || entries.values.data() == nullptr)) {
      throw InvalidArgument(fmt::format("{}: null entry buffers", kernel),
                            ErrorContext{.peer = static_cast<int>(r)});
    }
  }
}

void check_ranks_offsets(std::span<const SparseEntries> ranks_in_order, std::uint64_t count,
                         std::string_view kernel) {
  for (std::size_t r = 0; r < ranks_in_order.size(); ++r) {
    const SparseEntries& entries = ranks_in_order[r];
    std::uint64_t next_allowed = 0;
    for (std::size_t k = 0; k < entries.offsets.size(); ++k) {
      const std::uint64_t offset = entries.offsets[k];
      if (offset < next_allowed || offset >= count) {
        throw InvalidArgument(
            fmt::format("{}: entry {} has offset {}; offsets must be strictly ascending and below "
                        "the chunk length {}",
                        kernel, k, offset, count),
            ErrorContext{.peer = static_cast<int>(r), .index = k});
      }
      next_allowed = offset + 1;
    }
  }
}

}  // namespace pulseloco::kernels::detail
