// Information estimates of a chunk's fired entries against θ_g, for the benchmarks of the
// context encoding (docs/benchmarks.md, "Context-coded messages"): what an ideal coder of each
// model would take, without the cost of describing the model.
#pragma once

#include <cstdint>
#include <span>

#include <nlohmann/json.hpp>

namespace pulseloco::bench {

// Bits of one chunk's entries under five ideal models (no table costs):
//   index_positions: log2 C(length, n), the positions given their count;
//   index_exponent:  Σ over θ_g's exponents e of log2 C(length_e, n_e), the positions given the
//                    count per exponent (what modelling presence with θ_g's exponent can reach);
//   value_context:   the context split's raw bits, D coded by an ideal coder per context
//                    exponent and U per bucket of D (the models of the symbol stream, with ideal
//                    coders), of the values as the context frame codes them (less their
//                    context's bf16 cast residue where the encoder removes it);
//   value_order0:    the same split with one ideal order-0 coder per chunk for D and one for U;
//   value_boundary:  the sign and D of the values as they are, modelled by θ_g's place in its
//                    bf16 cell (context_entropy.cpp);
//   value_raw:       the raw bits of the context split (the sign and the mantissa bits above the
//                    lowest set one), which both value models send as they are.
struct EntropyEstimate {
  double index_positions = 0;
  double index_exponent = 0;
  double value_context = 0;
  double value_order0 = 0;
  double value_boundary = 0;
  double value_raw = 0;

  EntropyEstimate& operator+=(const EntropyEstimate& other) noexcept {
    index_positions += other.index_positions;
    index_exponent += other.index_exponent;
    value_context += other.value_context;
    value_order0 += other.value_order0;
    value_boundary += other.value_boundary;
    value_raw += other.value_raw;
    return *this;
  }
};

// The estimates of one chunk: `offsets` ascending into `context` (θ_g of the chunk), `values`
// the fired values.
[[nodiscard]] EntropyEstimate estimate_entropy(std::span<const std::uint32_t> offsets,
                                               std::span<const float> values,
                                               std::span<const float> context);

// Bytes per entry of each estimate over `entries` entries, as the records print them; the
// message's floor under the context model is index_given_exponent + value_context_model.
[[nodiscard]] nlohmann::json entropy_json(const EntropyEstimate& bits, std::uint64_t entries);

}  // namespace pulseloco::bench
