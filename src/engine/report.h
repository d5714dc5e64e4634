// What one window did: returned to the caller and logged.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include <pulseloco/base/digest.h>
#include <pulseloco/engine/options.h>

namespace pulseloco {

// Seconds spent in each phase of the window on this rank.
struct PhaseSeconds {
  double gate = 0;      // gate + encode (pulse) or pseudo-gradient (diloco)
  double exchange = 0;  // the collective(s), decoding that overlaps them included; overlapped:
                        // the time this boundary waited for the window in flight and the vote
  // `exchange` split in two: exchange_wait, the part spent waiting for the slowest peer to join
  // the exchange (until the last peer's header had arrived: collectives::header_wait_seconds;
  // overlapped, the part of the boundary before the window in flight's last peer had joined),
  // and exchange_transfer, the rest (exchange = exchange_wait + exchange_transfer).
  double exchange_wait = 0;
  double exchange_transfer = 0;
  // Overlapped windows: how long the applied window's exchange ran in the background.
  double exchange_in_flight = 0;
  double apply = 0;    // decode + aggregate + residual commit + outer step + reset
  double verify = 0;   // digests of θ_g and m, and their all-gather
  double publish = 0;  // publishing θ_g (rank 0, EngineOptions::publish_dir)
  double total = 0;
};

struct WindowReport {
  // Index of the window whose inner steps just ended (0-based). A blocking window commits at its
  // own boundary; an overlapped one sends its message now and is applied at the next boundary.
  std::uint64_t window = 0;
  // The window whose outer step this boundary applied: `window` when blocking, the window before
  // it when overlapped, none at the first overlapped boundary (nothing was in flight) or when
  // the window in flight was dropped (docs/algorithm.md, "Overlapped windows").
  std::optional<std::uint64_t> applied_window;
  Mode mode = Mode::pulse;
  Overlap overlap = Overlap::blocking;
  int rank = 0;
  int world_size = 1;
  std::uint64_t generation = 0;        // the group's generation (elastic runs; 0 otherwise)
  std::vector<std::string> members;    // worker ids in rank order (elastic runs; else empty)
  std::uint64_t parameters = 0;        // elements in the model
  std::uint64_t steps_per_window = 0;  // H
  std::string state_location;          // where this rank keeps θ_g, m, e: "host", "cuda:0"

  std::uint64_t entries_sent = 0;   // elements this rank sent (pulse), parameters otherwise
  double density = 0;               // entries_sent / parameters
  std::uint64_t payload_bytes = 0;  // this rank's own contribution (encoded message)
  // Payload bytes received from the other ranks in the exchange: pulse, their messages; diloco
  // and ddp, what the transport received in the all-reduces (about 2 (R-1)/R of the dense
  // payload in a ring, the collectives' small headers and notices included).
  std::uint64_t received_bytes = 0;
  // How the window applied at this boundary was exchanged: "allgather" or "reduction" (mode
  // pulse, EngineOptions::exchange), "allreduce" (modes diloco and ddp); empty when none was
  // applied.
  std::string exchange;
  // How much the ranks' sets overlap in the window applied at this boundary (none applied: 0):
  // elements that at least one rank sent, and the sum over ranks of the elements each sent.
  // union_ratio = union_entries / group_entries: 1 when the sets are disjoint, 1 / world_size
  // when they are identical (always so in modes diloco and ddp, which send every element).
  std::uint64_t union_entries = 0;
  std::uint64_t group_entries = 0;
  double union_ratio = 0;
  std::uint64_t wire_bytes_sent = 0;      // what the transport put on the wire, framing included
  std::uint64_t wire_bytes_received = 0;  // what the transport took off the wire
  std::uint64_t diloco_bytes = 0;         // dense DiLoCo payload: 4 B x parameters
  std::uint64_t ddp_bytes = 0;            // dense DDP payload: H x 4 B x parameters

  PhaseSeconds seconds;
  Digest digest = 0;                 // combined digest of θ_g and m (ddp: of the weights)
  std::vector<Digest> rank_digests;  // every rank's digest (empty if verification is off)
  // True in every report: digests that differ raise DivergenceError instead (or nothing was
  // compared: verification off, rank_digests empty).
  bool replicas_identical = true;

  // Publishing θ_g (EngineOptions::publish_dir; rank 0 only, docs/patches.md). Set when this
  // window's θ_g was published, as this version:
  std::optional<std::uint64_t> published_version;
  std::uint64_t patch_changed = 0;        // elements whose bf16 value changed (0: first version)
  double patch_density = 0;               // patch_changed / parameters
  std::uint64_t patch_delta_bytes = 0;    // the TRL delta file (0: none, the first version)
  std::uint64_t patch_compact_bytes = 0;  // the compact patch file
  std::uint64_t patch_anchor_bytes = 0;   // the anchor file; 0 when no anchor was written
  std::string publish_error;              // why a due version was not published; else empty
};

[[nodiscard]] nlohmann::json to_json(const WindowReport& report);

// One log line: "window 3 pulse: density 1.23%, 1.2 MB sent (DiLoCo 40.0 MB = 33.3x), ...";
// the report of complete_in_flight() says that it completed the window in flight instead.
[[nodiscard]] std::string summary_line(const WindowReport& report);

// The report is complete_in_flight()'s: an overlapped boundary that applied the window it is
// numbered by, with no inner steps ended and nothing sent.
[[nodiscard]] bool completes_in_flight(const WindowReport& report);

// ", published v3: patch 1.234% (12.0 kB delta, 4.1 kB compact), anchor 2.00 MB" when the
// window was published (", published v1: anchor 2.00 MB" for the first version), ", NOT
// PUBLISHED: <why>" when it was due and failed, else "".
[[nodiscard]] std::string publish_summary(const WindowReport& report);

// "1.23 MB", "512 B": decimal units, as network links are rated.
[[nodiscard]] std::string human_bytes(double bytes);

}  // namespace pulseloco
