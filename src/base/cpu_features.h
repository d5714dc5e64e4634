// Runtime CPU dispatch. Kernels ship a portable implementation and an AVX2 one (compiled with
// function-level target attributes, so the library itself needs no -mavx2) and pick one here.
#pragma once

#include <string_view>

namespace pulseloco {

enum class CpuIsa { portable, avx2 };

[[nodiscard]] std::string_view cpu_isa_name(CpuIsa isa) noexcept;

// What this CPU supports (AVX2 and FMA both required for CpuIsa::avx2).
[[nodiscard]] CpuIsa detected_cpu_isa() noexcept;

// What kernels use: the detected ISA, lowered by PULSELOCO_CPU_ISA=portable when set (for
// testing the fallback on an AVX2 machine). Asking for an ISA the CPU lacks is ignored with a
// warning.
[[nodiscard]] CpuIsa active_cpu_isa() noexcept;

[[nodiscard]] inline bool cpu_has_avx2() noexcept {
  return detected_cpu_isa() == CpuIsa::avx2;
}

}  // namespace pulseloco
