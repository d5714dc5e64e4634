// xxh3-64 compiled for AVX2 from libxxhash's own header (XXH_INLINE_ALL), for CPUs that have it.
// Debian's libxxhash is built for baseline x86-64 (SSE2); the same algorithm built for AVX2 is
// faster in cache (bench/bench_digest.cpp, docs/benchmarks.md "Digests"), with identical results
// (xxh3 is defined independently of the vector width; tests/base/digest_test.cpp checks it). That
// matters because every TCP frame's payload is checksummed on both sides.
//
// This file alone is compiled with -mavx2, so it includes nothing but xxhash.h (whose functions
// are static here) and exposes plain functions: no inline or template code that the linker could
// share with callers compiled for baseline x86-64.
#include <cstddef>
#include <cstdint>

#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>

#include <pulseloco/base/digest_dispatch.h>

namespace pulseloco::detail {

std::uint64_t xxh3_avx2(const void* data, std::size_t size) noexcept {
  return XXH3_64bits(data, size);
}

void* xxh3_avx2_stream_create() noexcept {
  XXH3_state_t* state = XXH3_createState();
  if (state != nullptr) XXH3_64bits_reset(state);
  return state;
}

void xxh3_avx2_stream_free(void* state) noexcept {
  XXH3_freeState(static_cast<XXH3_state_t*>(state));
}

void xxh3_avx2_stream_reset(void* state) noexcept {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state));
}

void xxh3_avx2_stream_update(void* state, const void* data, std::size_t size) noexcept {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}

std::uint64_t xxh3_avx2_stream_digest(const void* state) noexcept {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}

}  // namespace pulseloco::detail
