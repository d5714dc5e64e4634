// Collectives that a backend can run natively, with its own tuned algorithms (MPI). The
// collectives library asks for them with native_collectives(transport) and uses its own
// point-to-point algorithms when it gets null, or when a call returns false.
//
// Byte-exact collectives: every rank ends up with exactly the bytes some rank contributed. The
// float all-reduce is the one exception, offered only by a backend whose library guarantees
// that every rank receives the same bytes (NCCL does, for one communicator; MPI does not
// promise it, so the MPI backend declines it). Its summation order is the library's, not the
// one collectives.h documents for the point-to-point algorithms.
//
// A transport whose messages match by order (Transport::matches_by_order(): NCCL) must offer
// allgather_into, broadcast, barrier and allreduce_sum: the collectives move every payload
// through them there.
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
  // Variable-size all-gather into one buffer per rank: rank r's message (`mine` on rank r) lands
  // in out[r], this rank's own included (the transport copies it, with a device copy when the
  // buffers are device memory). out[r].size() is the same on every rank; mine.size() ==
  // out[rank].size(). Returns false, doing nothing, when the backend does not offer it.
  [[nodiscard]] virtual bool allgather_into(std::span<const std::byte> mine,
                                            std::span<const std::span<std::byte>> out,
                                            Deadline deadline) {
    (void)mine, (void)out, (void)deadline;
    return false;
  }
  // Element-wise fp32 sum of every rank's `input` into every rank's `output` (same length
  // everywhere), the same bytes on every rank, in the library's summation order. Returns false,
  // doing nothing, when the backend does not guarantee identical bytes on every rank.
  [[nodiscard]] virtual bool allreduce_sum(std::span<const float> input, std::span<float> output,
                                           Deadline deadline) {
    (void)input, (void)output, (void)deadline;
    return false;
  }
  // Copies root's `data` into every rank's `data` (same size everywhere).
  virtual void broadcast(int root, std::span<std::byte> data, Deadline deadline) = 0;
  virtual void barrier(Deadline deadline) = 0;
};

// The transport's native collectives, or null when its backend has none.
[[nodiscard]] inline NativeCollectives* native_collectives(Transport& transport) noexcept {
  return dynamic_cast<NativeCollectives*>(&transport);
}

}  // namespace pulseloco::transport
