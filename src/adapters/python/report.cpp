// WindowReport and PhaseSeconds as read-only Python objects with the C++ field names.
#include <string>

#include <fmt/format.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <pulseloco/base/digest.h>
#include <pulseloco/engine/report.h>
#include <nlohmann/json.hpp>

#include "bindings.h"

namespace pulseloco::python {
namespace {

nb::dict seconds_dict(const PhaseSeconds& s) {
  nb::dict d;
  d["gate"] = s.gate;
  d["exchange"] = s.exchange;
  d["exchange_wait"] = s.exchange_wait;
  d["exchange_transfer"] = s.exchange_transfer;
  d["exchange_in_flight"] = s.exchange_in_flight;
  d["apply"] = s.apply;
  d["verify"] = s.verify;
  d["publish"] = s.publish;
  d["total"] = s.total;
  return d;
}

// The report as the JSON the C++ library writes (to_json): the same keys and values in every
// surface, digests as 16 hex digits (a u64 above 2^53 loses bits as a JSON number).
nb::dict report_dict(const WindowReport& r) {
  return nb::cast<nb::dict>(nb::module_::import_("json").attr("loads")(to_json(r).dump()));
}

std::vector<std::string> digests_hex(const std::vector<Digest>& digests) {
  std::vector<std::string> out;
  out.reserve(digests.size());
  for (const Digest d : digests)
    out.push_back(digest_hex(d));
  return out;
}

}  // namespace

void bind_report(nb::module_& module) {
  nb::class_<PhaseSeconds>(module, "PhaseSeconds", "Seconds one window spent in each phase.")
      .def_ro("gate", &PhaseSeconds::gate, "gate + encode (pulse) or pseudo-gradient (diloco)")
      .def_ro("exchange", &PhaseSeconds::exchange,
              "the collectives; overlapped: the time this boundary waited for the window in "
              "flight and the vote")
      .def_ro("exchange_wait", &PhaseSeconds::exchange_wait,
              "of exchange: waiting for the slowest peer to join it (until the last peer's "
              "header had arrived)")
      .def_ro("exchange_transfer", &PhaseSeconds::exchange_transfer,
              "of exchange: the rest, exchange - exchange_wait")
      .def_ro("exchange_in_flight", &PhaseSeconds::exchange_in_flight,
              "overlapped windows: how long the applied window's exchange ran in the background")
      .def_ro("apply", &PhaseSeconds::apply, "decode, aggregate, residual, outer step, reset")
      .def_ro("verify", &PhaseSeconds::verify, "digests of the state and their all-gather")
      .def_ro("publish", &PhaseSeconds::publish, "publishing the global weights (rank 0)")
      .def_ro("total", &PhaseSeconds::total)
      .def("to_dict", &seconds_dict)
      .def("__repr__", [](const PhaseSeconds& s) {
        return fmt::format(
            "PhaseSeconds(gate={:.6f}, exchange={:.6f}, exchange_wait={:.6f}, "
            "exchange_transfer={:.6f}, exchange_in_flight={:.6f}, apply={:.6f}, verify={:.6f}, "
            "publish={:.6f}, total={:.6f})",
            s.gate, s.exchange, s.exchange_wait, s.exchange_transfer, s.exchange_in_flight, s.apply,
            s.verify, s.publish, s.total);
      });

  using R = WindowReport;
  nb::class_<R>(module, "WindowReport",
                "What one window did on this rank (returned by after_optimizer_step() and "
                "run_window()). Attributes have the C++ WindowReport's names.")
      .def_ro("window", &R::window,
              "index of the window whose inner steps just ended (0-based); blocking windows "
              "commit at their own boundary")
      .def_ro("applied_window", &R::applied_window,
              "the window whose outer step this boundary applied: window when blocking, "
              "window - 1 when overlapped, None at the first overlapped boundary or when the "
              "window in flight was dropped")
      .def_prop_ro(
          "mode", [](const R& r) { return std::string(mode_name(r.mode)); },
          "'pulse', 'diloco' or 'ddp'")
      .def_prop_ro(
          "overlap", [](const R& r) { return std::string(overlap_name(r.overlap)); },
          "'blocking', 'delayed' or 'eager' (EngineOptions::overlap)")
      .def_ro("rank", &R::rank)
      .def_ro("world_size", &R::world_size)
      .def_ro("generation", &R::generation, "the group's generation (elastic runs; 0 otherwise)")
      .def_ro("members", &R::members, "worker ids in rank order (elastic runs; else empty)")
      .def_ro("parameters", &R::parameters, "elements in the model")
      .def_ro("steps_per_window", &R::steps_per_window, "H")
      .def_ro("state_location", &R::state_location, "'host' or 'cuda:N'")
      .def_ro("entries_sent", &R::entries_sent)
      .def_ro("density", &R::density, "entries_sent / parameters")
      .def_ro("payload_bytes", &R::payload_bytes, "this rank's encoded contribution")
      .def_ro("received_bytes", &R::received_bytes)
      .def_ro("exchange", &R::exchange,
              "how the applied window was exchanged: 'allgather' or 'reduction' (mode pulse), "
              "'allreduce' (diloco, ddp); '' when none was applied")
      .def_ro("union_entries", &R::union_entries,
              "elements that at least one rank sent in the window applied at this boundary")
      .def_ro("group_entries", &R::group_entries,
              "the sum over ranks of the elements each sent in that window")
      .def_ro("union_ratio", &R::union_ratio,
              "union_entries / group_entries: 1 for disjoint sets, 1 / world_size for identical "
              "ones; 0 when nothing was applied")
      .def_ro("wire_bytes_sent", &R::wire_bytes_sent)
      .def_ro("wire_bytes_received", &R::wire_bytes_received)
      .def_ro("diloco_bytes", &R::diloco_bytes, "dense DiLoCo payload: 4 B x parameters")
      .def_ro("ddp_bytes", &R::ddp_bytes, "dense DDP payload: H x 4 B x parameters")
      .def_ro("seconds", &R::seconds)
      .def_prop_ro(
          "digest", [](const R& r) { return digest_hex(r.digest); },
          "combined digest of the global weights and momentum: 16 lowercase hex digits")
      .def_prop_ro(
          "rank_digests", [](const R& r) { return digests_hex(r.rank_digests); },
          "every rank's digest, as digest (empty if not verified)")
      .def_ro("replicas_identical", &R::replicas_identical)
      .def_ro("published_version", &R::published_version,
              "the version this window's global weights were published as (publish_dir, rank "
              "0); None when not published")
      .def_ro("patch_changed", &R::patch_changed,
              "elements whose bf16 value changed since the last published version")
      .def_ro("patch_density", &R::patch_density, "patch_changed / parameters")
      .def_ro("patch_delta_bytes", &R::patch_delta_bytes, "the TRL delta file (0: none)")
      .def_ro("patch_compact_bytes", &R::patch_compact_bytes, "the compact patch file (0: none)")
      .def_ro("patch_anchor_bytes", &R::patch_anchor_bytes,
              "the anchor file; 0 when no anchor was written")
      .def_ro("publish_error", &R::publish_error,
              "why a due version was not published; empty otherwise")
      .def("to_dict", &report_dict,
           "The report as the JSON the C++ library writes (to_json; docs/operations.md, \"The "
           "per-window report\"): JSON-ready, digests as hex strings, seconds as a nested dict.")
      .def("summary", &summary_line, "The one-line summary the C++ library logs.")
      .def("__repr__", [](const R& r) {
        return fmt::format(
            "WindowReport(window={}, mode='{}', rank={}, world_size={}, "
            "density={:.6g}, payload_bytes={}, digest='{:016x}', "
            "replicas_identical={})",
            r.window, mode_name(r.mode), r.rank, r.world_size, r.density, r.payload_bytes, r.digest,
            r.replicas_identical ? "True" : "False");
      });
}

}  // namespace pulseloco::python
