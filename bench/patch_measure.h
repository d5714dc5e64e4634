// The weight patch benchmark's measurements (bench/bench_patches.cpp; docs/benchmarks.md,
// "Weight patches"), over a sequence of published versions of one model:
//
//   - bytes per version of each format: the full bf16 anchor, TRL's delta with raw I32 indices
//     and with gap_delta indices, and the compact patch (files as patch::Publisher writes them);
//   - publish: patch::Publisher::publish (extraction, the delta and compact files, an anchor
//     when its rule says so, the manifest; every file fsynced), per version;
//   - extract: the patch kernel alone over every chunk (kernels/patch_kernels.h), as the
//     publisher runs it;
//   - apply: patch::Receiver::apply_file of each format's file (read, every check, the parent
//     and result digests), per version.
//
// Times are wall seconds, `repeats` samples each (every sample starts from the same state).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include <pulseloco/patch/publisher.h>

namespace pulseloco::bench {

struct PatchMeasureOptions {
  int repeats = 3;
  std::size_t threads = 1;            // the publisher's and the extraction's parallelism
  std::filesystem::path work_dir;     // the publishing directories (created; left for apply)
  std::uint64_t anchor_every = 1000;  // the publisher's; the size rule still adds anchors
};

// One published version after the first.
struct PatchRow {
  std::uint64_t version = 0;
  std::uint64_t total_elements = 0;
  std::uint64_t changed = 0;
  std::uint64_t anchor_bytes = 0;     // an anchor of this version (written aside when the
                                      // publisher did not write one)
  std::uint64_t raw_bytes = 0;        // TRL delta, raw I32 indices
  std::uint64_t gap_delta_bytes = 0;  // TRL delta, gap_delta indices
  std::uint64_t compact_bytes = 0;
  bool anchor_published = false;  // the publisher also wrote an anchor (its size rule)
  std::vector<double> publish_seconds;
  std::vector<double> extract_seconds;
  std::vector<double> apply_raw_seconds;
  std::vector<double> apply_gap_delta_seconds;
  std::vector<double> apply_compact_seconds;
};

// Publishes versions[0] (an anchor) and every later one `repeats` times, each time into a fresh
// directory, and times the extraction alone; fills every field but the apply times. The first
// run's directory (work_dir / "publish") and the raw-index deltas (work_dir / "raw") stay for
// measure_apply. The weights of every version must stay valid during the call.
[[nodiscard]] std::vector<PatchRow> measure_publish(
    std::span<const std::vector<patch::WeightsView>> versions, const PatchMeasureOptions& options);

// Times a receiver applying each version's raw, gap_delta and compact file to the version
// before it (all from measure_publish's directories); fills the apply times.
void measure_apply(std::vector<PatchRow>& rows, const PatchMeasureOptions& options);

struct Spread {
  double median = 0;
  double min = 0;
  double max = 0;
};
[[nodiscard]] Spread spread(std::vector<double> samples);

}  // namespace pulseloco::bench
