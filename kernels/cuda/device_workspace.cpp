// Host side of the CUDA kernels: the workspace, CUDA error reporting and the orchestration of
// buffer digests of device memory (kernels in digest_cuda.cu). Compiled by the C++ compiler against
// the CUDA runtime API.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <span>
#include <utility>

#include <pulseloco/base/errors.h>
#include <pulseloco/kernels/cuda/cuda_internal.h>
#include <pulseloco/kernels/cuda/window_kernels_cuda.h>

namespace pulseloco::kernels::cuda {
namespace detail {

// The CUB storage the gate needs for `count` elements (window_kernels_cuda.cu).
std::size_t gate_temp_bytes(std::uint64_t count);

void throw_cuda_error(int status, const char* what) {
  const auto error = static_cast<cudaError_t>(status);
  throw IoError(fmt::format("CUDA {} failed: {} ({})", what, cudaGetErrorName(error),
                            cudaGetErrorString(error)));
}

void check_current_device(const DeviceWorkspace& workspace, const char* kernel) {
  int current = 0;
  check(cudaGetDevice(&current), "cudaGetDevice");
  if (current != workspace.device()) {
    throw InvalidArgument(
        fmt::format("{}: the workspace belongs to CUDA device {} but device {} "
                    "is current",
                    kernel, workspace.device(), current));
  }
}

}  // namespace detail

using detail::check;

DeviceWorkspace::Impl::~Impl() {
  // Nothing can be reported from a destructor; the calls fail only when the context is gone.
  cudaFree(temp);
  cudaFree(device_counters);
  cudaFreeHost(host_counters);
  cudaFree(digest_scratch);
  cudaFree(piece_digests);
  cudaFreeHost(host_piece_digests);
}

void DeviceWorkspace::Impl::reserve_temp(std::size_t bytes) {
  if (bytes <= temp_bytes) return;
  // cudaFree waits for the device to be idle, so no enqueued kernel still uses the old storage.
  check(cudaFree(temp), "cudaFree (CUB temporary storage)");
  temp = nullptr;
  temp_bytes = 0;
  check(cudaMalloc(&temp, bytes), "cudaMalloc (CUB temporary storage)");
  temp_bytes = bytes;
}

void DeviceWorkspace::Impl::reserve_digest(std::uint64_t pieces) {
  const std::uint64_t batch = std::min(pieces, detail::kDigestBatchPieces);
  if (batch > digest_scratch_pieces) {
    // cudaFree waits for the device to be idle, so no enqueued kernel still uses the old scratch.
    check(cudaFree(digest_scratch), "cudaFree (digest scratch)");
    digest_scratch = nullptr;
    digest_scratch_pieces = 0;
    check(cudaMalloc(reinterpret_cast<void**>(&digest_scratch),
                     batch * detail::kDigestScratchWordsPerPiece * sizeof(std::uint64_t)),
          "cudaMalloc (digest scratch)");
    digest_scratch_pieces = batch;
  }
  if (pieces > piece_digest_capacity) {
    check(cudaFree(piece_digests), "cudaFree (piece digests)");
    piece_digests = nullptr;
    check(cudaFreeHost(host_piece_digests), "cudaFreeHost (piece digests)");
    host_piece_digests = nullptr;
    piece_digest_capacity = 0;
    check(cudaMalloc(reinterpret_cast<void**>(&piece_digests), pieces * sizeof(std::uint64_t)),
          "cudaMalloc (piece digests)");
    check(cudaMallocHost(reinterpret_cast<void**>(&host_piece_digests),
                         pieces * sizeof(std::uint64_t)),
          "cudaMallocHost (piece digests)");
    piece_digest_capacity = pieces;
  }
}

DeviceWorkspace::DeviceWorkspace(std::uint64_t expected_chunk_elements)
    : impl_(std::make_unique<Impl>()) {
  if (expected_chunk_elements > kMaxChunkElements) {
    throw InvalidArgument(fmt::format("DeviceWorkspace: {} elements exceed the chunk maximum {}",
                                      expected_chunk_elements, kMaxChunkElements));
  }
  check(cudaGetDevice(&impl_->device), "cudaGetDevice");
  check(
      cudaMalloc(reinterpret_cast<void**>(&impl_->device_counters), sizeof(detail::DeviceCounters)),
      "cudaMalloc (counters)");
  check(cudaMallocHost(reinterpret_cast<void**>(&impl_->host_counters),
                       sizeof(detail::DeviceCounters)),
        "cudaMallocHost (counters)");
  if (expected_chunk_elements > 0)
    impl_->reserve_temp(detail::gate_temp_bytes(expected_chunk_elements));
}

DeviceWorkspace::~DeviceWorkspace() = default;
DeviceWorkspace::DeviceWorkspace(DeviceWorkspace&&) noexcept = default;
DeviceWorkspace& DeviceWorkspace::operator=(DeviceWorkspace&&) noexcept = default;

int DeviceWorkspace::device() const noexcept {
  return impl_->device;
}

std::vector<Digest> buffer_digests(std::span<const DeviceRange> buffers, DeviceWorkspace& workspace,
                                   void* stream) {
  detail::check_current_device(workspace, "buffer_digests");
  // Each buffer's pieces take consecutive places among the pieces of all of them.
  std::vector<std::uint64_t> first_piece(buffers.size() + 1, 0);
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    const DeviceRange& buffer = buffers[b];
    if (buffer.bytes > 0 && buffer.data == nullptr) {
      throw InvalidArgument("buffer_digests: null device pointer");
    }
    first_piece[b + 1] =
        first_piece[b] + (buffer.bytes + kBufferDigestPieceBytes - 1) / kBufferDigestPieceBytes;
  }
  const std::uint64_t pieces = first_piece.back();
  std::vector<Digest> digests;
  digests.reserve(buffers.size());
  if (pieces == 0) {
    digests.assign(buffers.size(), combine_piece_digests({}));
    return digests;
  }
  DeviceWorkspace::Impl& impl = workspace.impl();
  impl.reserve_digest(pieces);
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    const std::uint64_t count = first_piece[b + 1] - first_piece[b];
    for (std::uint64_t first = 0; first < count; first += detail::kDigestBatchPieces) {
      detail::enqueue_piece_digests(buffers[b].data, buffers[b].bytes, first,
                                    std::min(detail::kDigestBatchPieces, count - first),
                                    impl.digest_scratch, impl.piece_digests + first_piece[b],
                                    stream);
    }
  }
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  check(cudaMemcpyAsync(impl.host_piece_digests, impl.piece_digests, pieces * sizeof(std::uint64_t),
                        cudaMemcpyDeviceToHost, cuda_stream),
        "cudaMemcpyAsync (piece digests)");
  check(cudaStreamSynchronize(cuda_stream), "cudaStreamSynchronize (buffer digests)");
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    digests.push_back(combine_piece_digests(std::span<const Digest>(
        impl.host_piece_digests + first_piece[b], first_piece[b + 1] - first_piece[b])));
  }
  return digests;
}

Digest buffer_digest(const void* device_bytes, std::size_t bytes, DeviceWorkspace& workspace,
                     void* stream) {
  const DeviceRange buffer{device_bytes, bytes};
  return buffer_digests(std::span(&buffer, 1), workspace, stream).front();
}

Digest state_digest(std::span<const float> global, std::span<const float> momentum,
                    DeviceWorkspace& workspace, void* stream) {
  const DeviceRange buffers[2] = {{global.data(), global.size_bytes()},
                                  {momentum.data(), momentum.size_bytes()}};
  return combine_digests(buffer_digests(buffers, workspace, stream));
}

}  // namespace pulseloco::kernels::cuda
