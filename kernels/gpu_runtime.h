// What the CUDA runtime offers this process. Safe to call in every build: without CUDA support
// compiled in, there are simply no devices.
#pragma once

#include <string>

namespace pulseloco::kernels {

// Number of CUDA devices this process can use; 0 when CUDA is not built in, when no driver is
// installed or when no device is visible.
[[nodiscard]] int cuda_device_count() noexcept;

// "NVIDIA H200 (sm_90, 139.8 GiB)" for device `ordinal`, or an explanation why there is none.
[[nodiscard]] std::string cuda_device_description(int ordinal);

// The CUDA runtime version as "13.0", or "none".
[[nodiscard]] std::string cuda_runtime_version();

}  // namespace pulseloco::kernels
