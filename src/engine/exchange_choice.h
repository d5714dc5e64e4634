// Internal: which exchange a PULSELoCo window runs, and which chunks each rank owns in an owner
// reduction. Pure functions of what every rank of a group holds alike, so every rank makes the
// same choice without a word to the others (docs/algorithm.md, "Exchange kinds").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <pulseloco/engine/layout.h>
#include <pulseloco/engine/options.h>

namespace pulseloco::engine_detail {

// How much the ranks' sets overlapped in an applied window, and in which group: what the next
// window's choice is made from.
struct ExchangeRecord {
  std::uint64_t window = 0;      // the window applied
  std::uint64_t generation = 0;  // the group it ran in
  int world = 0;
  std::uint64_t union_entries = 0;  // elements sent by at least one rank
  std::uint64_t group_entries = 0;  // the sum over ranks of the elements each sent
};

// What the choice for one window sees.
struct ExchangeInputs {
  Exchange option = Exchange::automatic;  // EngineOptions::exchange
  int world = 1;
  std::uint64_t generation = 0;
  std::uint64_t window = 0;            // the window about to be exchanged
  bool ordered_transport = false;      // Transport::matches_by_order (NCCL): no all-to-all
  std::optional<ExchangeRecord> last;  // the last applied window's record, if kept
};

// The owner reduction is chosen when its estimated traffic per rank, (R - 1)/R (k + U) entries,
// is below this fraction of the all-gather's, (R - 1) k: it moves summed values, which
// compress a little worse, and one round more.
inline constexpr double kReductionAdvantage = 0.9;

// allgather or reduction (never automatic). Automatic: the all-gather with fewer than 3 ranks
// (the reduction cannot move less there), over an order-matching transport, and when no record
// of the window just before in this group exists (the first window, after a regroup, a resume or
// a dropped window); otherwise the reduction when (1 + R·u) / R < kReductionAdvantage, with u =
// union / group entries of that window. Throws InvalidArgument when `reduction` is forced over
// an order-matching transport.
[[nodiscard]] Exchange choose_exchange(const ExchangeInputs& inputs);

// The first chunk each of `world` owners reduces, and the end: owner o reduces chunks
// [bounds[o], bounds[o + 1]). Contiguous ranges of near-equal element counts (whole chunks: an
// owner may get none when the model has fewer chunks than ranks).
[[nodiscard]] std::vector<std::size_t> owner_bounds(std::span<const ChunkRef> chunks, int world);

}  // namespace pulseloco::engine_detail
