// Internal: the fault-injection harness of elastic-membership tests: makes this process fail at a
// chosen window and phase, as a real worker would (docs/elastic.md, "Testing failures"). It is a
// phase observer (engine/phase_hooks.h) that the engine installs only when PULSELOCO_FAULT is set.
//
//   PULSELOCO_FAULT="window=3,phase=exchange,action=kill"          (this process)
//   PULSELOCO_FAULT="window=3,phase=gate,action=stall,rank=2"      (only while at rank 2)
//   PULSELOCO_FAULT="window=1,phase=aggregate,action=disconnect,worker=w2"
//   PULSELOCO_FAULT="window=2,phase=checkpoint,action=enospc,rank=1"  (a full disk on rank 1)
//
// phase:  gate       before the gate (pulse) or the pseudo-gradient (diloco): nothing sent yet
//         exchange   in the middle of the exchange: pulse, once the first other rank's message
//                    has arrived (this rank's own message is on its way); diloco, after the first
//                    all-reduce bucket
//         aggregate  after every rank voted to commit, before this rank applies the window
//         checkpoint while this rank writes the checkpoint of that window, before any of its
//                    files is renamed into place
// action: kill       SIGKILL to itself (a crash: its connections close)
//         stall      SIGSTOP to itself (a hung process: its connections stay open); it resumes
//                    on SIGCONT
//         disconnect aborts its transport (a network partition of this worker's data links);
//                    the process carries on and finds its window failed
//         enospc     (phase checkpoint only) this rank's checkpoint write fails as on a full
//                    disk: IoError "No space left on device"
// The fault fires once, on the first attempt of that window. Not for production use: a process
// with PULSELOCO_FAULT set logs a warning at start-up.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include <pulseloco/engine/phase_hooks.h>

namespace pulseloco {

enum class FaultAction : std::uint8_t { kill, stall, disconnect, enospc };

struct FaultPlan {
  std::uint64_t window = 0;
  WindowPhase phase = WindowPhase::gate;
  FaultAction action = FaultAction::kill;
  std::optional<int> rank;  // only while this process has this rank
  std::string worker;       // only while this process is this worker id ("" = any)
  bool fired = false;

  // True when the fault applies at this point.
  [[nodiscard]] bool matches(std::uint64_t at_window, WindowPhase at_phase, int at_rank,
                             std::string_view at_worker) const noexcept;
};

// Parses the PULSELOCO_FAULT syntax above; throws InvalidArgument naming the bad field.
[[nodiscard]] FaultPlan parse_fault_plan(std::string_view text);
// The plan in PULSELOCO_FAULT, if set.
[[nodiscard]] std::optional<FaultPlan> fault_plan_from_environment();

[[nodiscard]] std::string_view fault_action_name(FaultAction action) noexcept;

// Carries out a plan: at the first point it matches, its action.
class FaultInjector final : public PhaseObserver {
 public:
  explicit FaultInjector(FaultPlan plan) : plan_(std::move(plan)) {}
  void at(const PhasePoint& point) override;

 private:
  FaultPlan plan_;
};

// The injector PULSELOCO_FAULT asks for (logging a warning that it is armed), or null when the
// variable is not set. Throws InvalidArgument for an invalid value.
[[nodiscard]] std::unique_ptr<PhaseObserver> fault_injector_from_environment();

}  // namespace pulseloco
