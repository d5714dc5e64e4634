// Non-owning views of tensors as the core sees them: raw buffers with a dtype and a device.
// Only the libtorch adapter knows about torch::Tensor; everything else works on these.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include <pulseloco/base/device.h>

namespace pulseloco {

// Wire/file codes are fixed: they appear in checkpoints and messages.
enum class DType : std::uint8_t { float32 = 0, bfloat16 = 1 };

[[nodiscard]] constexpr std::size_t dtype_size(DType dtype) noexcept {
  return dtype == DType::float32 ? 4 : 2;
}
[[nodiscard]] std::string_view dtype_name(DType dtype) noexcept;

// A mutable view of a contiguous tensor.
struct TensorView {
  void* data = nullptr;
  std::uint64_t numel = 0;
  DType dtype = DType::float32;
  Device device{};

  [[nodiscard]] std::size_t bytes() const noexcept { return numel * dtype_size(dtype); }
};

// A read-only view of a contiguous tensor.
struct ConstTensorView {
  const void* data = nullptr;
  std::uint64_t numel = 0;
  DType dtype = DType::float32;
  Device device{};

  ConstTensorView() = default;
  ConstTensorView(const void* d, std::uint64_t n, DType t, Device dev)
      : data(d), numel(n), dtype(t), device(dev) {}
  // NOLINTNEXTLINE(google-explicit-constructor): a mutable view is usable as a const one.
  ConstTensorView(const TensorView& view)
      : data(view.data), numel(view.numel), dtype(view.dtype), device(view.device) {}

  [[nodiscard]] std::size_t bytes() const noexcept { return numel * dtype_size(dtype); }
};

}  // namespace pulseloco
