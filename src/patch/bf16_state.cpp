#include <pulseloco/patch/bf16_state.h>

#include <fmt/format.h>

#include <algorithm>

#include <pulseloco/base/errors.h>

namespace pulseloco::patch {

std::uint64_t shape_elements(std::string_view tensor, const std::vector<std::uint64_t>& shape) {
  std::uint64_t elements = 1;
  for (const std::uint64_t dimension : shape) {
    if (dimension != 0 && elements > kMaxTensorElements / dimension) {
      throw InvalidArgument(
          fmt::format("tensor has more than {} elements, the most a patch can index",
                      kMaxTensorElements),
          ErrorContext{.tensor = std::string(tensor)});
    }
    elements *= dimension;
  }
  return elements;
}

Bf16State::Bf16State(std::vector<Bf16Tensor> tensors) : tensors_(std::move(tensors)) {
  std::sort(tensors_.begin(), tensors_.end(),
            [](const Bf16Tensor& a, const Bf16Tensor& b) { return a.name < b.name; });
  for (std::size_t i = 0; i < tensors_.size(); ++i) {
    const Bf16Tensor& tensor = tensors_[i];
    if (tensor.name.empty()) throw InvalidArgument("a tensor has an empty name");
    if (i > 0 && tensors_[i - 1].name == tensor.name) {
      throw InvalidArgument("two tensors have the same name", ErrorContext{.tensor = tensor.name});
    }
    if (shape_elements(tensor.name, tensor.shape) != tensor.bits.size()) {
      throw InvalidArgument(
          fmt::format("the shape holds {} elements, the data {}",
                      shape_elements(tensor.name, tensor.shape), tensor.bits.size()),
          ErrorContext{.tensor = tensor.name});
    }
  }
}

Bf16Tensor* Bf16State::find(std::string_view name) noexcept {
  const auto it = std::lower_bound(
      tensors_.begin(), tensors_.end(), name,
      [](const Bf16Tensor& tensor, std::string_view key) { return tensor.name < key; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

const Bf16Tensor* Bf16State::find(std::string_view name) const noexcept {
  return const_cast<Bf16State*>(this)->find(name);
}

std::uint64_t Bf16State::total_elements() const noexcept {
  std::uint64_t total = 0;
  for (const Bf16Tensor& tensor : tensors_)
    total += tensor.bits.size();
  return total;
}

Digest Bf16State::digest() const {
  std::vector<Digest> digests;
  digests.reserve(tensors_.size());
  for (const Bf16Tensor& tensor : tensors_) {
    digests.push_back(buffer_digest(std::as_bytes(std::span(tensor.bits))));
  }
  return combine_digests(digests);
}

}  // namespace pulseloco::patch
