// Where memory lives: the CPU or a CUDA device. Shared by tensor views and by transports, whose
// buffers may have to live on a GPU (Transport::buffer_device()).
#pragma once

#include <cstdint>
#include <string_view>

namespace pulseloco {

enum class DeviceKind : std::uint8_t { cpu = 0, cuda = 1 };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  [[nodiscard]] constexpr bool is_cpu() const noexcept { return kind == DeviceKind::cpu; }
  [[nodiscard]] constexpr bool is_cuda() const noexcept { return kind == DeviceKind::cuda; }
  friend constexpr bool operator==(const Device&, const Device&) = default;
};

[[nodiscard]] std::string_view device_kind_name(DeviceKind kind) noexcept;

}  // namespace pulseloco
