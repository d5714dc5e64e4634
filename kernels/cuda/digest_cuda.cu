// Buffer digests of device memory (base/digest.h's definition): libxxhash's XXH3_64bits of
// every 4 MiB piece, computed on the device from kernels/xxh3_blocks.h's decomposition.
//
// Two kernels per batch of pieces: block_contributions_kernel reads the data once, a warp per
// 1 KiB block, and writes each block's contribution to the 8 lanes into the workspace's
// scratch; finish_pieces_kernel runs each lane's scramble chain over those contributions (a
// thread per piece and lane), then the tail (xxh3's last partial block, last stripe and merge;
// the short-input paths for pieces of at most 240 bytes), and writes the piece's digest.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <pulseloco/base/digest.h>
#include <pulseloco/kernels/cuda/cuda_internal.h>
#include <pulseloco/kernels/xxh3_blocks.h>

namespace pulseloco::kernels::cuda::detail {
namespace {

constexpr int kWarp = 32;
constexpr int kContributionThreads = 256;  // 8 warps, a block each
constexpr int kFinishThreads = 64;         // 8 pieces, a lane each
constexpr std::uint64_t kPieceBytes = kBufferDigestPieceBytes;
static_assert(kPieceBytes % xxh3::kBlockBytes == 0);
// Each thread of a warp reads words t, t + 32, t + 64 and t + 96 of its block: all of one lane.
static_assert(xxh3::kBlockBytes == 4 * kWarp * sizeof(std::uint64_t) && kWarp % xxh3::kLanes == 0);

// The secret in shared memory: xxh3_blocks.h reads it at unaligned offsets through a pointer.
__device__ __forceinline__ void load_secret(const xxh3::Secret& secret, std::uint8_t* shared) {
  for (unsigned i = threadIdx.x; i < xxh3::kSecretBytes; i += blockDim.x)
    shared[i] = secret.bytes[i];
  __syncthreads();
}

__device__ __forceinline__ std::uint64_t piece_length(std::uint64_t size, std::uint64_t piece) {
  const std::uint64_t begin = piece * kPieceBytes;
  return size - begin < kPieceBytes ? size - begin : kPieceBytes;
}

// Where one lane's contributions of one piece of the batch start: kDigestBlocksPerPiece words,
// a word per block, so that the lane's chain reads them in order.
__device__ __forceinline__ std::uint64_t lane_slot(std::uint64_t batch_piece, unsigned lane) {
  return (batch_piece * xxh3::kLanes + lane) * kDigestBlocksPerPiece;
}

template <bool kAligned>
__global__ void block_contributions_kernel(const std::uint8_t* bytes, std::uint64_t size,
                                           std::uint64_t first_piece, std::uint64_t pieces,
                                           xxh3::Secret secret, std::uint64_t* scratch) {
  __shared__ std::uint8_t shared_secret[xxh3::kSecretBytes];
  load_secret(secret, shared_secret);
  // A warp per (piece, block) slot; the grid ends at the last piece's last full block.
  const std::uint64_t warp =
      (static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  const unsigned t = threadIdx.x % kWarp;
  const std::uint64_t batch_piece = warp / kDigestBlocksPerPiece;
  const std::uint64_t block = warp % kDigestBlocksPerPiece;
  if (batch_piece >= pieces) return;
  const std::uint64_t piece = first_piece + batch_piece;
  const std::uint64_t length = piece_length(size, piece);
  // Uniform across the warp: all its threads share the slot.
  if (length <= xxh3::kMidsizeMax || block >= xxh3::full_blocks(length)) return;
  const std::uint8_t* input = bytes + piece * kPieceBytes + block * xxh3::kBlockBytes;
  const unsigned lane = t % xxh3::kLanes;
  unsigned long long data = 0;
  unsigned long long product = 0;
#pragma unroll
  for (unsigned j = 0; j < 4; ++j) {
    const unsigned word = t + kWarp * j;
    const unsigned stripe = word / xxh3::kLanes;
    const std::uint64_t value = kAligned ? reinterpret_cast<const std::uint64_t*>(input)[word]
                                         : xxh3::read_le64(input + 8 * word);
    data += value;
    product += xxh3::word_product(value, xxh3::read_le64(shared_secret + 8 * (stripe + lane)));
  }
  // Sum over the four threads of each lane (t, t ^ 8, t ^ 16, t ^ 24).
  for (int mask = xxh3::kLanes; mask < kWarp; mask <<= 1) {
    data += __shfl_xor_sync(0xffffffffu, data, mask);
    product += __shfl_xor_sync(0xffffffffu, product, mask);
  }
  // A stripe's data word of lane i goes to lane i ^ 1.
  const unsigned long long swapped = __shfl_xor_sync(0xffffffffu, data, 1);
  if (t < xxh3::kLanes) scratch[lane_slot(batch_piece, t) + block] = product + swapped;
}

// A thread per (piece, lane): the lane's scramble chain, its contributions loaded kPrefetch at a
// time (independent loads ahead of the dependent chain); then the piece's first thread runs the
// tail with all 8 lanes, or the short path.
__global__ void finish_pieces_kernel(const std::uint8_t* bytes, std::uint64_t size,
                                     std::uint64_t first_piece, std::uint64_t pieces,
                                     xxh3::Secret secret, const std::uint64_t* scratch,
                                     std::uint64_t* piece_digests) {
  constexpr std::uint64_t kPrefetch = 32;
  __shared__ std::uint8_t shared_secret[xxh3::kSecretBytes];
  __shared__ std::uint64_t lanes[kFinishThreads];
  load_secret(secret, shared_secret);
  const std::uint64_t batch_piece =
      (static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / xxh3::kLanes;
  const unsigned lane = threadIdx.x % xxh3::kLanes;
  const bool active = batch_piece < pieces;
  const std::uint64_t piece = first_piece + batch_piece;
  const std::uint64_t length = active ? piece_length(size, piece) : 0;
  std::uint64_t initial[xxh3::kLanes];
  xxh3::init_lanes(initial);
  std::uint64_t acc = 0;
#pragma unroll
  for (unsigned i = 0; i < xxh3::kLanes; ++i)
    if (i == lane) acc = initial[i];
  if (length > xxh3::kMidsizeMax) {
    const std::uint64_t key = xxh3::scramble_key(shared_secret, lane);
    const std::uint64_t* contributions = scratch + lane_slot(batch_piece, lane);
    const std::uint64_t blocks = xxh3::full_blocks(length);
    std::uint64_t b = 0;
    for (; b + kPrefetch <= blocks; b += kPrefetch) {
      std::uint64_t ahead[kPrefetch];
#pragma unroll
      for (std::uint64_t k = 0; k < kPrefetch; ++k)
        ahead[k] = contributions[b + k];
#pragma unroll
      for (std::uint64_t k = 0; k < kPrefetch; ++k)
        acc = xxh3::chain_lane(acc, ahead[k], key);
    }
    for (; b < blocks; ++b)
      acc = xxh3::chain_lane(acc, contributions[b], key);
  }
  lanes[threadIdx.x] = acc;
  __syncthreads();
  if (!active || lane != 0) return;
  const std::uint8_t* input = bytes + piece * kPieceBytes;
  if (length <= xxh3::kMidsizeMax) {
    piece_digests[piece] = xxh3::hash_short(input, length, shared_secret);
    return;
  }
  std::uint64_t all[xxh3::kLanes];
#pragma unroll
  for (unsigned i = 0; i < xxh3::kLanes; ++i)
    all[i] = lanes[threadIdx.x + i];
  piece_digests[piece] = xxh3::finish_long(all, input, length, shared_secret);
}

}  // namespace

void enqueue_piece_digests(const void* device_bytes, std::uint64_t size, std::uint64_t first_piece,
                           std::uint64_t pieces, std::uint64_t* scratch,
                           std::uint64_t* piece_digests, void* stream) {
  if (pieces == 0) return;
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  const auto* bytes = static_cast<const std::uint8_t*>(device_bytes);
  // Slots up to the last piece's full blocks (none for a single piece of at most 240 bytes).
  const std::uint64_t last_begin = (first_piece + pieces - 1) * kPieceBytes;
  const std::uint64_t last_length = std::min<std::uint64_t>(kPieceBytes, size - last_begin);
  const std::uint64_t last_blocks =
      last_length <= xxh3::kMidsizeMax ? 0 : xxh3::full_blocks(last_length);
  const std::uint64_t warps = (pieces - 1) * kDigestBlocksPerPiece + last_blocks;
  const auto contribution_blocks =
      static_cast<unsigned>((warps * kWarp + kContributionThreads - 1) / kContributionThreads);
  if (warps == 0) {
    // Nothing to accumulate: every piece takes a short path.
  } else if (reinterpret_cast<std::uintptr_t>(bytes) % alignof(std::uint64_t) == 0) {
    block_contributions_kernel<true><<<contribution_blocks, kContributionThreads, 0, cuda_stream>>>(
        bytes, size, first_piece, pieces, xxh3::kDefaultSecret, scratch);
  } else {
    block_contributions_kernel<false>
        <<<contribution_blocks, kContributionThreads, 0, cuda_stream>>>(
            bytes, size, first_piece, pieces, xxh3::kDefaultSecret, scratch);
  }
  check(static_cast<int>(cudaGetLastError()), "block_contributions_kernel");
  const auto finish_blocks =
      static_cast<unsigned>((pieces * xxh3::kLanes + kFinishThreads - 1) / kFinishThreads);
  finish_pieces_kernel<<<finish_blocks, kFinishThreads, 0, cuda_stream>>>(
      bytes, size, first_piece, pieces, xxh3::kDefaultSecret, scratch, piece_digests);
  check(static_cast<int>(cudaGetLastError()), "finish_pieces_kernel");
}

}  // namespace pulseloco::kernels::cuda::detail
