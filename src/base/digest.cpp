#include <pulseloco/base/digest.h>

#include <xxhash.h>

#include <pulseloco/base/cpu_features.h>
#include <pulseloco/base/digest_dispatch.h>
#include <pulseloco/base/thread_pool.h>

#include <fmt/format.h>

#include <algorithm>
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

namespace {

std::size_t piece_count(std::size_t bytes) {
  return (bytes + kBufferDigestPieceBytes - 1) / kBufferDigestPieceBytes;
}

Digest piece_digest(std::span<const std::byte> bytes, std::size_t piece) noexcept {
  const std::size_t begin = piece * kBufferDigestPieceBytes;
  return digest_bytes(
      bytes.subspan(begin, std::min(kBufferDigestPieceBytes, bytes.size() - begin)));
}

}  // namespace

Digest combine_piece_digests(std::span<const Digest> pieces) noexcept {
  return digest_bytes(std::as_bytes(pieces));
}

Digest buffer_digest(std::span<const std::byte> bytes) {
  if (bytes.size() <= kBufferDigestPieceBytes) {
    const Digest piece[1] = {digest_bytes(bytes)};
    return combine_piece_digests(std::span(piece, bytes.empty() ? 0 : 1));
  }
  std::vector<Digest> pieces(piece_count(bytes.size()));
  for (std::size_t p = 0; p < pieces.size(); ++p)
    pieces[p] = piece_digest(bytes, p);
  return combine_piece_digests(pieces);
}

Digest buffer_digest(std::span<const std::byte> bytes, ThreadPool& pool) {
  std::vector<Digest> pieces(piece_count(bytes.size()));
  pool.parallel_for(pieces.size(), [&](std::size_t p) { pieces[p] = piece_digest(bytes, p); });
  return combine_piece_digests(pieces);
}

BufferDigestStream::BufferDigestStream(ThreadPool* pool) : pool_(pool) {}

void BufferDigestStream::hash_pieces(std::span<const std::byte> whole_pieces) {
  const std::size_t first = pieces_.size();
  pieces_.resize(first + whole_pieces.size() / kBufferDigestPieceBytes);
  const auto hash = [&](std::size_t p) { pieces_[first + p] = piece_digest(whole_pieces, p); };
  if (pool_ != nullptr) {
    pool_->parallel_for(pieces_.size() - first, hash);
  } else {
    for (std::size_t p = 0; p < pieces_.size() - first; ++p)
      hash(p);
  }
}

void BufferDigestStream::update(std::span<const std::byte> bytes) {
  if (!partial_.empty()) {
    const std::size_t take = std::min(kBufferDigestPieceBytes - partial_.size(), bytes.size());
    partial_.insert(partial_.end(), bytes.begin(),
                    bytes.begin() + static_cast<std::ptrdiff_t>(take));
    bytes = bytes.subspan(take);
    if (partial_.size() < kBufferDigestPieceBytes) return;
    hash_pieces(partial_);
    partial_.clear();
  }
  const std::size_t whole = bytes.size() - bytes.size() % kBufferDigestPieceBytes;
  hash_pieces(bytes.first(whole));
  partial_.assign(bytes.begin() + static_cast<std::ptrdiff_t>(whole), bytes.end());
}

Digest BufferDigestStream::finish() {
  if (!partial_.empty()) {
    pieces_.push_back(digest_bytes(partial_));
    partial_.clear();
  }
  const Digest digest = combine_piece_digests(pieces_);
  pieces_.clear();
  return digest;
}

std::string digest_hex(Digest digest) {
  return fmt::format("{:016x}", digest);
}

}  // namespace pulseloco
