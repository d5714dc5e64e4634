// Internal: named points of a window at which the engine tells an observer where it is: the seam
// through which tests make a process fail at a chosen point (engine/fault_injection.h). A
// production engine has no observer; each point then costs one test of a null pointer.
#pragma once

#include <cstdint>
#include <string_view>

#include <pulseloco/transport/transport.h>

namespace pulseloco {

// The points, in the order a window reaches them:
//   gate       before the gate (pulse) or the pseudo-gradient (diloco): nothing sent yet
//   exchange   during the exchange: pulse, whenever another rank's message has arrived (this
//              rank's own message is on its way); diloco, after each all-reduce bucket
//   aggregate  after every rank voted to commit, before this rank applies the window
// Mode ddp has none. Outside windows:
//   checkpoint while this rank writes a checkpoint: its residual file's temporary file exists,
//              none of its files is renamed yet (the window is the checkpoint's)
enum class WindowPhase : std::uint8_t { gate, exchange, aggregate, checkpoint };

[[nodiscard]] constexpr std::string_view window_phase_name(WindowPhase phase) noexcept {
  switch (phase) {
    case WindowPhase::gate:
      return "gate";
    case WindowPhase::exchange:
      return "exchange";
    case WindowPhase::aggregate:
      return "aggregate";
    case WindowPhase::checkpoint:
      return "checkpoint";
  }
  return "?";
}

// Where this rank is: the point, the window being run, and the group it runs in.
struct PhasePoint {
  WindowPhase phase;
  std::uint64_t window;
  int rank;
  std::string_view worker;  // this member's worker id in an elastic run, "" otherwise
  transport::Transport& transport;
};

class PhaseObserver {
 public:
  virtual ~PhaseObserver() = default;
  // Called on the thread that runs the window, once per point reached (exchange: per message
  // or bucket). May throw; the window then fails as if its exchange had.
  virtual void at(const PhasePoint& point) = 0;
};

}  // namespace pulseloco
