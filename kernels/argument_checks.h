// Internal: argument checks shared by the CPU and CUDA window kernels: every public kernel
// validates its arguments with these before doing any work, and throws InvalidArgument naming the
// kernel.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include <pulseloco/kernels/patch_kernels.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco::kernels::detail {

void check_count(std::uint64_t count, std::string_view kernel);
void check_dtype(DType dtype, std::string_view kernel);
void check_bf16_delta(Bf16Delta bf16_delta, std::string_view kernel);
void check_pointer(const void* pointer, std::uint64_t count, std::string_view kernel,
                   std::string_view what);
void check_gate_chunk(const GateChunk& chunk, std::string_view kernel);
void check_window_chunk(const WindowChunk& chunk, std::string_view kernel);
void check_patch_arguments(const PatchChunk& chunk, const PatchOutput& out,
                           std::string_view kernel);
void check_outer_params(const OuterStepParams& params, std::string_view kernel);
// At least one rank; per rank as many values as offsets, and no null buffer with entries. (The
// offsets themselves are checked where they can be read: on the CPU before use, on the GPU by
// a validation kernel.)
void check_ranks_shape(std::span<const SparseEntries> ranks_in_order, std::string_view kernel);
// Host entries only: every rank's offsets strictly ascending and below `count` (InvalidArgument
// naming the rank as peer and the entry as index otherwise).
void check_ranks_offsets(std::span<const SparseEntries> ranks_in_order, std::uint64_t count,
                         std::string_view kernel);

}  // namespace pulseloco::kernels::detail
