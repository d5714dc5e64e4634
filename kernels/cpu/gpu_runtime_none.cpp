// Build of kernels/gpu_runtime.h without CUDA: there are no devices.
#include <pulseloco/kernels/gpu_runtime.h>

#include <fmt/format.h>

namespace pulseloco::kernels {

int cuda_device_count() noexcept {
  return 0;
}

std::string cuda_device_description(int ordinal) {
  return fmt::format("no CUDA device {} (pulseloco was built without CUDA)", ordinal);
}

std::string cuda_runtime_version() {
  return "none";
}

}  // namespace pulseloco::kernels
