// What the CUDA runtime offers this process. Part of pulseloco_kernels_cuda (package component
// `cuda`): only builds with CUDA have it.
#pragma once

#include <string>

namespace pulseloco::kernels {

// Number of CUDA devices this process can use; 0 when no driver is installed or when no device
// is visible.
[[nodiscard]] int cuda_device_count() noexcept;

// "NVIDIA H200 (sm_90, 139.8 GiB)" for device `ordinal`, or an explanation why there is none.
[[nodiscard]] std::string cuda_device_description(int ordinal);

// The CUDA runtime version as "13.0", or "none".
[[nodiscard]] std::string cuda_runtime_version();

}  // namespace pulseloco::kernels
