#include <pulseloco/base/device.h>

namespace pulseloco {

std::string_view device_kind_name(DeviceKind kind) noexcept {
  switch (kind) {
    case DeviceKind::cpu:
      return "cpu";
    case DeviceKind::cuda:
      return "cuda";
  }
  return "unknown";
}

}  // namespace pulseloco
