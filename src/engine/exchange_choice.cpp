#include <pulseloco/engine/exchange_choice.h>

#include <fmt/format.h>

#include <algorithm>
#include <bit>

#include <pulseloco/base/errors.h>

namespace pulseloco::engine_detail {

namespace {

// SplitMix64's finaliser: a fixed, well-mixed hash of an element id.
std::uint64_t mix64(std::uint64_t x) noexcept {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

constexpr int kRankBits = 64 - UnionSketch::kPrecision;

// Integer arithmetic wide enough for the estimate and the choice (GCC and Clang; __extension__
// keeps -Wpedantic quiet about the type).
__extension__ typedef unsigned __int128 Wide;

}  // namespace

void UnionSketch::add(std::uint64_t chunk, std::uint32_t offset) noexcept {
  const std::uint64_t hash = mix64((chunk << 32) | offset);
  const auto index = static_cast<std::size_t>(hash >> kRankBits);
  const std::uint64_t rest = hash << kPrecision;  // the low kRankBits bits, at the top
  // The position of the first 1 bit (1-based), kRankBits + 1 when there is none.
  const auto rank =
      static_cast<std::uint8_t>(rest == 0 ? kRankBits + 1 : std::countl_zero(rest) + 1);
  registers_[index] = std::max(registers_[index], rank);
}

void UnionSketch::merge(const UnionSketch& other) noexcept {
  for (std::size_t i = 0; i < kRegisters; ++i)
    registers_[i] = std::max(registers_[i], other.registers_[i]);
}

std::uint64_t UnionSketch::estimate() const noexcept {
  // E = α m² / Σ 2^-register, in fixed point: Σ 2^(64 - register) fits in 128 bits (registers
  // are at most 55). α for m = 1024 is 0.7213 / (1 + 1.079 / m) = 0.72054...; as a fraction
  // 72054 / 100000.
  Wide inverse_sum = 0;
  for (const std::uint8_t r : registers_)
    inverse_sum += static_cast<Wide>(1) << (64 - r);
  constexpr Wide m = kRegisters;
  const Wide numerator = (static_cast<Wide>(72054) * m * m) << 64;  // α m² 2^64 · 100000
  // Below about 5m/2 distinct ids this raw estimate runs high (HyperLogLog's small-range bias),
  // which can only tip the choice towards the all-gather; such sets are latency-bound anyway.
  return static_cast<std::uint64_t>(numerator / (inverse_sum * 100000));
}

UnionSketch UnionSketch::from_bytes(std::span<const std::uint8_t, kBytes> bytes) {
  UnionSketch sketch;
  for (std::size_t i = 0; i < kRegisters; ++i) {
    if (bytes[i] > kRankBits + 1) {
      throw ProtocolError(
          fmt::format("union sketch register {} holds {}, above {}", i, bytes[i], kRankBits + 1));
    }
    sketch.registers_[i] = bytes[i];
  }
  return sketch;
}

bool choice_needs_sketches(Exchange option, int world, bool ordered_transport) {
  return option == Exchange::automatic && world >= 3 && !ordered_transport;
}

Exchange choose_exchange(const ExchangeInputs& inputs) {
  if (inputs.option == Exchange::reduction && inputs.ordered_transport) {
    throw InvalidArgument(
        "exchange=reduction needs a transport that matches messages by tag (TCP, MPI, "
        "in-process); this one matches them by order (NCCL, a group through a bucket)");
  }
  if (inputs.option != Exchange::automatic) return inputs.option;
  if (!choice_needs_sketches(inputs.option, inputs.world, inputs.ordered_transport) ||
      inputs.group_entries < kLatencyBoundEntries) {
    return Exchange::allgather;
  }
  const Wide world = static_cast<Wide>(inputs.world);
  const Wide group = inputs.group_entries;
  const Wide union_entries = inputs.union_estimate;
  return 10 * (group + world * union_entries) < 9 * world * group ? Exchange::reduction
                                                                  : Exchange::allgather;
}

std::vector<std::size_t> owner_bounds(std::span<const ChunkRef> chunks, int world) {
  std::uint64_t total = 0;
  for (const ChunkRef& chunk : chunks)
    total += chunk.length;
  const auto owners = static_cast<std::uint64_t>(std::max(world, 1));
  std::vector<std::size_t> bounds{0};
  // Owner o's range ends before the first chunk whose middle lies at or past (o + 1)/R of the
  // elements.
  std::size_t c = 0;
  std::uint64_t before = 0;  // elements of chunks [0, c)
  for (std::uint64_t o = 1; o < owners; ++o) {
    const std::uint64_t target = total * o / owners;
    while (c < chunks.size() && before + chunks[c].length / 2 < target) {
      before += chunks[c].length;
      ++c;
    }
    bounds.push_back(c);
  }
  bounds.push_back(chunks.size());
  return bounds;
}

}  // namespace pulseloco::engine_detail
