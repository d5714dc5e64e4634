#include "base/digest.h"

#include <xxhash.h>

#include <fmt/format.h>

#include <bit>
#include <vector>

namespace pulseloco {

static_assert(std::endian::native == std::endian::little,
              "pulseloco's wire and file formats assume a little-endian host");

Digest digest_bytes(std::span<const std::byte> bytes) noexcept {
  return XXH3_64bits(bytes.data(), bytes.size());
}

struct DigestStream::State {
  State() : state(XXH3_createState()) {
    if (state == nullptr) throw std::bad_alloc();
    XXH3_64bits_reset(state);
  }
  ~State() { XXH3_freeState(state); }
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  XXH3_state_t* state;
};

DigestStream::DigestStream() : state_(std::make_unique<State>()) {}
DigestStream::~DigestStream() = default;
DigestStream::DigestStream(DigestStream&&) noexcept = default;
DigestStream& DigestStream::operator=(DigestStream&&) noexcept = default;

void DigestStream::update(std::span<const std::byte> bytes) noexcept {
  XXH3_64bits_update(state_->state, bytes.data(), bytes.size());
}

Digest DigestStream::finish() const noexcept {
  return XXH3_64bits_digest(state_->state);
}

void DigestStream::reset() noexcept {
  XXH3_64bits_reset(state_->state);
}

Digest combine_digests(std::span<const Digest> digests) noexcept {
  return digest_bytes(std::as_bytes(digests));
}

std::string digest_hex(Digest digest) {
  return fmt::format("{:016x}", digest);
}

}  // namespace pulseloco
