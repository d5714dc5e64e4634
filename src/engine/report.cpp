#include <pulseloco/engine/report.h>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

namespace pulseloco {

nlohmann::json to_json(const WindowReport& report) {
  nlohmann::json digests = nlohmann::json::array();
  for (Digest d : report.rank_digests)
    digests.push_back(digest_hex(d));
  return nlohmann::json{
      {"window", report.window},
      {"applied_window",
       report.applied_window ? nlohmann::json(*report.applied_window) : nlohmann::json(nullptr)},
      {"mode", mode_name(report.mode)},
      {"overlap", overlap_name(report.overlap)},
      {"rank", report.rank},
      {"world_size", report.world_size},
      {"generation", report.generation},
      {"members", report.members},
      {"parameters", report.parameters},
      {"steps_per_window", report.steps_per_window},
      {"state_location", report.state_location},
      {"entries", report.entries_sent},
      {"density", report.density},
      {"payload_bytes", report.payload_bytes},
      {"received_bytes", report.received_bytes},
      {"exchange", report.exchange},
      {"union_entries", report.union_entries},
      {"group_entries", report.group_entries},
      {"union_ratio", report.union_ratio},
      {"wire_bytes_sent", report.wire_bytes_sent},
      {"wire_bytes_received", report.wire_bytes_received},
      {"diloco_bytes", report.diloco_bytes},
      {"ddp_bytes", report.ddp_bytes},
      {"seconds",
       {{"gate", report.seconds.gate},
        {"exchange", report.seconds.exchange},
        {"exchange_wait", report.seconds.exchange_wait},
        {"exchange_transfer", report.seconds.exchange_transfer},
        {"exchange_in_flight", report.seconds.exchange_in_flight},
        {"apply", report.seconds.apply},
        {"verify", report.seconds.verify},
        {"publish", report.seconds.publish},
        {"total", report.seconds.total}}},
      {"digest", digest_hex(report.digest)},
      {"digests", digests},
      {"replicas_identical", report.replicas_identical},
      {"published_version", report.published_version ? nlohmann::json(*report.published_version)
                                                     : nlohmann::json(nullptr)},
      {"patch_changed", report.patch_changed},
      {"patch_density", report.patch_density},
      {"patch_delta_bytes", report.patch_delta_bytes},
      {"patch_compact_bytes", report.patch_compact_bytes},
      {"patch_anchor_bytes", report.patch_anchor_bytes},
      {"patch_anchor", report.patch_anchor_bytes > 0},
      {"publish_error", report.publish_error},
  };
}

std::string publish_summary(const WindowReport& report) {
  if (!report.publish_error.empty()) return ", NOT PUBLISHED: " + report.publish_error;
  if (!report.published_version) return {};
  const auto bytes = [](std::uint64_t n) { return human_bytes(static_cast<double>(n)); };
  std::string line = fmt::format(", published v{}", *report.published_version);
  if (report.patch_delta_bytes > 0) {
    line += fmt::format(": patch {:.3f}% ({} delta, {} compact)", 100.0 * report.patch_density,
                        bytes(report.patch_delta_bytes), bytes(report.patch_compact_bytes));
  }
  if (report.patch_anchor_bytes > 0) {
    line += fmt::format("{} anchor {}", report.patch_delta_bytes > 0 ? "," : ":",
                        bytes(report.patch_anchor_bytes));
  }
  return line;
}

bool completes_in_flight(const WindowReport& report) {
  // Any other overlapped boundary applies the window before the one whose steps end there.
  return report.overlap != Overlap::blocking && report.applied_window &&
         *report.applied_window == report.window;
}

std::string human_bytes(double bytes) {
  if (bytes < 1e3) return fmt::format("{:.0f} B", bytes);
  if (bytes < 1e6) return fmt::format("{:.1f} kB", bytes / 1e3);
  if (bytes < 1e9) return fmt::format("{:.2f} MB", bytes / 1e6);
  return fmt::format("{:.2f} GB", bytes / 1e9);
}

namespace {

// ", reduction of union 2.900% (0.35 of the ranks' entries)": the exchange and how much the ranks'
// sets overlap (pulse windows that applied something), else "".
std::string union_summary(const WindowReport& report) {
  if (report.mode != Mode::pulse || report.group_entries == 0) return {};
  const double parameters = static_cast<double>(report.parameters);
  return fmt::format(
      ", union {:.3f}% ({:.2f} of the ranks' entries)",
      parameters > 0 ? 100.0 * static_cast<double>(report.union_entries) / parameters : 0.0,
      report.union_ratio);
}

// ", overlap delayed: applied window 3 (in flight 0.812 s)" for overlapped windows, else "".
std::string overlap_summary(const WindowReport& report) {
  if (report.overlap == Overlap::blocking) return {};
  if (!report.applied_window) {
    return fmt::format(", overlap {}: nothing applied", overlap_name(report.overlap));
  }
  return fmt::format(", overlap {}: applied window {} (in flight {:.3f} s)",
                     overlap_name(report.overlap), *report.applied_window,
                     report.seconds.exchange_in_flight);
}

}  // namespace

std::string summary_line(const WindowReport& report) {
  if (completes_in_flight(report)) {
    // complete_in_flight(): no inner steps ended and nothing was sent; the boundary applied the
    // window whose exchange ran during the steps before it.
    return fmt::format(
        "window {} {}: completed in flight (overlap {}): outer step applied, nothing sent, {:.3f} "
        "s (finishing the exchange {:.3f} = wait {:.3f} + transfer {:.3f}, apply {:.3f}, verify "
        "{:.3f}; in flight {:.3f} s), digest {}{}{}",
        report.window, mode_name(report.mode), overlap_name(report.overlap), report.seconds.total,
        report.seconds.exchange, report.seconds.exchange_wait, report.seconds.exchange_transfer,
        report.seconds.apply, report.seconds.verify, report.seconds.exchange_in_flight,
        digest_hex(report.digest), report.replicas_identical ? "" : " REPLICAS DIFFER",
        publish_summary(report));
  }
  const double payload = static_cast<double>(report.payload_bytes);
  const double vs_diloco = payload > 0 ? static_cast<double>(report.diloco_bytes) / payload : 0;
  const double vs_ddp = payload > 0 ? static_cast<double>(report.ddp_bytes) / payload : 0;
  return fmt::format(
      "window {} {}: density {:.3f}%, payload {} (DiLoCo {} = {:.1f}x, DDP {} = {:.1f}x), "
      "received {}{}, wire {} out / {} in, {:.3f} s (gate {:.3f}, exchange {:.3f} = wait {:.3f} + "
      "transfer {:.3f}, apply {:.3f}, verify {:.3f}), digest {}{}{}{}{}",
      report.window, mode_name(report.mode), 100.0 * report.density, human_bytes(payload),
      human_bytes(static_cast<double>(report.diloco_bytes)), vs_diloco,
      human_bytes(static_cast<double>(report.ddp_bytes)), vs_ddp,
      human_bytes(static_cast<double>(report.received_bytes)), union_summary(report),
      human_bytes(static_cast<double>(report.wire_bytes_sent)),
      human_bytes(static_cast<double>(report.wire_bytes_received)), report.seconds.total,
      report.seconds.gate, report.seconds.exchange, report.seconds.exchange_wait,
      report.seconds.exchange_transfer, report.seconds.apply, report.seconds.verify,
      digest_hex(report.digest), overlap_summary(report),
      report.replicas_identical ? "" : " REPLICAS DIFFER",
      report.generation > 0
          ? fmt::format(", group generation {} of {} workers", report.generation, report.world_size)
          : std::string(),
      publish_summary(report));
}

}  // namespace pulseloco
