// Internal: a PULSELoCo window (docs/algorithm.md steps 1-9), in four phases with explicit data
// between them:
//
//   gate_and_encode   state (read only) -> OutgoingMessage      steps 1-5 without the state change
//   exchange          OutgoingMessage -> ReceivedMessages      sparse all-gather, every message
//                                                               validated as it arrives
//   vote              ReceivedMessages -> (commit or throw)    every rank accepted every message
//   apply             ReceivedMessages -> state                steps 5 (state change), 7, 8, 9
//
// Nothing before apply changes the state, so a window that fails before it can be run again.
// The message carries the window it was gated for, and the exchange validates against that, so
// a phase need not run at the same boundary as the one before it.
#pragma once

#include <cstdint>
#include <exception>
#include <vector>

#include <pulseloco/base/thread_pool.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/engine/scratch_pool.h>
#include <pulseloco/engine/window_strategy.h>

namespace pulseloco::engine_detail {

// Every rank's message of one window, in rank order.
struct ReceivedMessages {
  std::uint64_t window = 0;
  std::vector<std::vector<std::byte>> bytes;
  // Views into `bytes`, each validated completely (applying them cannot fail); empty when
  // `invalid` is set.
  std::vector<codec::MessageView> views;
  std::exception_ptr invalid;        // the first invalid message's ProtocolError
  std::uint64_t received_bytes = 0;  // the other ranks' messages
};

class PulseWindow final : public WindowStrategy {
 public:
  PulseWindow(ReplicatedState& state, const EngineOptions& options, ThreadPool& pool)
      : state_(state), options_(options), pool_(pool) {}

  [[nodiscard]] Mode mode() const noexcept override { return Mode::pulse; }
  void run(const AttachedGroup& group, WindowReport& report) override;

  // The message of window `window` (gated against the state's start point).
  [[nodiscard]] OutgoingMessage gate_and_encode(int rank, std::uint64_t window);
  // Throws (state unchanged) when the collective fails; an invalid message is recorded in the
  // result instead, so that the vote can tell the other ranks.
  [[nodiscard]] ReceivedMessages exchange(const AttachedGroup& group, const OutgoingMessage& mine);
  // Records that this rank accepted the window (when it did) and runs the commit vote.
  void vote(const AttachedGroup& group, const ReceivedMessages& received);
  // Steps 7-9; `commit_residual` false: the residual was committed when the window was gated
  // (overlapped windows), so only the outer step runs and θ_l is reset.
  void apply(const ReceivedMessages& received, bool commit_residual = true);

 private:
  // Gate output of one chunk.
  struct GateScratch {
    std::vector<std::uint32_t> offsets;
    std::vector<float> values;
  };
  // Decoded entries of one chunk: every rank's when applying, one rank's when validating.
  struct DecodeScratch {
    std::vector<std::uint32_t> offsets;
    std::vector<float> values;
    codec::DecodeScratch decode;
  };

  // Parses rank `sender`'s message and checks everything about it, frame by frame, so that the
  // apply phase cannot fail. Throws ProtocolError naming the sender.
  [[nodiscard]] codec::MessageView validate_message(int rank, int sender, std::uint64_t window,
                                                    std::span<const std::byte> bytes);

  ReplicatedState& state_;
  const EngineOptions& options_;
  ThreadPool& pool_;
  ScratchPool<GateScratch> gate_scratch_;
  ScratchPool<DecodeScratch> apply_scratch_;
  ScratchPool<DecodeScratch> validate_scratch_;
};

}  // namespace pulseloco::engine_detail
