// The training example's costs and its bf16 update sparsity.
//
//   build/bin/pulseloco_bench_example_model [--fresh-pretrain] [--json out.json]
//
// Measures: parameter count; seconds per post-training step (batch 4 x 64 tokens, forward +
// backward + AdamW) with 1 and 2 libtorch threads; pretraining wall time and held-out loss
// before/after it; held-out post-training loss after 80 steps at lr 3e-6; and, per learning
// rate, the fraction of parameters whose bf16 value does not change in one AdamW step (fp32
// master weights, betas (0.9, 0.95), weight decay 0.1) — the quantity PULSE exploits.
#include <fmt/format.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model.h"
#include "pretrain.h"
#include "task.h"

#include <pulseloco/cli/flag_checks.h>

namespace {

using namespace pulseloco::example;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Median seconds of `steps` post-training steps (after `warmup` untimed ones).
double seconds_per_step(const ModelConfig& config, int threads, int batch_size, int warmup,
                        int steps) {
  torch::set_num_threads(threads);
  TransformerLM model(config, 1);
  Trainer trainer(model, OptimizerSettings{});
  std::vector<double> times;
  for (int step = 0; step < warmup + steps; ++step) {
    const Batch batch = make_batch(post_training_mix(), 1, 0, static_cast<std::uint64_t>(step),
                                   batch_size, config.context);
    const auto start = Clock::now();
    (void)trainer.step(batch);
    if (step >= warmup) times.push_back(seconds_since(start));
  }
  return median(times);
}

struct SparsityResult {
  double lr = 0;
  double first_step = 0;        // unchanged fraction in step 1 (fresh optimizer state)
  double later_steps_mean = 0;  // mean over steps 2..N
  double later_steps_min = 1;
  double last_steps_mean = 0;  // mean over the last 10 steps (optimizer state settled)
  double over_window = 0;      // unchanged between the start and the end of steps 1..8
};

SparsityResult measure_sparsity(const ModelConfig& config, const std::filesystem::path& weights,
                                std::uint64_t seed, double lr, int steps, int batch_size) {
  TransformerLM model(config, seed);
  load_weights(model, weights);
  OptimizerSettings settings;
  settings.lr = lr;
  Trainer trainer(model, settings);
  SparsityResult result;
  result.lr = lr;
  const auto window_start = bf16_snapshot(model);
  double later_sum = 0;
  double last_sum = 0;
  const int last_count = std::min(10, steps - 1);
  for (int step = 0; step < steps; ++step) {
    const auto before = bf16_snapshot(model);
    (void)trainer.step(make_batch(post_training_mix(), seed, 0, static_cast<std::uint64_t>(step),
                                  batch_size, config.context));
    const auto after = bf16_snapshot(model);
    const double unchanged = bf16_unchanged_fraction(before, after);
    if (step == 0) {
      result.first_step = unchanged;
    } else {
      later_sum += unchanged;
      result.later_steps_min = std::min(result.later_steps_min, unchanged);
    }
    if (step >= steps - last_count) last_sum += unchanged;
    if (step == 7) result.over_window = bf16_unchanged_fraction(window_start, after);
  }
  result.later_steps_mean = later_sum / std::max(1, steps - 1);
  result.last_steps_mean = last_sum / std::max(1, last_count);
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"pulseloco example model: step time, pretraining, losses, bf16 update sparsity"};
  bool fresh_pretrain = false;
  std::string json_path;
  std::filesystem::path cache_dir =
      std::filesystem::read_symlink("/proc/self/exe").parent_path().parent_path() / "cache";
  int timed_steps = 10;
  int post_steps = 80;
  int sparsity_steps = 40;
  int threads_for_training = 2;
  app.add_flag("--fresh-pretrain", fresh_pretrain,
               "pretrain into a temporary cache (measures the wall time) instead of loading");
  app.add_option("--cache-dir", cache_dir, "pretrained cache (when not --fresh-pretrain)")
      ->capture_default_str();
  app.add_option("--timed-steps", timed_steps, "steps timed per thread count")
      ->check(pulseloco::flags::at_least(1))
      ->capture_default_str();
  app.add_option("--post-steps", post_steps, "post-training steps for the loss measurement")
      ->check(pulseloco::flags::at_least(0))
      ->capture_default_str();
  app.add_option("--sparsity-steps", sparsity_steps, "AdamW steps per learning rate")
      ->check(pulseloco::flags::between(8, 1000))
      ->capture_default_str();
  app.add_option("--threads", threads_for_training, "threads for pretraining and the loss runs")
      ->check(pulseloco::flags::at_least(1))
      ->capture_default_str();
  app.add_option("--json", json_path, "also write the results as JSON");
  CLI11_PARSE(app, argc, argv);

  const ModelConfig config;
  const int post_batch = 4;
  nlohmann::json out;
  out["model"] = config.describe();
  out["parameters"] = config.parameter_count();
  fmt::print("model {}: {} parameters\n", config.describe(), config.parameter_count());

  for (int threads : {1, 2}) {
    const double s = seconds_per_step(config, threads, post_batch, 3, timed_steps);
    out["seconds_per_step"][std::to_string(threads) + "_threads"] = s;
    fmt::print("post-training step (batch {} x {} tokens): {:.3f} s with {} thread(s)\n",
               post_batch, config.context, s, threads);
  }

  torch::set_num_threads(threads_for_training);
  PretrainOptions options;
  options.log_every = 0;
  options.cache_dir = fresh_pretrain ? std::filesystem::temp_directory_path() /
                                           fmt::format("pulseloco-bench-pretrain-{}", ::getpid())
                                     : cache_dir;
  TransformerLM model(config, options.seed);
  const PretrainResult pretrained = load_or_pretrain(model, options);
  out["pretrain"] = {{"steps", pretrained.steps},
                     {"batch_size", options.batch_size},
                     {"threads", threads_for_training},
                     {"loaded_from_cache", pretrained.loaded_from_cache},
                     {"seconds", pretrained.seconds},
                     {"eval_loss_initial", pretrained.eval_loss_initial},
                     {"eval_loss_final", pretrained.eval_loss_final}};
  if (pretrained.loaded_from_cache) {
    fmt::print("pretraining: loaded from {} (run with --fresh-pretrain to time it)\n",
               pretrained.checkpoint.string());
  } else {
    fmt::print("pretraining: {} steps x {} sequences in {:.1f} s with {} thread(s)\n",
               pretrained.steps, options.batch_size, pretrained.seconds, threads_for_training);
  }
  fmt::print("held-out loss, pretraining mix: {:.4f} initial -> {:.4f} pretrained\n",
             pretrained.eval_loss_initial, pretrained.eval_loss_final);

  {
    const Batch eval = make_eval_batch(post_training_mix(), options.seed, 64, config.context);
    TransformerLM post(config, options.seed);
    load_weights(post, pretrained.checkpoint);
    Trainer trainer(post, OptimizerSettings{});
    const double start = post.evaluate(eval);
    for (int step = 0; step < post_steps; ++step) {
      (void)trainer.step(make_batch(post_training_mix(), options.seed, 0,
                                    static_cast<std::uint64_t>(step), post_batch, config.context));
    }
    const double end = post.evaluate(eval);
    out["post_training"] = {{"steps", post_steps},
                            {"lr", 3e-6},
                            {"batch_size", post_batch},
                            {"eval_loss_start", start},
                            {"eval_loss_end", end}};
    fmt::print(
        "held-out loss, post-training mix: {:.5f} pretrained -> {:.5f} after {} steps at "
        "lr 3e-6\n",
        start, end, post_steps);
  }

  fmt::print("bf16 weights unchanged by one AdamW step (from the pretrained state, batch {}):\n",
             post_batch);
  fmt::print("{:>8} {:>9} {:>16} {:>15} {:>15} {:>13}\n", "lr", "step 1", "steps 2..N mean",
             "steps 2..N min", "last 10 mean", "over 8 steps");
  for (double lr : {1e-6, 3e-6, 2e-5}) {
    const SparsityResult r = measure_sparsity(config, pretrained.checkpoint, options.seed, lr,
                                              sparsity_steps, post_batch);
    fmt::print("{:>8.0e} {:>8.2f}% {:>15.2f}% {:>14.2f}% {:>14.2f}% {:>12.2f}%\n", lr,
               100 * r.first_step, 100 * r.later_steps_mean, 100 * r.later_steps_min,
               100 * r.last_steps_mean, 100 * r.over_window);
    out["bf16_unchanged"].push_back({{"lr", lr},
                                     {"first_step", r.first_step},
                                     {"later_steps_mean", r.later_steps_mean},
                                     {"later_steps_min", r.later_steps_min},
                                     {"last_10_steps_mean", r.last_steps_mean},
                                     {"over_8_steps", r.over_window}});
  }
  if (fresh_pretrain) std::filesystem::remove_all(options.cache_dir);
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return 0;
}
