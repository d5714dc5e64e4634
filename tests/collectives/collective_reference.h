// Independent expectations for the collectives' tests (shared by the in-process tests and the
// multi-process worker).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace pulseloco::testing {

// Values whose fp32 sum depends on the order of the additions.
inline float order_sensitive_value(int rank, std::size_t index) {
  static constexpr float kValues[] = {1e8F, 1.0F, -1e8F, 3.1415927F, 1e-3F, -7.5e7F, 0.3F, 2.5e7F};
  const std::size_t pick = (index * 7 + static_cast<std::size_t>(rank) * 3 + index / 5) % 8;
  return kValues[pick] * (1.0F + static_cast<float>(index % 13) * 0.125F);
}

// The documented order: segment g is summed from rank g around the ring.
inline std::vector<float> reference_allreduce(const std::vector<std::vector<float>>& inputs) {
  const int n = static_cast<int>(inputs.size());
  const std::size_t count = inputs[0].size();
  std::vector<float> out(count);
  const std::size_t base = count / static_cast<std::size_t>(n);
  const std::size_t remainder = count % static_cast<std::size_t>(n);
  for (int g = 0; g < n; ++g) {
    const auto gi = static_cast<std::size_t>(g);
    const std::size_t begin = gi * base + std::min(gi, remainder);
    const std::size_t end = begin + base + (gi < remainder ? 1 : 0);
    for (std::size_t e = begin; e < end; ++e) {
      float sum = inputs[gi][e];
      for (int k = 1; k < n; ++k)
        sum = sum + inputs[static_cast<std::size_t>((g + k) % n)][e];
      out[e] = sum;
    }
  }
  return out;
}

// x_0 + x_1 + ... in plain rank order: the order-matching double's native all-reduce.
inline std::vector<float> plain_rank_order_sum(const std::vector<std::vector<float>>& inputs) {
  std::vector<float> sum = inputs[0];
  for (std::size_t rank = 1; rank < inputs.size(); ++rank)
    for (std::size_t e = 0; e < sum.size(); ++e)
      sum[e] = sum[e] + inputs[rank][e];
  return sum;
}

}  // namespace pulseloco::testing
