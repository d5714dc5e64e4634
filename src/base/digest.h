// xxh3-64 digests (libxxhash). Used to verify that replicas hold identical state and to
// checksum wire frames.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace pulseloco {

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

// 16 lowercase hex digits.
[[nodiscard]] std::string digest_hex(Digest digest);

}  // namespace pulseloco
