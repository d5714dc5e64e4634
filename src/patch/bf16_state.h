// A model's weights as a receiver of patches holds them: bf16 bits per tensor, in name order,
// and the one digest that names such a state in every patch file and manifest.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/digest.h>

namespace pulseloco::patch {

// Tensors of at most this many elements: indices are int32 in the TRL files.
inline constexpr std::uint64_t kMaxTensorElements = (std::uint64_t{1} << 31) - 1;

struct Bf16Tensor {
  std::string name;
  std::vector<std::uint64_t> shape;
  std::vector<std::uint16_t> bits;  // row-major bf16 bit patterns
};

// The state's digest: combine_digests (base/digest.h) of every tensor's buffer_digest of its
// bf16 bytes, tensors in name order. Its definition's name, recorded in the files:
inline constexpr std::string_view kStateDigestName = "xxh3-64-pieces-4MiB-per-tensor-by-name";

class Bf16State {
 public:
  Bf16State() = default;
  // Sorts the tensors by name. Throws InvalidArgument for duplicate or empty names, a shape
  // whose product is not the element count, or a tensor above kMaxTensorElements.
  explicit Bf16State(std::vector<Bf16Tensor> tensors);

  [[nodiscard]] const std::vector<Bf16Tensor>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] std::vector<Bf16Tensor>& tensors() noexcept { return tensors_; }
  // nullptr when there is no tensor of that name.
  [[nodiscard]] Bf16Tensor* find(std::string_view name) noexcept;
  [[nodiscard]] const Bf16Tensor* find(std::string_view name) const noexcept;
  [[nodiscard]] bool empty() const noexcept { return tensors_.empty(); }
  [[nodiscard]] std::uint64_t total_elements() const noexcept;
  [[nodiscard]] Digest digest() const;

 private:
  std::vector<Bf16Tensor> tensors_;
};

// The product of a shape; throws InvalidArgument naming the tensor when it exceeds
// kMaxTensorElements.
[[nodiscard]] std::uint64_t shape_elements(std::string_view tensor,
                                           const std::vector<std::uint64_t>& shape);

}  // namespace pulseloco::patch
