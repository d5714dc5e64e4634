// bf16 weight patches for inference servers: bytes per published version of each format and
// the publisher's and receiver's throughput (docs/benchmarks.md, "Weight patches").
//
//   build/bin/pulseloco_bench_patches [--cases example,qwen] [--qwen 0.5B,1.5B] [--json]
//
// Cases:
//   example  the training example (examples/train) post-trained on one worker with AdamW at each
//            --lr, θ published after every window of H = 8 steps (fp32 weights);
//   qwen     Qwen2.5 shapes filled by the payload benchmark's synthetic generator
//            (bench/payload_generator.h; one worker, H = 8, at each --qwen-lr): θ_g published
//            after every window's outer step (held as bf16 copies, to fit memory).
// Each version after the first is a row: the bytes of the full bf16 anchor, TRL's delta with raw
// I32 and gap_delta indices and the compact patch; the density; and the median, min and max of
// --repeats samples of publish (patch::Publisher), extract (the kernel alone) and apply
// (patch::Receiver::apply_file of each format). --json prints one record per line.
#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/cli/flag_checks.h>
#include "patch_measure.h"
#include "payload_generator.h"
#include "qwen_shapes.h"
#if PULSELOCO_BENCH_EXAMPLE
#include "patch_example_versions.h"
#endif

namespace pulseloco::bench {
namespace {

struct Settings {
  std::vector<std::string> cases = {"example", "qwen"};
  std::vector<double> example_lrs = {1e-6, 3e-6, 2e-5};
  int example_windows = 6;
  int pretrain_steps = 200;
  std::filesystem::path cache_dir;
  std::vector<std::string> qwen = {"0.5B"};
  std::vector<float> qwen_lrs = {1e-6f, 3e-6f, 2e-5f};
  int qwen_windows = 3;
  unsigned generator_threads = 0;
  PatchMeasureOptions measure;
  bool json = false;
};

// What a row was measured on.
struct CaseInfo {
  std::string source;  // "example" or "qwen-synthetic"
  std::string model;
  double lr = 0;
  int steps_per_window = 8;
  std::string weights_dtype;
};

nlohmann::json spread_json(const std::vector<double>& samples, std::uint64_t elements) {
  const Spread s = spread(samples);
  return {{"median", s.median},
          {"min", s.min},
          {"max", s.max},
          {"samples", samples},
          {"gelem_per_s", static_cast<double>(elements) / s.median / 1e9}};
}

nlohmann::json row_json(const CaseInfo& info, const PatchRow& row, const Settings& settings) {
  const auto ratio = [&](std::uint64_t bytes) {
    return static_cast<double>(bytes) / static_cast<double>(row.compact_bytes);
  };
  const auto per_changed = [&](std::uint64_t bytes) {
    return row.changed == 0 ? 0.0 : static_cast<double>(bytes) / static_cast<double>(row.changed);
  };
  return {
      {"benchmark", "patches"},
      {"source", info.source},
      {"model", info.model},
      {"lr", info.lr},
      {"H", info.steps_per_window},
      {"weights_dtype", info.weights_dtype},
      {"version", row.version},
      {"parameters", row.total_elements},
      {"changed", row.changed},
      {"density", static_cast<double>(row.changed) / static_cast<double>(row.total_elements)},
      {"bytes",
       {{"anchor", row.anchor_bytes},
        {"trl_raw_i32", row.raw_bytes},
        {"trl_gap_delta", row.gap_delta_bytes},
        {"compact", row.compact_bytes}}},
      {"bytes_per_changed",
       {{"trl_raw_i32", per_changed(row.raw_bytes)},
        {"trl_gap_delta", per_changed(row.gap_delta_bytes)},
        {"compact", per_changed(row.compact_bytes)}}},
      {"ratio_over_compact",
       {{"anchor", ratio(row.anchor_bytes)},
        {"trl_raw_i32", ratio(row.raw_bytes)},
        {"trl_gap_delta", ratio(row.gap_delta_bytes)}}},
      {"anchor_published", row.anchor_published},
      {"seconds",
       {{"publish", spread_json(row.publish_seconds, row.total_elements)},
        {"extract", spread_json(row.extract_seconds, row.total_elements)},
        {"apply_trl_raw_i32", spread_json(row.apply_raw_seconds, row.total_elements)},
        {"apply_trl_gap_delta", spread_json(row.apply_gap_delta_seconds, row.total_elements)},
        {"apply_compact", spread_json(row.apply_compact_seconds, row.total_elements)}}},
      {"repeats", settings.measure.repeats},
      {"threads", settings.measure.threads},
  };
}

std::string mb(double bytes) {
  return fmt::format("{:.3f}", bytes / 1e6);
}

std::string millis(const nlohmann::json& s) {
  return fmt::format("{:.1f} [{:.1f}-{:.1f}]", 1e3 * s["median"].get<double>(),
                     1e3 * s["min"].get<double>(), 1e3 * s["max"].get<double>());
}

void print_header(bool json) {
  if (json) return;
  fmt::print(
      "{:<15} {:<13} {:>6} {:>2} {:>7} {:>9} {:>9} {:>9} {:>9} {:>6} {:>22} {:>22} {:>22} {:>22}\n",
      "source", "model", "lr", "v", "density", "anchor MB", "raw MB", "gap MB", "compactMB",
      "gap/c", "publish ms [min-max]", "extract ms", "apply compact ms", "apply gap ms");
}

void print_row(const nlohmann::json& j, bool json) {
  if (json) {
    fmt::print("{}\n", j.dump());
  } else {
    const auto& b = j["bytes"];
    const auto& s = j["seconds"];
    fmt::print(
        "{:<15} {:<13} {:>6.0e} {:>2} {:>6.2f}% {:>9} {:>9} {:>9} {:>9} {:>5.2f}x {:>22} {:>22} "
        "{:>22} {:>22}{}\n",
        j["source"].get<std::string>(), j["model"].get<std::string>(), j["lr"].get<double>(),
        j["version"].get<std::uint64_t>(), 100 * j["density"].get<double>(),
        mb(b["anchor"].get<double>()), mb(b["trl_raw_i32"].get<double>()),
        mb(b["trl_gap_delta"].get<double>()), mb(b["compact"].get<double>()),
        j["ratio_over_compact"]["trl_gap_delta"].get<double>(), millis(s["publish"]),
        millis(s["extract"]), millis(s["apply_compact"]), millis(s["apply_trl_gap_delta"]),
        j["anchor_published"].get<bool>() ? "  (+anchor)" : "");
  }
  std::fflush(stdout);
}

std::vector<nlohmann::json> measure_case(const CaseInfo& info,
                                         std::span<const std::vector<patch::WeightsView>> versions,
                                         const Settings& settings,
                                         const std::function<void()>& release_weights) {
  PatchMeasureOptions options = settings.measure;
  options.work_dir /= fmt::format("{}-{}-lr{:g}", info.source, info.model, info.lr);
  std::vector<PatchRow> rows = measure_publish(versions, options);
  release_weights();  // the receiver's states need the memory
  measure_apply(rows, options);
  std::filesystem::remove_all(options.work_dir);
  std::vector<nlohmann::json> out;
  for (const PatchRow& row : rows)
    out.push_back(row_json(info, row, settings));
  return out;
}

#if PULSELOCO_BENCH_EXAMPLE
std::vector<nlohmann::json> example_rows(double lr, const Settings& settings) {
  ExampleRun run = run_example({.lr = lr,
                                .windows = settings.example_windows,
                                .pretrain_steps = settings.pretrain_steps,
                                .cache_dir = settings.cache_dir});
  std::vector<std::vector<patch::WeightsView>> versions;
  for (const ExampleVersion& version : run.versions) {
    std::vector<patch::WeightsView>& views = versions.emplace_back();
    for (std::size_t t = 0; t < run.names.size(); ++t) {
      views.push_back({.name = run.names[t],
                       .shape = run.shapes[t],
                       .data = version.tensors[t].data(),
                       .dtype = DType::float32});
    }
  }
  return measure_case(
      {.source = "example", .model = "example-5M", .lr = lr, .weights_dtype = "fp32"}, versions,
      settings, [&] { run.versions = {}; });
}
#endif

std::vector<nlohmann::json> qwen_rows(const QwenConfig& model, float lr, const Settings& settings) {
  GeneratorConfig generator;
  generator.tensors = qwen2_tensors(model);
  generator.workers = 1;
  generator.windows = settings.qwen_windows;
  generator.lr = lr;
  generator.verify_decode = false;  // the payload benchmark checks the codec; here only θ_g counts
  generator.threads = settings.generator_threads;
  // [version][tensor]: bf16(θ_g), 2 bytes per parameter per version.
  std::vector<std::vector<std::vector<std::uint16_t>>> bits(
      static_cast<std::size_t>(settings.qwen_windows) + 1);
  for (auto& version : bits) {
    for (const ModelTensor& tensor : generator.tensors)
      version.emplace_back(tensor.numel());
  }
  generator.on_global_weights = [&](std::uint32_t tensor, std::uint64_t begin, int windows_done,
                                    std::span<const float> global) {
    std::uint16_t* out = bits[static_cast<std::size_t>(windows_done)][tensor].data() + begin;
    float_to_bf16(global, std::span(out, global.size()));
  };
  (void)run_generator(generator);
  std::vector<std::vector<patch::WeightsView>> versions;
  for (const auto& version : bits) {
    std::vector<patch::WeightsView>& views = versions.emplace_back();
    for (std::size_t t = 0; t < generator.tensors.size(); ++t) {
      views.push_back({.name = generator.tensors[t].name,
                       .shape = generator.tensors[t].shape,
                       .data = version[t].data(),
                       .dtype = DType::bfloat16});
    }
  }
  return measure_case({.source = "qwen-synthetic",
                       .model = std::string(model.name),
                       .lr = lr,
                       .weights_dtype = "bf16"},
                      versions, settings, [&] { bits = {}; });
}

}  // namespace
}  // namespace pulseloco::bench

int main(int argc, char** argv) {
  using namespace pulseloco;
  using namespace pulseloco::bench;
  CLI::App app{"bf16 weight patches: bytes per version of each format, publish and apply time"};
  Settings s;
  s.cache_dir =
      std::filesystem::read_symlink("/proc/self/exe").parent_path().parent_path() / "cache";
  std::filesystem::path work_root = std::filesystem::temp_directory_path();
  app.add_option("--cases", s.cases, "example, qwen")
      ->delimiter(',')
      ->check(CLI::IsMember({"example", "qwen"}))
      ->capture_default_str();
  app.add_option("--lr", s.example_lrs, "example: inner AdamW learning rates")->delimiter(',');
  app.add_option("--example-windows", s.example_windows, "example: windows of H = 8 steps")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--pretrain-steps", s.pretrain_steps, "example: pretraining steps (cached)")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--cache-dir", s.cache_dir, "example: pretrained checkpoint cache")
      ->capture_default_str();
  app.add_option("--qwen", s.qwen, "Qwen2.5 scales (0.5B, 1.5B, 3B, 7B, tiny)")->delimiter(',');
  app.add_option("--qwen-lr", s.qwen_lrs, "qwen: the generator's inner learning rates")
      ->delimiter(',');
  app.add_option("--qwen-windows", s.qwen_windows, "qwen: windows (versions after the first)")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--generator-threads", s.generator_threads, "qwen: generator threads (0: all)")
      ->capture_default_str();
  app.add_option("--repeats", s.measure.repeats, "samples of every time")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--threads", s.measure.threads, "publisher and extraction threads")
      ->check(flags::at_least(std::size_t{1}))
      ->capture_default_str();
  app.add_option("--work-dir", work_root,
                 "where the publishing directories go (in a directory of their own, removed)")
      ->check(CLI::ExistingDirectory)
      ->capture_default_str();
  app.add_flag("--json", s.json, "one JSON record per line");
  CLI11_PARSE(app, argc, argv);
  s.measure.work_dir = work_root / fmt::format("pulseloco-bench-patches-{}", ::getpid());

  try {
    std::vector<const QwenConfig*> models;
    for (const std::string& scale : s.qwen)
      models.push_back(&qwen_config_or_tiny(scale));
    print_header(s.json);
    const auto has = [&](std::string_view name) {
      return std::find(s.cases.begin(), s.cases.end(), name) != s.cases.end();
    };
    if (has("example")) {
#if PULSELOCO_BENCH_EXAMPLE
      for (double lr : s.example_lrs) {
        for (const nlohmann::json& row : example_rows(lr, s))
          print_row(row, s.json);
      }
#else
      throw std::invalid_argument("the example case needs a build with libtorch and the examples");
#endif
    }
    if (has("qwen")) {
      for (const QwenConfig* model : models) {
        for (float lr : s.qwen_lrs) {
          for (const nlohmann::json& row : qwen_rows(*model, lr, s))
            print_row(row, s.json);
        }
      }
    }
    std::filesystem::remove_all(s.measure.work_dir);
    return 0;
  } catch (const std::exception& e) {
    std::filesystem::remove_all(s.measure.work_dir);
    std::fprintf(stderr, "pulseloco_bench_patches: %s\n", e.what());
    return 1;
  }
}
