// Internals shared by the CUDA kernels (window_kernels_cuda.cu, compiled by nvcc) and their host
// side (device_workspace.cpp, compiled by the C++ compiler). No CUDA headers here: the status
// is passed as an int (a cudaError_t).
#pragma once

#include <cstddef>
#include <cstdint>

#include <pulseloco/kernels/cuda/window_kernels_cuda.h>

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
  // The pinned staging buffers for digests, allocated on first use.
  void ensure_staging();

  int device = 0;
  void* temp = nullptr;
  std::size_t temp_bytes = 0;
  detail::DeviceCounters* device_counters = nullptr;
  detail::DeviceCounters* host_counters = nullptr;                    // pinned
  static constexpr std::size_t kStagingBytes = std::size_t{8} << 20;  // per buffer, two buffers
  void* staging[2] = {nullptr, nullptr};
  void* staging_ready[2] = {nullptr, nullptr};  // cudaEvent_t of the copy into each buffer
};

}  // namespace pulseloco::kernels::cuda
