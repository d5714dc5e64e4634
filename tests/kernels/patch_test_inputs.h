// Deterministic inputs for the patch-extraction tests: a bf16 snapshot of LLM-like weights and
// current weights (fp32 or bf16) where a small fraction moved by a few ulps, with edge cases
// among them (+0 against -0, infinities, subnormals, fp32 values exactly at bf16 rounding ties).
// Also the scalar reference the kernels are held to.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/tensor_view.h>
#include <pulseloco/kernels/patch_kernels.h>
#include "kernels/window_test_inputs.h"

namespace pulseloco::testing {

struct PatchInputs {
  std::vector<std::uint16_t> snapshot;
  std::vector<float> current_f32;           // filled for DType::float32
  std::vector<std::uint16_t> current_bf16;  // filled for DType::bfloat16
  DType dtype = DType::float32;

  [[nodiscard]] const void* current() const {
    return dtype == DType::float32 ? static_cast<const void*>(current_f32.data())
                                   : static_cast<const void*>(current_bf16.data());
  }
  [[nodiscard]] std::size_t current_bytes() const { return snapshot.size() * dtype_size(dtype); }
};

inline PatchInputs make_patch_inputs(DType dtype, std::size_t count, std::uint64_t seed) {
  FastRandom random(seed);
  PatchInputs in;
  in.dtype = dtype;
  in.snapshot.resize(count);
  std::vector<float> current(count);
  for (std::size_t i = 0; i < count; ++i) {
    const float base = round_to_bf16(0.02f * random.normal());
    in.snapshot[i] = float_to_bf16_bits(base);
    float value = base;
    const std::uint64_t draw = random.next() % 1000;
    if (draw < 20) {
      value = base * (1.0f + 0.01f * random.uniform());  // a visible update
    } else if (draw < 60) {
      value = base + base * 0x1p-10f * random.uniform();  // below half a bf16 ulp: absorbed
    }
    current[i] = value;
  }
  // Edge cases at fixed places (those beyond `count` are left out).
  const auto place = [&](std::size_t i, std::uint16_t snapshot_bits, float value) {
    if (i >= count) return;
    in.snapshot[i] = snapshot_bits;
    current[i] = value;
  };
  place(0, 0x0000, -0.0f);                                    // +0 -> -0 changes
  place(1, 0x8000, 0.0f);                                     // -0 -> +0 changes
  place(2, 0x0000, 0.0f);                                     // +0 stays
  place(3, 0x7F80, std::numeric_limits<float>::infinity());   // +inf stays
  place(4, 0x3F80, -std::numeric_limits<float>::infinity());  // 1 -> -inf changes
  place(5, 0x3F80, bits_to_float(0x3F808000u));               // tie, rounds to even: stays
  place(6, 0x3F80, bits_to_float(0x3F818000u));               // tie, rounds up: changes
  place(7, 0x0001, bits_to_float(0x00010000u));               // subnormal stays
  place(8, 0x0001, bits_to_float(0x00020000u));               // subnormal changes
  place(9, 0x7F7F, 3.4e38f);                                  // huge, rounds to 0x7F80: changes
  if (dtype == DType::float32) {
    in.current_f32 = std::move(current);
  } else {
    in.current_bf16.resize(count);
    float_to_bf16(current, in.current_bf16);
  }
  return in;
}

// The scalar reference: one element at a time, no compaction tricks.
struct ReferencePatch {
  std::vector<std::uint32_t> offsets;
  std::vector<std::uint16_t> values;
  std::vector<std::uint16_t> previous;
  std::vector<std::uint16_t> snapshot_after;
};

inline ReferencePatch reference_patch(const PatchInputs& in) {
  ReferencePatch out;
  out.snapshot_after = in.snapshot;
  for (std::size_t i = 0; i < in.snapshot.size(); ++i) {
    const std::uint16_t now =
        in.dtype == DType::float32 ? float_to_bf16_bits(in.current_f32[i]) : in.current_bf16[i];
    if (now != in.snapshot[i]) {
      out.offsets.push_back(static_cast<std::uint32_t>(i));
      out.values.push_back(now);
      out.previous.push_back(in.snapshot[i]);
      out.snapshot_after[i] = now;
    }
  }
  return out;
}

// The CPU kernel's entries for elements [begin, begin + count) of `in`, trimmed to their count
// (the snapshot is updated in place).
struct ExtractedPatch {
  kernels::PatchResult result;
  std::vector<std::uint32_t> offsets;
  std::vector<std::uint16_t> values;
  std::vector<std::uint16_t> previous;
};

inline ExtractedPatch extract_on_cpu(PatchInputs& in, std::size_t begin, std::size_t count) {
  ExtractedPatch out{.offsets = std::vector<std::uint32_t>(count),
                     .values = std::vector<std::uint16_t>(count),
                     .previous = std::vector<std::uint16_t>(count)};
  out.result = kernels::extract_patch(
      {.snapshot = in.snapshot.data() + begin,
       .current = static_cast<const std::byte*>(in.current()) + begin * dtype_size(in.dtype),
       .current_dtype = in.dtype,
       .count = count},
      {.offsets = out.offsets.data(),
       .values = out.values.data(),
       .previous = out.previous.data()});
  out.offsets.resize(out.result.changed);
  out.values.resize(out.result.changed);
  out.previous.resize(out.result.changed);
  return out;
}

}  // namespace pulseloco::testing
