// Internal: which exchange a PULSELoCo window runs, and which chunks each rank owns in an owner
// reduction (docs/algorithm.md, "Exchange kinds").
//
// The automatic choice needs the size of the union of the ranks' sets before anything moves.
// Every rank sketches its own set (UnionSketch: a HyperLogLog of the element ids it fired), the
// sketches are all-gathered (a few KiB), and every rank merges the same bytes and decides with
// the same integer arithmetic: so every rank makes the same choice without another word.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <pulseloco/engine/layout.h>
#include <pulseloco/engine/options.h>

namespace pulseloco::engine_detail {

// A HyperLogLog sketch of a set of element ids, with 2^10 registers (a standard error of about
// 3% on the union's size). Its estimate is integer arithmetic only, so it is the same on every
// machine.
class UnionSketch {
 public:
  static constexpr int kPrecision = 10;
  static constexpr std::size_t kRegisters = std::size_t{1} << kPrecision;
  static constexpr std::size_t kBytes = kRegisters;

  // Element `offset` of chunk `chunk`.
  void add(std::uint64_t chunk, std::uint32_t offset) noexcept;
  void merge(const UnionSketch& other) noexcept;
  // The estimated number of distinct ids added (to the sketch and to those merged into it).
  [[nodiscard]] std::uint64_t estimate() const noexcept;

  [[nodiscard]] std::span<const std::uint8_t, kBytes> bytes() const noexcept { return registers_; }
  // Throws ProtocolError unless every register is a possible value.
  [[nodiscard]] static UnionSketch from_bytes(std::span<const std::uint8_t, kBytes> bytes);

 private:
  std::array<std::uint8_t, kRegisters> registers_{};
};

// What the choice for one window sees, the same on every rank.
struct ExchangeInputs {
  Exchange option = Exchange::automatic;  // EngineOptions::exchange
  int world = 1;
  bool ordered_transport = false;    // Transport::matches_by_order (NCCL): no all-to-all
  std::uint64_t group_entries = 0;   // Σ over ranks of the entries each sends (exact)
  std::uint64_t union_estimate = 0;  // the merged sketches' estimate of the union
};

// Below this many entries in all (a few hundred KiB of messages) an exchange is latency-bound,
// and the all-gather's one collective beats the reduction's two.
inline constexpr std::uint64_t kLatencyBoundEntries = std::uint64_t{1} << 15;

// Whether the automatic choice needs the ranks' sketches (it decides without them otherwise).
[[nodiscard]] bool choice_needs_sketches(Exchange option, int world, bool ordered_transport);

// allgather or reduction (never automatic). Automatic: the all-gather with fewer than 3 ranks
// (the reduction cannot move less there), over an order-matching transport, below
// kLatencyBoundEntries; otherwise the reduction when its estimated traffic per rank,
// (R - 1)/R (G/R + U) entries, is below 0.9 of the all-gather's, (R - 1) G/R: that is when
// 10 (G + R U) < 9 R G. The margin pays for its extra round and its summed values, which
// compress a little worse. Throws InvalidArgument when `reduction` is forced over an
// order-matching transport.
[[nodiscard]] Exchange choose_exchange(const ExchangeInputs& inputs);

// The first chunk each of `world` owners reduces, and the end: owner o reduces chunks
// [bounds[o], bounds[o + 1]). Contiguous ranges of near-equal element counts (whole chunks: an
// owner may get none when the model has fewer chunks than ranks).
[[nodiscard]] std::vector<std::size_t> owner_bounds(std::span<const ChunkRef> chunks, int world);

}  // namespace pulseloco::engine_detail
