// Internals shared by the CUDA kernels (window_kernels_cuda.cu, compiled by nvcc) and their host
// side (device_workspace.cpp, compiled by the C++ compiler). No CUDA headers here: the status
// is passed as an int (a cudaError_t).
#pragma once

#include <cstddef>
#include <cstdint>

#include <pulseloco/kernels/cuda/window_kernels_cuda.h>
#include <pulseloco/kernels/xxh3_blocks.h>

namespace pulseloco::kernels::cuda::detail {

// Throws IoError("CUDA <what> failed: <name> (<description>)") for a CUDA error status.
[[noreturn]] void throw_cuda_error(int status, const char* what);

inline void check(int status, const char* what) {
  if (status != 0) throw_cuda_error(status, what);
}

// Throws InvalidArgument when the current device is not the workspace's.
void check_current_device(const DeviceWorkspace& workspace, const char* kernel);

// What the kernels report back to the host; lives in device memory, mirrored in pinned memory.
struct DeviceCounters {
  long long selected;                 // the gate's fired count (written by CUB)
  unsigned long long non_finite_min;  // lowest non-finite offset, ~0 when none
  unsigned long long bad_entry_min;   // aggregate: (rank << 32 | entry) of the first bad entry
};
inline constexpr unsigned long long kNoOffset = ~0ull;

// Buffer digests on the device (digest_cuda.cu). A batch of pieces needs, per piece, a slot of
// xxh3::kLanes words for each of its 1 KiB blocks; batches are at most kDigestBatchPieces pieces
// (a bounded scratch: 256 KiB a piece).
inline constexpr std::uint64_t kDigestBlocksPerPiece = kBufferDigestPieceBytes / xxh3::kBlockBytes;
inline constexpr std::uint64_t kDigestScratchWordsPerPiece = kDigestBlocksPerPiece * xxh3::kLanes;
inline constexpr std::uint64_t kDigestBatchPieces = 256;

// Enqueues on `stream` the xxh3-64 digests of pieces [first_piece, first_piece + pieces) of the
// `size` bytes at `device_bytes` into piece_digests[first_piece...] (device memory), with
// `scratch` holding pieces * kDigestScratchWordsPerPiece words.
void enqueue_piece_digests(const void* device_bytes, std::uint64_t size, std::uint64_t first_piece,
                           std::uint64_t pieces, std::uint64_t* scratch,
                           std::uint64_t* piece_digests, void* stream);

}  // namespace pulseloco::kernels::cuda::detail

namespace pulseloco::kernels::cuda {

struct DeviceWorkspace::Impl {
  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl();

  // Makes the CUB temporary storage at least `bytes` (a synchronous cudaMalloc when it grows;
  // the old storage is freed after the device is idle, so no enqueued work still uses it).
  void reserve_temp(std::size_t bytes);
  // Device scratch, device piece digests and their pinned host mirror for a buffer digest of
  // `pieces` pieces (grown like the CUB storage).
  void reserve_digest(std::uint64_t pieces);

  int device = 0;
  void* temp = nullptr;
  std::size_t temp_bytes = 0;
  detail::DeviceCounters* device_counters = nullptr;
  detail::DeviceCounters* host_counters = nullptr;  // pinned
  std::uint64_t* digest_scratch = nullptr;
  std::uint64_t digest_scratch_pieces = 0;
  std::uint64_t* piece_digests = nullptr;
  std::uint64_t* host_piece_digests = nullptr;  // pinned
  std::uint64_t piece_digest_capacity = 0;
};

}  // namespace pulseloco::kernels::cuda
