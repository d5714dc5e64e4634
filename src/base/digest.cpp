#include <pulseloco/base/digest.h>

#include <xxhash.h>

#include <pulseloco/base/cpu_features.h>
#include <pulseloco/base/digest_dispatch.h>

#include <fmt/format.h>

#include <bit>
#include <vector>

namespace pulseloco {

static_assert(std::endian::native == std::endian::little,
              "pulseloco's wire and file formats assume a little-endian host");

namespace detail {

std::uint64_t xxh3_baseline(const void* data, std::size_t size) noexcept {
  return XXH3_64bits(data, size);
}

bool digest_uses_avx2() noexcept {
#if PULSELOCO_DIGEST_HAS_AVX2
  static const bool use = active_cpu_isa() == CpuIsa::avx2;
  return use;
#else
  return false;
#endif
}

}  // namespace detail

Digest digest_bytes(std::span<const std::byte> bytes) noexcept {
#if PULSELOCO_DIGEST_HAS_AVX2
  if (detail::digest_uses_avx2()) return detail::xxh3_avx2(bytes.data(), bytes.size());
#endif
  return XXH3_64bits(bytes.data(), bytes.size());
}

// One of two states, chosen when the stream is made: libxxhash's, or the AVX2 build's (both
// compute the same xxh3; they must not be mixed within one stream).
struct DigestStream::State {
  State() {
#if PULSELOCO_DIGEST_HAS_AVX2
    if (detail::digest_uses_avx2()) {
      avx2 = detail::xxh3_avx2_stream_create();
      if (avx2 == nullptr) throw std::bad_alloc();
      return;
    }
#endif
    baseline = XXH3_createState();
    if (baseline == nullptr) throw std::bad_alloc();
    XXH3_64bits_reset(baseline);
  }
  ~State() {
#if PULSELOCO_DIGEST_HAS_AVX2
    if (avx2 != nullptr) detail::xxh3_avx2_stream_free(avx2);
#endif
    if (baseline != nullptr) XXH3_freeState(baseline);
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  XXH3_state_t* baseline = nullptr;
  void* avx2 = nullptr;
};

DigestStream::DigestStream() : state_(std::make_unique<State>()) {}
DigestStream::~DigestStream() = default;
DigestStream::DigestStream(DigestStream&&) noexcept = default;
DigestStream& DigestStream::operator=(DigestStream&&) noexcept = default;

void DigestStream::update(std::span<const std::byte> bytes) noexcept {
#if PULSELOCO_DIGEST_HAS_AVX2
  if (state_->avx2 != nullptr) {
    detail::xxh3_avx2_stream_update(state_->avx2, bytes.data(), bytes.size());
    return;
  }
#endif
  XXH3_64bits_update(state_->baseline, bytes.data(), bytes.size());
}

Digest DigestStream::finish() const noexcept {
#if PULSELOCO_DIGEST_HAS_AVX2
  if (state_->avx2 != nullptr) return detail::xxh3_avx2_stream_digest(state_->avx2);
#endif
  return XXH3_64bits_digest(state_->baseline);
}

void DigestStream::reset() noexcept {
#if PULSELOCO_DIGEST_HAS_AVX2
  if (state_->avx2 != nullptr) {
    detail::xxh3_avx2_stream_reset(state_->avx2);
    return;
  }
#endif
  XXH3_64bits_reset(state_->baseline);
}

Digest combine_digests(std::span<const Digest> digests) noexcept {
  return digest_bytes(std::as_bytes(digests));
}

std::string digest_hex(Digest digest) {
  return fmt::format("{:016x}", digest);
}

}  // namespace pulseloco
