// xxh3-64 digests (libxxhash). Used to verify that replicas hold identical state (buffer
// digests) and to checksum wire frames (digest_bytes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace pulseloco {

class ThreadPool;

using Digest = std::uint64_t;

[[nodiscard]] Digest digest_bytes(std::span<const std::byte> bytes) noexcept;

template <typename T>
[[nodiscard]] Digest digest_of(std::span<const T> values) noexcept {
  return digest_bytes(std::as_bytes(values));
}

// Incremental xxh3-64: the digest of the concatenation of every update().
class DigestStream {
 public:
  DigestStream();
  ~DigestStream();
  DigestStream(DigestStream&&) noexcept;
  DigestStream& operator=(DigestStream&&) noexcept;
  DigestStream(const DigestStream&) = delete;
  DigestStream& operator=(const DigestStream&) = delete;

  void update(std::span<const std::byte> bytes) noexcept;
  [[nodiscard]] Digest finish() const noexcept;
  void reset() noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Combines per-tensor digests in order: xxh3-64 of their little-endian bytes.
[[nodiscard]] Digest combine_digests(std::span<const Digest> digests) noexcept;

// The digest of one state buffer (docs/algorithm.md step 10): xxh3-64 of the little-endian
// concatenation of the xxh3-64 digests of the buffer's consecutive pieces of
// kBufferDigestPieceBytes bytes (the last piece shorter). An empty buffer has no pieces: its
// digest is xxh3-64 of no bytes. The pieces make the digest parallel, on CPU cores and on a GPU
// (kernels/cuda), with one value; their size is fixed so that files verify whatever the options.
inline constexpr std::size_t kBufferDigestPieceBytes = std::size_t{4} << 20;
// The definition's name, recorded in the metadata of the files that carry buffer digests.
inline constexpr std::string_view kBufferDigestName = "xxh3-64-pieces-4MiB";

[[nodiscard]] Digest buffer_digest(std::span<const std::byte> bytes);
// The same value, the pieces hashed in parallel on `pool`.
[[nodiscard]] Digest buffer_digest(std::span<const std::byte> bytes, ThreadPool& pool);
// The digest of the piece digests, in order (how buffer_digest ends).
[[nodiscard]] Digest combine_piece_digests(std::span<const Digest> pieces) noexcept;

// buffer_digest of the concatenation of every update(), for buffers read in bounded parts.
class BufferDigestStream {
 public:
  // With a pool, the whole pieces of each update are hashed in parallel on it.
  explicit BufferDigestStream(ThreadPool* pool = nullptr);

  void update(std::span<const std::byte> bytes);
  [[nodiscard]] Digest finish();

 private:
  void hash_pieces(std::span<const std::byte> whole_pieces);

  ThreadPool* pool_;
  std::vector<Digest> pieces_;
  std::vector<std::byte> partial_;  // the bytes of the piece not yet complete
};

// 16 lowercase hex digits.
[[nodiscard]] std::string digest_hex(Digest digest);

}  // namespace pulseloco
