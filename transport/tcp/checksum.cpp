#include "transport/tcp/checksum.h"

#include <isa-l/crc64.h>

namespace pulseloco::transport::tcp {

FrameChecksum frame_checksum(std::span<const std::byte> bytes) noexcept {
  return crc64_ecma_refl(0, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
}

void FrameChecksumStream::update(std::span<const std::byte> bytes) noexcept {
  crc_ = crc64_ecma_refl(crc_, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
}

}  // namespace pulseloco::transport::tcp
