// Objects that carry a MAC over their name and their content (HMAC-SHA256 keyed with a shared
// secret), so that a reader can tell an object written by a holder of the secret under exactly
// this name from anything else: a writer without the secret, or an authentic object copied
// from another name (another window, rank or job).
//
// Layout: the 8 bytes "PLSEALv1", the payload, then 32 bytes of HMAC-SHA256(secret, u64 length
// of the name (little-endian) | name | "PLSEALv1" | payload).
#pragma once

#include <cstddef>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace pulseloco::io {

inline constexpr std::size_t kSealOverhead = 8 + 32;

// The sealed object of `payload` under `name`. IoError when OpenSSL fails; InvalidArgument
// when the secret is empty.
[[nodiscard]] std::vector<std::byte> seal_object(std::string_view secret, std::string_view name,
                                                 std::span<const std::byte> payload);

// The payload of `sealed` when it is an object sealed under `name` with `secret`; nullopt when
// it is not (too short, another format, or a MAC that does not match).
[[nodiscard]] std::optional<std::span<const std::byte>> open_sealed_object(
    std::string_view secret, std::string_view name, std::span<const std::byte> sealed);

}  // namespace pulseloco::io
