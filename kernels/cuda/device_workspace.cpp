// Host side of the CUDA kernels: the workspace, CUDA error reporting and digests of device
// memory. Compiled by the C++ compiler against the CUDA runtime API.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
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
  for (int b = 0; b < 2; ++b) {
    cudaFreeHost(staging[b]);
    if (staging_ready[b] != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(staging_ready[b]));
  }
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

void DeviceWorkspace::Impl::ensure_staging() {
  for (int b = 0; b < 2; ++b) {
    if (staging[b] == nullptr)
      check(cudaMallocHost(&staging[b], kStagingBytes), "cudaMallocHost (digest staging)");
    if (staging_ready[b] == nullptr) {
      cudaEvent_t event = nullptr;
      check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
      staging_ready[b] = event;
    }
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

void update_digest(DigestStream& digest, const void* device_bytes, std::size_t bytes,
                   DeviceWorkspace& workspace, void* stream) {
  detail::check_current_device(workspace, "update_digest");
  if (bytes == 0) return;
  if (device_bytes == nullptr) throw InvalidArgument("update_digest: null device pointer");
  DeviceWorkspace::Impl& impl = workspace.impl();
  impl.ensure_staging();
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  const auto* source = static_cast<const std::byte*>(device_bytes);
  constexpr std::size_t kPiece = DeviceWorkspace::Impl::kStagingBytes;
  const std::size_t pieces = (bytes + kPiece - 1) / kPiece;
  const auto piece_bytes = [&](std::size_t k) { return std::min(kPiece, bytes - k * kPiece); };
  const auto enqueue = [&](std::size_t k) {
    check(cudaMemcpyAsync(impl.staging[k % 2], source + k * kPiece, piece_bytes(k),
                          cudaMemcpyDeviceToHost, cuda_stream),
          "cudaMemcpyAsync (digest staging)");
    check(cudaEventRecord(static_cast<cudaEvent_t>(impl.staging_ready[k % 2]), cuda_stream),
          "cudaEventRecord");
  };
  // Double buffering: the copy of piece k + 1 overlaps the hashing of piece k. The buffer it
  // fills held piece k - 1, which was hashed in the previous iteration.
  enqueue(0);
  for (std::size_t k = 0; k < pieces; ++k) {
    if (k + 1 < pieces) enqueue(k + 1);
    check(cudaEventSynchronize(static_cast<cudaEvent_t>(impl.staging_ready[k % 2])),
          "cudaEventSynchronize (digest staging)");
    digest.update(std::span<const std::byte>(static_cast<const std::byte*>(impl.staging[k % 2]),
                                             piece_bytes(k)));
  }
}

Digest state_digest(std::span<const float> global, std::span<const float> momentum,
                    DeviceWorkspace& workspace, void* stream) {
  DigestStream global_digest, momentum_digest;
  update_digest(global_digest, global.data(), global.size_bytes(), workspace, stream);
  update_digest(momentum_digest, momentum.data(), momentum.size_bytes(), workspace, stream);
  const Digest parts[2] = {global_digest.finish(), momentum_digest.finish()};
  return combine_digests(parts);
}

}  // namespace pulseloco::kernels::cuda
