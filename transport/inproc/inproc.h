// The in-process backend: the ranks of a group are threads of one process, and messages move
// between them through shared queues. It is a complete Transport (tagged messages, deadlines,
// abort, statistics) and emulates a wire: every message carries an xxh3-64 checksum that the
// receiving side verifies, and a closed or killed rank looks to its peers like a closed
// connection. Used by the collectives' and the engine's tests, by simulations (`pulseloco
// replay`) and by the fault harness, which injects faults through a FaultInjector:
//
//   auto faults = std::make_shared<transport::inproc::FaultInjector>();
//   faults->set_hook([](const MessageEvent& m) {  // SIGKILL rank 2 at its third message
//     return m.from == 2 && m.index == 2 ? FaultAction::kill_sender : FaultAction::deliver;
//   });
//   auto transports = transport::inproc::make_group(4, {.faults = faults});
//
// Semantics beyond the Transport contract (tests rely on them):
// - isend is eager: the message is copied into the receiver's posted buffer, or into a queue
//   when no receive is posted yet, before isend returns, so sends complete at once (except
//   those of a stalled rank, which never complete).
// - Destroying an unfinished Request withdraws it: its buffer may be reused at once.
// - Request::wait throwing TimeoutError leaves the operation pending; it can be waited on again.
// - lost_peers(): a killed or aborted rank is lost to every open rank at the moment it closes,
//   and a peer whose frame failed its checksum to the rank that dropped its connection; a
//   transport destroyed without an abort closes in an orderly way and is not lost.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include <pulseloco/transport/transport.h>

namespace pulseloco::transport::inproc {

// What happens to one message a rank sends.
enum class FaultAction : std::uint8_t {
  deliver,       // goes through unchanged
  drop,          // is lost on the way; the sender sees its send complete
  corrupt,       // arrives with one byte flipped (the receiver's checksum check catches it)
  stall_sender,  // the sender freezes before this message, as under SIGSTOP: from now on
                 // nothing it sends is delivered, nothing it receives completes, and its peers
                 // see an open but silent connection
  kill_sender,   // the sender dies before this message, as under SIGKILL: its operations fail
                 // and its peers see its connections close
};

[[nodiscard]] std::string_view fault_action_name(FaultAction action) noexcept;

// One message as the fault hook sees it, before it leaves its sender.
struct MessageEvent {
  int from = 0;
  int to = 0;
  Tag tag = 0;
  std::size_t bytes = 0;
  std::uint64_t index = 0;              // messages `from` sent before this one (0-based)
  std::uint64_t bytes_sent_before = 0;  // payload bytes `from` sent before this one
};

// Decides the fate of every message. Runs on the sending thread, outside the group's locks; it
// must not call back into the FaultInjector.
using FaultHook = std::function<FaultAction(const MessageEvent&)>;

// A fault that was injected, and when.
struct InjectedFault {
  Clock::time_point when;
  FaultAction action = FaultAction::deliver;
  int rank = 0;                       // the sender (or the rank killed or stalled directly)
  std::optional<MessageEvent> event;  // the message concerned (none for kill()/stall())
};

// Injects faults into one group. Thread-safe; shared between a test and the group
// (InprocOptions::faults). Every fault except `deliver` is recorded with its time, so tests can
// bound how long the survivors took to notice.
class FaultInjector {
 public:
  FaultInjector();
  ~FaultInjector();
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;

  // Consulted for every message sent from now on (replaces any previous hook).
  void set_hook(FaultHook hook);
  // Kill or stall `rank` now (as SIGKILL or SIGSTOP would). Throws InvalidArgument when the
  // injector is not attached to a group or `rank` is out of range.
  void kill(int rank);
  void stall(int rank);

  // Every fault injected so far, in order.
  [[nodiscard]] std::vector<InjectedFault> injected() const;

  struct Impl;  // shared with the group (defined in inproc.cpp)
  [[nodiscard]] const std::shared_ptr<Impl>& impl() const noexcept { return impl_; }

 private:
  std::shared_ptr<Impl> impl_;
};

struct InprocOptions {
  std::shared_ptr<FaultInjector> faults;  // null: every message is delivered unchanged
  // Framing bytes counted per message in TransportStats::wire_bytes_* (an emulated header).
  std::size_t header_bytes = 32;
};

// One Transport per rank (element i has rank i) of a new group of `world_size` ranks. The
// transports may be used from different threads and destroyed in any order; destroying one
// closes it, as a process exiting closes its sockets.
[[nodiscard]] std::vector<std::unique_ptr<Transport>> make_group(int world_size,
                                                                 InprocOptions options = {});

}  // namespace pulseloco::transport::inproc
