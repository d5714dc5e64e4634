// Internal: a PULSELoCo window (docs/algorithm.md steps 1-9), in four phases with explicit data
// between them:
//
//   gate_and_encode   state (read only) -> OutgoingMessage      steps 1-5 without the state change
//   exchange          OutgoingMessage -> ReceivedMessages      sparse all-gather, or owner
//                                                               reduction (exchange_choice.h);
//                                                               every message validated
//   vote              ReceivedMessages -> (commit or throw)    every rank accepted every message
//   apply             ReceivedMessages -> state                steps 5 (state change), 7, 8, 9
//
// Nothing before apply changes the state, so a window that fails before it can be run again.
// The message carries the window it was gated for, and the exchange validates against that, so
// a phase need not run at the same boundary as the one before it.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <vector>

#include <pulseloco/base/thread_pool.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/engine/exchange_choice.h>
#include <pulseloco/engine/scratch_pool.h>
#include <pulseloco/engine/window_strategy.h>

namespace pulseloco::engine_detail {

// What one window's exchange brought: every rank's message, in rank order (all-gather), or
// every owner's reduced range, in rank order (owner reduction).
struct ReceivedMessages {
  std::uint64_t window = 0;
  Exchange kind = Exchange::allgather;
  int world = 1;
  std::vector<std::vector<std::byte>> bytes;
  // Views of the codec messages in `bytes`, each validated completely (applying them cannot
  // fail); empty when `invalid` is set. Reduction: owner o's view holds the frames of chunks
  // [owner_bounds[o], owner_bounds[o + 1]), with the ranks' summed values.
  std::vector<codec::MessageView> views;
  std::vector<std::size_t> owner_bounds;  // reduction only (exchange_choice.h)
  std::uint64_t group_entries = 0;        // reduction: the ranks' entries, summed over owners
  std::exception_ptr invalid;             // the first invalid message's ProtocolError
  std::uint64_t received_bytes = 0;       // payload bytes from the other ranks
};

class PulseWindow final : public WindowStrategy {
 public:
  PulseWindow(ReplicatedState& state, const EngineOptions& options, ThreadPool& pool)
      : state_(state), options_(options), pool_(pool) {}

  [[nodiscard]] Mode mode() const noexcept override { return Mode::pulse; }
  void run(const AttachedGroup& group, WindowReport& report) override;

  // The message of window `window` (gated against the state's start point), coded as `coding`
  // says: the run's codec options, but plain entries for an overlapped context run
  // (encode_against_global codes them).
  [[nodiscard]] OutgoingMessage gate_and_encode(int rank, std::uint64_t window,
                                                const codec::EncodeOptions& coding);
  // `message` (its frames in any encoding but context) coded again with the run's codec options
  // against θ_g as it is now: an overlapped window's message is decoded only after this
  // boundary's outer step, so the context encoding codes it against the θ_g of that step, not
  // the start point it was gated against.
  [[nodiscard]] OutgoingMessage encode_against_global(const OutgoingMessage& message);
  // Throws (state unchanged) when the collective fails; an invalid message is recorded in the
  // result instead, so that the vote can tell the other ranks. The kind is chosen as
  // exchange_choice.h says (the same on every rank).
  [[nodiscard]] ReceivedMessages exchange(const AttachedGroup& group, const OutgoingMessage& mine);
  // Records that this rank accepted the window (when it did) and runs the commit vote.
  void vote(const AttachedGroup& group, const ReceivedMessages& received);
  // Steps 7-9; `commit_residual` false: the residual was committed when the window was gated
  // (overlapped windows), so only the outer step runs and θ_l is reset. Returns how much the
  // ranks' sets overlapped.
  SetOverlap apply(const ReceivedMessages& received, bool commit_residual = true);

 private:
  // Gate output of one chunk.
  struct GateScratch {
    std::vector<std::uint32_t> offsets;
    std::vector<float> values;
    std::vector<float> context;  // θ_g of a device state's chunk (the context encoding)
  };
  // Decoded entries of one chunk: every rank's when applying or reducing, one rank's when
  // validating; an owner's sums when reducing.
  struct DecodeScratch {
    std::vector<std::uint32_t> offsets;
    std::vector<float> values;
    std::vector<std::uint32_t> sum_offsets;
    std::vector<float> sum_values;
    std::vector<float> sum;
    codec::DecodeScratch decode;
    std::vector<float> context;  // θ_g of a device state's chunk (the context encoding)
    std::vector<std::uint8_t>
        seen;  // elements of the chunk counted in the union (all 0 between uses)
    // The context encoding of an owner's sums: how many ranks' entries each element's sum
    // took (saturating at 255; all 0 between uses), and per sum its count.
    std::vector<std::uint8_t> contributions;
    std::vector<std::uint8_t> sum_multiples;
  };

  // The automatic choice's inputs: every rank's entry count and union sketch, all-gathered.
  struct UnionEstimate {
    std::uint64_t group_entries = 0;
    std::uint64_t union_entries = 0;
  };
  [[nodiscard]] UnionEstimate estimate_union(const AttachedGroup& group,
                                             const OutgoingMessage& mine);
  [[nodiscard]] ReceivedMessages allgather(const AttachedGroup& group, const OutgoingMessage& mine);
  [[nodiscard]] ReceivedMessages reduce_by_owners(const AttachedGroup& group,
                                                  const OutgoingMessage& mine);
  // Owner reduction: this rank's sums of chunks [first, first + count) from the ranks' pieces
  // (validated views), as frames, and the ranks' entries there; `finite` is false (and the
  // frames incomplete) when a sum is not finite.
  struct ReducedRange {
    std::vector<std::vector<std::byte>> frames;
    std::uint64_t group_entries = 0;
    bool finite = true;
  };
  [[nodiscard]] ReducedRange reduce_range(std::span<const codec::MessageView> pieces,
                                          std::size_t first, std::size_t count);
  // The context encoding's residue multiples of an owner's sums (codec::FrameEntries): per
  // sum, how many of `per_rank`'s entries it took; empty for the other encodings.
  [[nodiscard]] std::span<const std::uint8_t> residue_multiples(
      std::span<const kernels::SparseEntries> per_rank, std::span<const std::uint32_t> sum_offsets,
      std::uint64_t length, DecodeScratch& scratch) const;

  // The message of `rank` for `window`: a header, then `frames` (moved out), one per chunk, of
  // `fired` entries each.
  [[nodiscard]] OutgoingMessage assemble_message(int rank, std::uint64_t window,
                                                 codec::Encoding encoding,
                                                 std::vector<std::vector<std::byte>>& frames,
                                                 std::span<const std::uint64_t> fired) const;
  [[nodiscard]] codec::DecodeLimits decode_limits() const;
  // The chunk's θ_g for the context encoding (global_context), empty for the others.
  [[nodiscard]] std::span<const float> context_of(const ChunkRef& chunk,
                                                  std::vector<float>& staging) const;
  // Parses rank `sender`'s message and checks everything about it, frame by frame, so that the
  // apply phase cannot fail: a message of chunks [first_chunk, first_chunk + chunk_count), by
  // default every chunk. Throws ProtocolError naming the sender.
  [[nodiscard]] codec::MessageView validate_message(
      int rank, int sender, std::uint64_t window, std::span<const std::byte> bytes,
      std::size_t first_chunk = 0, std::optional<std::size_t> chunk_count = std::nullopt);

  ReplicatedState& state_;
  const EngineOptions& options_;
  ThreadPool& pool_;
  ScratchPool<GateScratch> gate_scratch_;
  ScratchPool<DecodeScratch> apply_scratch_;
  ScratchPool<DecodeScratch> validate_scratch_;
};

// The chunk's θ_g on the host, against which context frames are coded: the state's own buffer
// when it is in host memory, else staged into `staging` (device state).
[[nodiscard]] std::span<const float> global_context(const ReplicatedState& state,
                                                    const ChunkRef& chunk,
                                                    std::vector<float>& staging);

}  // namespace pulseloco::engine_detail
