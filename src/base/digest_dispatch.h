// Internal: the two implementations behind digest.h, exposed for tests that compare them.
// libxxhash's baseline build is always available; the AVX2 one only when
// PULSELOCO_DIGEST_HAS_AVX2 is 1 (an x86-64 GCC/Clang build), and may only be called on a CPU
// with AVX2 (cpu_has_avx2()).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pulseloco::detail {

[[nodiscard]] std::uint64_t xxh3_baseline(const void* data, std::size_t size) noexcept;

#if PULSELOCO_DIGEST_HAS_AVX2
[[nodiscard]] std::uint64_t xxh3_avx2(const void* data, std::size_t size) noexcept;
// Streaming state: an XXH3_state_t of the AVX2 build (null when allocation failed).
[[nodiscard]] void* xxh3_avx2_stream_create() noexcept;
void xxh3_avx2_stream_free(void* state) noexcept;
void xxh3_avx2_stream_reset(void* state) noexcept;
void xxh3_avx2_stream_update(void* state, const void* data, std::size_t size) noexcept;
[[nodiscard]] std::uint64_t xxh3_avx2_stream_digest(const void* state) noexcept;
#endif

// Whether digest_bytes() and DigestStream use the AVX2 build in this process (decided once:
// the CPU has AVX2 and FMA and PULSELOCO_CPU_ISA does not ask for the portable path).
[[nodiscard]] bool digest_uses_avx2() noexcept;

}  // namespace pulseloco::detail
