// pulseloco_train_single: the training example in one process, without any synchronisation.
// Pretrains (or loads the cached pretrained state), then post-trains with AdamW at an RL-like
// learning rate and prints the training loss of every step and the held-out loss every few
// steps. A smoke test of the example model and the reference the distributed runs compare with.
#include <fmt/format.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/cli/flag_checks.h>
#include "model.h"
#include "pretrain.h"
#include "task.h"

namespace {

// build/bin/<this> -> build/cache
std::filesystem::path default_cache_dir() {
  std::error_code error;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", error);
  if (error) return std::filesystem::path("cache");
  return exe.parent_path().parent_path() / "cache";
}

}  // namespace

int main(int argc, char** argv) {
  using namespace pulseloco::example;
  CLI::App app{
      "pulseloco example: pretrain (or load) a small transformer, then post-train it "
      "in one process"};
  std::uint64_t seed = 1234;
  int threads = 1;
  int steps = 80;
  double lr = 3e-6;
  int batch_size = 4;
  int rank = 0;
  int eval_every = 8;
  int eval_batch_size = 64;
  PretrainOptions pretrain_options;
  pretrain_options.cache_dir = default_cache_dir();
  app.add_option("--seed", seed, "initial weights and data")->capture_default_str();
  app.add_option("--threads", threads, "libtorch intra-op threads")
      ->check(pulseloco::flags::at_least(1))
      ->capture_default_str();
  app.add_option("--steps", steps, "post-training steps")
      ->check(pulseloco::flags::at_least(0))
      ->capture_default_str();
  app.add_option("--lr", lr, "post-training AdamW learning rate")
      ->check(pulseloco::flags::above(0))
      ->capture_default_str();
  app.add_option("--batch", batch_size, "sequences per post-training step")
      ->check(pulseloco::flags::at_least(1))
      ->capture_default_str();
  app.add_option("--rank", rank, "which worker's data stream to train on")
      ->check(pulseloco::flags::at_least(0))
      ->capture_default_str();
  app.add_option("--eval-every", eval_every, "held-out loss every N steps (0: start and end only)")
      ->check(pulseloco::flags::at_least(0))
      ->capture_default_str();
  app.add_option("--eval-batch", eval_batch_size, "sequences in the held-out batch")
      ->check(pulseloco::flags::at_least(1))
      ->capture_default_str();
  app.add_option("--cache-dir", pretrain_options.cache_dir, "where the pretrained state is cached")
      ->capture_default_str();
  app.add_option("--pretrain-steps", pretrain_options.steps, "pretraining steps")
      ->check(pulseloco::flags::at_least(0))
      ->capture_default_str();
  app.add_option("--pretrain-batch", pretrain_options.batch_size, "sequences per pretraining step")
      ->check(pulseloco::flags::at_least(1))
      ->capture_default_str();
  app.add_option("--pretrain-lr", pretrain_options.peak_lr, "peak pretraining learning rate")
      ->check(pulseloco::flags::above(0))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    torch::set_num_threads(threads);
    pretrain_options.seed = seed;
    const ModelConfig config;
    TransformerLM model(config, seed);
    std::printf("model: %s, %llu parameters, %d libtorch threads\n", config.describe().c_str(),
                static_cast<unsigned long long>(model.parameter_count()), threads);
    std::fflush(stdout);

    const PretrainResult pretrained = load_or_pretrain(model, pretrain_options);
    if (pretrained.loaded_from_cache) {
      std::printf("pretrained state: loaded %s\n", pretrained.checkpoint.c_str());
    } else {
      std::printf("pretrained state: %d steps in %.1f s, cached in %s\n", pretrained.steps,
                  pretrained.seconds, pretrained.checkpoint.c_str());
    }
    std::printf("held-out loss (pretraining mix): initial %.4f -> pretrained %.4f\n",
                pretrained.eval_loss_initial, pretrained.eval_loss_final);

    const TaskMix mix = post_training_mix();
    const Batch eval = make_eval_batch(mix, seed, eval_batch_size, config.context);
    OptimizerSettings settings;
    settings.lr = lr;
    Trainer trainer(model, settings);
    const double eval_start = model.evaluate(eval);
    std::printf("post-training: %d steps, AdamW lr %g betas (%g, %g) wd %g, batch %d, rank %d\n",
                steps, lr, settings.beta1, settings.beta2, settings.weight_decay, batch_size, rank);
    std::printf("%6s %12s %12s %10s\n", "step", "train_loss", "eval_loss", "seconds");
    std::printf("%6d %12s %12.5f %10s\n", 0, "-", eval_start, "-");
    double eval_loss = eval_start;
    double total_seconds = 0;
    for (int step = 1; step <= steps; ++step) {
      const Batch batch = make_batch(mix, seed, rank, static_cast<std::uint64_t>(step - 1),
                                     batch_size, config.context);
      const auto start = std::chrono::steady_clock::now();
      const double loss = trainer.step(batch);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      total_seconds += seconds;
      const bool evaluate = step == steps || (eval_every > 0 && step % eval_every == 0);
      if (evaluate) {
        eval_loss = model.evaluate(eval);
        std::printf("%6d %12.5f %12.5f %10.3f\n", step, loss, eval_loss, seconds);
      } else {
        std::printf("%6d %12.5f %12s %10.3f\n", step, loss, "", seconds);
      }
      std::fflush(stdout);
    }
    std::printf("held-out loss (post-training mix): %.5f -> %.5f after %d steps; %.3f s/step\n",
                eval_start, eval_loss, steps, steps > 0 ? total_seconds / steps : 0.0);
    return 0;
  } catch (const std::exception& error) {
    std::fprintf(stderr, "pulseloco_train_single: %s\n", error.what());
    return 1;
  }
}
