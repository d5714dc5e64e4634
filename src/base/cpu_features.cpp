#include <pulseloco/base/cpu_features.h>

#include <cstdlib>
#include <string>

#include <pulseloco/base/log.h>

namespace pulseloco {

std::string_view cpu_isa_name(CpuIsa isa) noexcept {
  switch (isa) {
    case CpuIsa::portable:
      return "portable";
    case CpuIsa::avx2:
      return "avx2";
  }
  return "unknown";
}

CpuIsa detected_cpu_isa() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  static const CpuIsa isa = [] {
    __builtin_cpu_init();
    return (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? CpuIsa::avx2
                                                                             : CpuIsa::portable;
  }();
  return isa;
#else
  return CpuIsa::portable;
#endif
}

CpuIsa active_cpu_isa() noexcept {
  static const CpuIsa isa = [] {
    const CpuIsa detected = detected_cpu_isa();
    const char* requested = std::getenv("PULSELOCO_CPU_ISA");
    if (requested == nullptr || *requested == '\0') return detected;
    const std::string value(requested);
    if (value == "portable") return CpuIsa::portable;
    if (value == "avx2") {
      if (detected == CpuIsa::avx2) return CpuIsa::avx2;
      logger().warn("PULSELOCO_CPU_ISA=avx2 but this CPU lacks AVX2/FMA; using the portable path");
      return detected;
    }
    logger().warn("PULSELOCO_CPU_ISA='{}' is not one of portable, avx2; using {}", value,
                  cpu_isa_name(detected));
    return detected;
  }();
  return isa;
}

}  // namespace pulseloco
