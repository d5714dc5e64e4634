// `pulseloco replay TRACE_DIR [--window N] [--json]`: re-runs traced windows offline (an
// in-process group of the traced world size, the same kernels and codec) from their recorded
// inputs and compares every output tensor bit for bit with what the run recorded. For debugging
// divergence: a window that does not replay identically points at non-determinism in that
// window's inputs or in the machine that ran it. Exit status: 0 when every replayed window is
// bit-identical, 2 when one differs, 1 on an error (missing or malformed trace files).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>

#include <cstdint>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/cli/commands.h>
#include <pulseloco/cli/flag_checks.h>
#include <pulseloco/engine/replay.h>
#include <pulseloco/io/input_file.h>

namespace pulseloco::cli {
namespace {

struct ReplayOptions {
  std::string trace_dir;
  std::optional<std::uint64_t> window;
  bool json = false;
};

// Exits the process with status 2 after printing, when a replay differed (CLI11 callbacks
// cannot return a status; an exception carries it to main()).
struct ReplayDiffered : std::exception {
  [[nodiscard]] const char* what() const noexcept override {
    return "a replayed window is not bit-identical to its trace";
  }
};

void replay(const ReplayOptions& options) {
  std::vector<std::uint64_t> windows;
  if (options.window) {
    windows.push_back(*options.window);
  } else {
    windows = traced_windows(options.trace_dir);
    if (windows.empty()) {
      throw InvalidArgument(
          fmt::format("no traced windows (window-NNNNNN directories) in '{}'", options.trace_dir));
    }
  }
  nlohmann::json records = nlohmann::json::array();
  bool all_identical = true;
  for (const std::uint64_t window : windows) {
    const ReplayResult result = replay_window(options.trace_dir, window);
    all_identical = all_identical && result.identical();
    if (options.json) {
      nlohmann::json differences = nlohmann::json::array();
      for (const auto& d : result.differences) {
        differences.push_back({{"rank", d.rank},
                               {"tensor", d.tensor},
                               {"first_index", d.first_index},
                               {"differing", d.differing}});
      }
      records.push_back({{"window", result.window},
                         {"world_size", result.world_size},
                         {"tensors_compared", result.tensors_compared},
                         {"ranks_without_outputs", result.ranks_without_outputs},
                         {"identical", result.identical()},
                         {"differences", differences}});
      continue;
    }
    fmt::print(
        "window {}: {} ranks, {} tensors compared: {}\n", result.window, result.world_size,
        result.tensors_compared,
        result.identical() ? "bit-identical" : fmt::format("{} differ", result.differences.size()));
    if (!result.ranks_without_outputs.empty()) {
      fmt::print("  ranks {} took part but recorded no outputs (lost after the window committed)\n",
                 fmt::join(result.ranks_without_outputs, ", "));
    }
    for (const auto& d : result.differences) {
      fmt::print("  rank {} tensor '{}': {} elements differ, the first at index {}\n", d.rank,
                 d.tensor, d.differing, d.first_index);
    }
  }
  if (options.json) std::cout << records.dump(2) << '\n';
  if (!all_identical) throw ReplayDiffered();
}

}  // namespace

void add_replay_command(CLI::App& app) {
  auto options = std::make_shared<ReplayOptions>();
  CLI::App* command = app.add_subcommand(
      "replay", "re-run traced windows offline and check that they reproduce bit for bit");
  command->add_option("trace_dir", options->trace_dir, "a directory written with trace_dir set")
      ->required()
      ->check(CLI::Validator(
          [](const std::string& path) -> std::string {
            struct stat status {};
            if (::stat(path.c_str(), &status) != 0) {
              return fmt::format("cannot examine '{}': {}", path, std::strerror(errno));
            }
            if (!S_ISDIR(status.st_mode)) {
              return fmt::format("'{}' is {}, not a trace directory", path,
                                 io::file_type_name(status.st_mode));
            }
            return {};
          },
          "DIR"));
  command->add_option("--window", options->window, "replay only this window (default: all)")
      ->check(flags::at_least(0));
  command->add_flag("--json", options->json, "print one JSON record per window");
  command->callback([options] { replay(*options); });
}

int replay_failure_status(const std::exception& error) noexcept {
  return dynamic_cast<const ReplayDiffered*>(&error) != nullptr ? 2 : 0;
}

}  // namespace pulseloco::cli
