#include "patch_measure.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include <pulseloco/base/thread_pool.h>
#include <pulseloco/kernels/patch_kernels.h>
#include <pulseloco/patch/compact_files.h>
#include <pulseloco/patch/receiver.h>
#include <pulseloco/patch/trl_files.h>

namespace pulseloco::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::filesystem::path publish_dir(const PatchMeasureOptions& options, int repeat) {
  return options.work_dir /
         (repeat == 0 ? std::string("publish") : fmt::format("publish-{}", repeat));
}

std::filesystem::path raw_delta_path(const PatchMeasureOptions& options, std::uint64_t version) {
  return options.work_dir / "raw" / patch::delta_file_name(version).filename();
}

// The extraction's unit of work: one chunk of one tensor, with its own output buffers and what
// undoes its snapshot update (the offsets and the bits they replaced).
struct ExtractChunk {
  std::size_t tensor = 0;
  std::uint64_t begin = 0;
  std::uint64_t count = 0;
  std::vector<std::uint32_t> undo_offsets;
  std::vector<std::uint16_t> undo_bits;
  std::uint64_t changed = 0;
};

// The patch kernel over every chunk of `weights` against `snapshot` (one bf16 vector per
// tensor, in the same order), as the publisher runs it; the snapshot ends as bf16(weights).
class Extraction {
 public:
  Extraction(std::span<const patch::WeightsView> first, std::uint64_t chunk_elements,
             std::size_t threads)
      : pool_(threads) {
    for (std::size_t t = 0; t < first.size(); ++t) {
      const std::uint64_t numel = patch::shape_elements(first[t].name, first[t].shape);
      snapshot_.emplace_back(numel);
      for (std::uint64_t begin = 0; begin < numel; begin += chunk_elements)
        chunks_.push_back(
            {.tensor = t, .begin = begin, .count = std::min(chunk_elements, numel - begin)});
    }
  }

  // Returns the changed elements.
  std::uint64_t run(std::span<const patch::WeightsView> weights) {
    pool_.parallel_for(chunks_.size(), [&](std::size_t c) {
      ExtractChunk& chunk = chunks_[c];
      const patch::WeightsView& view = weights[chunk.tensor];
      thread_local std::vector<std::uint32_t> offsets;
      thread_local std::vector<std::uint16_t> values;
      thread_local std::vector<std::uint16_t> previous;
      offsets.resize(chunk.count);
      values.resize(chunk.count);
      previous.resize(chunk.count);
      const kernels::PatchResult result = kernels::extract_patch(
          {.snapshot = snapshot_[chunk.tensor].data() + chunk.begin,
           .current =
               static_cast<const std::byte*>(view.data) + chunk.begin * dtype_size(view.dtype),
           .current_dtype = view.dtype,
           .count = chunk.count},
          {.offsets = offsets.data(), .values = values.data(), .previous = previous.data()});
      kernels::check_patch_finite(result, view.name, chunk.begin);
      chunk.changed = result.changed;
      chunk.undo_offsets.assign(offsets.begin(),
                                offsets.begin() + static_cast<std::ptrdiff_t>(result.changed));
      chunk.undo_bits.assign(previous.begin(),
                             previous.begin() + static_cast<std::ptrdiff_t>(result.changed));
    });
    std::uint64_t changed = 0;
    for (const ExtractChunk& chunk : chunks_)
      changed += chunk.changed;
    return changed;
  }

  // Puts the snapshot back as it was before the last run().
  void undo() {
    for (ExtractChunk& chunk : chunks_) {
      std::uint16_t* bits = snapshot_[chunk.tensor].data() + chunk.begin;
      for (std::size_t k = 0; k < chunk.undo_offsets.size(); ++k)
        bits[chunk.undo_offsets[k]] = chunk.undo_bits[k];
    }
  }

 private:
  ThreadPool pool_;
  std::vector<std::vector<std::uint16_t>> snapshot_;
  std::vector<ExtractChunk> chunks_;
};

// The sizes of the formats the publisher did not write for this version: an anchor (when it
// wrote none) and the delta with raw indices (kept for measure_apply).
void measure_other_formats(const patch::Publisher& publisher,
                           const patch::PublishedVersion& published,
                           const PatchMeasureOptions& options, PatchRow& row) {
  const std::filesystem::path dir = publish_dir(options, 0);
  if (published.anchor_bytes == 0) {
    const std::filesystem::path aside = options.work_dir / "anchor-aside.safetensors";
    row.anchor_bytes = patch::write_anchor_file(aside, publisher.snapshot(), published.version,
                                                published.digest, patch::IndexEncoding::gap_delta)
                           .size;
    std::filesystem::remove(aside);
  } else {
    row.anchor_bytes = published.anchor_bytes;
  }
  patch::Delta delta =
      patch::read_delta_file(dir / patch::delta_file_name(published.version), publisher.snapshot());
  delta.encoding = patch::IndexEncoding::raw;
  row.raw_bytes = patch::write_delta_file(raw_delta_path(options, published.version), delta).size;
}

}  // namespace

Spread spread(std::vector<double> samples) {
  if (samples.empty()) return {};
  std::sort(samples.begin(), samples.end());
  const std::size_t n = samples.size();
  const double median = n % 2 == 1 ? samples[n / 2] : (samples[n / 2 - 1] + samples[n / 2]) / 2;
  return {.median = median, .min = samples.front(), .max = samples.back()};
}

std::vector<PatchRow> measure_publish(std::span<const std::vector<patch::WeightsView>> versions,
                                      const PatchMeasureOptions& options) {
  if (versions.size() < 2) throw std::invalid_argument("at least two versions to publish");
  if (options.repeats < 1) throw std::invalid_argument("repeats must be at least 1");
  std::filesystem::create_directories(options.work_dir / "raw");
  std::vector<PatchRow> rows(versions.size() - 1);
  const patch::PublisherOptions publisher_options{.anchor_every = options.anchor_every,
                                                  .encoding = patch::IndexEncoding::gap_delta,
                                                  .compact = true,
                                                  .threads = options.threads};
  for (int repeat = 0; repeat < options.repeats; ++repeat) {
    const std::filesystem::path dir = publish_dir(options, repeat);
    std::filesystem::remove_all(dir);
    patch::Publisher publisher(dir, publisher_options);
    for (std::size_t v = 0; v < versions.size(); ++v) {
      const auto start = Clock::now();
      const patch::PublishedVersion published = publisher.publish(versions[v], v);
      const double seconds = seconds_since(start);
      if (v == 0) continue;
      PatchRow& row = rows[v - 1];
      row.publish_seconds.push_back(seconds);
      if (repeat > 0) continue;
      row.version = v;
      row.total_elements = publisher.snapshot().total_elements();
      row.changed = published.changed;
      row.gap_delta_bytes = published.delta_bytes;
      row.compact_bytes = published.compact_bytes;
      row.anchor_published = published.anchor_bytes != 0;
      measure_other_formats(publisher, published, options, row);
    }
    if (repeat > 0) std::filesystem::remove_all(dir);
  }

  Extraction extraction(versions[0], publisher_options.chunk_elements, options.threads);
  (void)extraction.run(versions[0]);
  for (std::size_t v = 1; v < versions.size(); ++v) {
    PatchRow& row = rows[v - 1];
    for (int repeat = 0; repeat < options.repeats; ++repeat) {
      if (repeat > 0) extraction.undo();
      const auto start = Clock::now();
      const std::uint64_t changed = extraction.run(versions[v]);
      row.extract_seconds.push_back(seconds_since(start));
      if (changed != row.changed) {
        throw std::runtime_error(fmt::format(
            "version {}: the kernel found {} changes, the publisher {}", v, changed, row.changed));
      }
    }
  }
  return rows;
}

void measure_apply(std::vector<PatchRow>& rows, const PatchMeasureOptions& options) {
  const std::filesystem::path dir = publish_dir(options, 0);
  patch::Bf16State state = patch::read_anchor_file(dir / patch::anchor_file_name(0)).state;
  for (PatchRow& row : rows) {
    const std::uint64_t v = row.version;
    const struct {
      std::filesystem::path path;
      std::vector<double>* seconds;
    } files[] = {{raw_delta_path(options, v), &row.apply_raw_seconds},
                 {dir / patch::delta_file_name(v), &row.apply_gap_delta_seconds},
                 {dir / patch::compact_file_name(v), &row.apply_compact_seconds}};
    for (const auto& file : files) {
      for (int repeat = 0; repeat < options.repeats; ++repeat) {
        patch::Receiver receiver(state, v - 1);  // a copy: every sample starts from v - 1
        const auto start = Clock::now();
        receiver.apply_file(file.path);
        file.seconds->push_back(seconds_since(start));
        // The next version starts from the state this one reached (copied into place).
        if (&file == &files[2] && repeat + 1 == options.repeats) state = receiver.state();
      }
    }
  }
}

}  // namespace pulseloco::bench
