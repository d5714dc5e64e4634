// A Google Benchmark console reporter that, after the usual table, prints each kernel row's
// share of its copy baseline and its speed-up over its libtorch row. Rows are matched by name:
// "<kernel>/<variant>[/...]" against "copy/<kernel>/<variant>" and "torch/<kernel>/<variant>".
// With --benchmark_repetitions=N the summary uses each row's median over the repetitions (and
// says so); with --benchmark_enable_random_interleaving=true those repetitions are spread over
// the run, so that a slow phase of a shared machine does not fall on one row only.
#pragma once

#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace pulseloco::bench {

struct Row {
  double bytes_per_second = 0;
  double items_per_second = 0;
};

// Prints the usual table, then each kernel's share of the copy bandwidth and its speed-up over
// the libtorch-ops reference.
class SummaryReporter : public benchmark::ConsoleReporter {
 public:
  explicit SummaryReporter(std::string note) : note_(std::move(note)) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) continue;
      // Single runs, or the median of repeated ones (then the repetitions themselves are skipped).
      const bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      if (run.run_type == Run::RT_Aggregate && !median) continue;
      if (run.run_type == Run::RT_Iteration && run.repetitions > 1) continue;
      medians_ = medians_ || median;
      Row row;
      if (auto it = run.counters.find("bytes_per_second"); it != run.counters.end())
        row.bytes_per_second = it->second.value;
      if (auto it = run.counters.find("items_per_second"); it != run.counters.end())
        row.items_per_second = it->second.value;
      // "gate/fp32/cuda/manual_time" -> "gate/fp32/cuda", so that rows match by name.
      std::string name = run.run_name.str();
      for (const std::string suffix : {"/manual_time", "/real_time"}) {
        if (name.ends_with(suffix)) name.erase(name.size() - suffix.size());
      }
      rows_[name] = row;
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    auto& out = GetOutputStream();
    out << "\nSummary (" << note_ << (medians_ ? "; medians over the repetitions" : "") << ")\n";
    out << fmt::format("{:<36} {:>10} {:>10} {:>9} {:>12}\n", "kernel", "Gelem/s", "GB/s",
                       "of copy", "x libtorch");
    for (const auto& [name, row] : rows_) {
      if (name.starts_with("copy/") || name.starts_with("torch/")) continue;
      // gate/fp32/avx2[/threads:2] -> gate/fp32
      const std::size_t second = name.find('/', name.find('/') + 1);
      const std::string base = name.substr(0, second);
      std::string of_copy = "-", over_torch = "-";
      if (auto it = rows_.find("copy/" + base);
          it != rows_.end() && it->second.bytes_per_second > 0)
        of_copy =
            fmt::format("{:.0f}%", 100.0 * row.bytes_per_second / it->second.bytes_per_second);
      if (auto it = rows_.find("torch/" + base);
          it != rows_.end() && it->second.items_per_second > 0)
        over_torch = fmt::format("{:.1f}", row.items_per_second / it->second.items_per_second);
      out << fmt::format("{:<36} {:>10.3f} {:>10.2f} {:>9} {:>12}\n", name,
                         row.items_per_second / 1e9, row.bytes_per_second / 1e9, of_copy,
                         over_torch);
    }
  }

 private:
  std::string note_;
  bool medians_ = false;
  std::map<std::string, Row> rows_;
};

}  // namespace pulseloco::bench
