#include <pulseloco/io/sealed_object.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <memory>

#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <pulseloco/base/errors.h>

namespace pulseloco::io {
namespace {

constexpr std::array<char, 8> kMagic = {'P', 'L', 'S', 'E', 'A', 'L', 'v', '1'};
using Mac = std::array<unsigned char, 32>;

struct MacDeleter {
  void operator()(EVP_MAC* mac) const noexcept { EVP_MAC_free(mac); }
  void operator()(EVP_MAC_CTX* context) const noexcept { EVP_MAC_CTX_free(context); }
};

Mac compute_mac(std::string_view secret, std::string_view name,
                std::span<const std::byte> payload) {
  const std::unique_ptr<EVP_MAC, MacDeleter> mac(EVP_MAC_fetch(nullptr, "HMAC", nullptr));
  if (!mac) throw IoError("OpenSSL has no HMAC");
  const std::unique_ptr<EVP_MAC_CTX, MacDeleter> context(EVP_MAC_CTX_new(mac.get()));
  if (!context) throw IoError("OpenSSL could not make an HMAC context");
  char digest[] = "SHA256";
  const OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0),
                               OSSL_PARAM_construct_end()};
  std::array<unsigned char, 8> length{};
  for (std::size_t i = 0; i < length.size(); ++i)
    length[i] = static_cast<unsigned char>(std::uint64_t{name.size()} >> (8 * i));
  Mac out{};
  std::size_t written = 0;
  const auto* key = reinterpret_cast<const unsigned char*>(secret.data());
  if (EVP_MAC_init(context.get(), key, secret.size(), params) != 1 ||
      EVP_MAC_update(context.get(), length.data(), length.size()) != 1 ||
      EVP_MAC_update(context.get(), reinterpret_cast<const unsigned char*>(name.data()),
                     name.size()) != 1 ||
      EVP_MAC_update(context.get(), reinterpret_cast<const unsigned char*>(kMagic.data()),
                     kMagic.size()) != 1 ||
      EVP_MAC_update(context.get(), reinterpret_cast<const unsigned char*>(payload.data()),
                     payload.size()) != 1 ||
      EVP_MAC_final(context.get(), out.data(), &written, out.size()) != 1 || written != out.size())
    throw IoError("OpenSSL HMAC-SHA256 failed");
  return out;
}

}  // namespace

std::vector<std::byte> seal_object(std::string_view secret, std::string_view name,
                                   std::span<const std::byte> payload) {
  if (secret.empty()) throw InvalidArgument("sealing an object needs a secret (it is empty)");
  const Mac mac = compute_mac(secret, name, payload);
  std::vector<std::byte> sealed(kSealOverhead + payload.size());
  const std::span<std::byte> out(sealed);
  std::ranges::copy(std::as_bytes(std::span(kMagic)), out.begin());
  std::ranges::copy(payload, out.subspan(kMagic.size()).begin());
  std::ranges::copy(std::as_bytes(std::span(mac)),
                    out.subspan(kMagic.size() + payload.size()).begin());
  return sealed;
}

std::optional<std::span<const std::byte>> open_sealed_object(std::string_view secret,
                                                             std::string_view name,
                                                             std::span<const std::byte> sealed) {
  if (secret.empty() || sealed.size() < kSealOverhead) return std::nullopt;
  if (std::memcmp(sealed.data(), kMagic.data(), kMagic.size()) != 0) return std::nullopt;
  const auto payload = sealed.subspan(kMagic.size(), sealed.size() - kSealOverhead);
  const Mac expected = compute_mac(secret, name, payload);
  if (CRYPTO_memcmp(expected.data(), sealed.data() + kMagic.size() + payload.size(),
                    expected.size()) != 0)
    return std::nullopt;
  return payload;
}

}  // namespace pulseloco::io
