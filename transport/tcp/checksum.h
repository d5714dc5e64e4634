// The TCP transport's frame checksums: CRC-64/XZ (the ECMA-182 polynomial, reflected, initial
// value and final XOR all ones; check value 0x995dc9bbdf1939fa for "123456789"), computed by
// Intel's ISA-L (libisal), which picks its fastest implementation for the CPU at run time
// (carry-less multiply folding: PCLMULQDQ, or VPCLMULQDQ with AVX-512).
//
// Why a CRC and not the xxh3 of the replica digests (src/base/digest.h): a frame checksum has
// one job, catching bytes damaged between two ranks, and a CRC is the code built for it (every
// burst of up to 64 flipped bits is caught, not only with probability 1 - 2^-64). It is also
// about twice as fast: every payload byte is checksummed on both sides, and on the 2-core
// development machine xxh3 (AVX2) was the largest user-space cost of the 1 MiB all-gather
// (docs/benchmarks.md, "Frame checksums"; bench/bench_digest.cpp measures both).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace pulseloco::transport::tcp {

using FrameChecksum = std::uint64_t;

// CRC-64/XZ of `bytes`.
[[nodiscard]] FrameChecksum frame_checksum(std::span<const std::byte> bytes) noexcept;

// CRC-64/XZ of the concatenation of every update() since construction or reset().
class FrameChecksumStream {
 public:
  void update(std::span<const std::byte> bytes) noexcept;
  [[nodiscard]] FrameChecksum finish() const noexcept { return crc_; }
  void reset() noexcept { crc_ = 0; }

 private:
  // ISA-L's CRC functions take the CRC so far (0 for none) and return the CRC with the next
  // bytes appended: the initial value and the final XOR are applied inside.
  FrameChecksum crc_ = 0;
};

}  // namespace pulseloco::transport::tcp
