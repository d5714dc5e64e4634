// Patch extraction on CUDA: the contract of kernels/patch_kernels.h for device buffers, with the
// same result as the CPU (tests/gpu/patch_kernels_cuda_test.cpp compares them). The changed
// entries are compacted with a stable CUB DeviceSelect, so their order is ascending whatever
// the scheduling; the only atomic (atomicMin of the lowest NaN offset) has an order-independent
// result. Only built when PULSELOCO_HAS_CUDA.
#pragma once

#include <cstdint>

#include <pulseloco/kernels/cuda/window_kernels_cuda.h>
#include <pulseloco/kernels/patch_kernels.h>

namespace pulseloco::kernels::cuda {

// kernels::extract_patch for a chunk whose snapshot, current weights and outputs are device
// memory of the workspace's device. Synchronises `stream` (the count reaches the host) before
// the snapshot is written, which happens only without a NaN; the write is enqueued on `stream`.
[[nodiscard]] PatchResult extract_patch(const PatchChunk& chunk, const PatchOutput& out,
                                        DeviceWorkspace& workspace, void* stream);

}  // namespace pulseloco::kernels::cuda
