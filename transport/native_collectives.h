// Collectives that a backend can run natively, with its own tuned algorithms (MPI). The
// collectives library asks for them with native_collectives(transport) and uses its own
// point-to-point algorithms when it gets null, or when a call returns false.
//
// Only byte-exact collectives are offered: every rank ends up with exactly the bytes some rank
// contributed. A native all-reduce is deliberately missing: MPI does not promise that every rank
// gets bit-identical sums, which pulseloco requires.
//
// Rules (as in MPI): every rank calls the same native collectives in the same order with
// matching sizes; they may interleave with point-to-point traffic. A call that misses its
// deadline throws TimeoutError and leaves the transport unusable (the operation cannot be
// cancelled), so the caller should abort.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

class NativeCollectives {
 public:
  virtual ~NativeCollectives() = default;

  // Variable-size all-gather: rank r contributes counts[r] bytes (mine.size() == counts[rank]);
  // `out` (the sum of counts) receives every contribution in rank order, packed. Returns false,
  // doing nothing, when the sizes are beyond what the backend can express in one call.
  [[nodiscard]] virtual bool allgatherv(std::span<const std::byte> mine,
                                        std::span<const std::uint64_t> counts,
                                        std::span<std::byte> out, Deadline deadline) = 0;
  // Copies root's `data` into every rank's `data` (same size everywhere).
  virtual void broadcast(int root, std::span<std::byte> data, Deadline deadline) = 0;
  virtual void barrier(Deadline deadline) = 0;
};

// The transport's native collectives, or null when its backend has none.
[[nodiscard]] inline NativeCollectives* native_collectives(Transport& transport) noexcept {
  return dynamic_cast<NativeCollectives*>(&transport);
}

}  // namespace pulseloco::transport
