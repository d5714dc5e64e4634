#include "patch_example_versions.h"

#include <torch/types.h>
#include <torch/utils.h>

#include "model.h"
#include "pretrain.h"
#include "task.h"

namespace pulseloco::bench {
namespace {

ExampleVersion copy_weights(const example::TransformerLM& model) {
  ExampleVersion version;
  for (const at::Tensor& parameter : model.parameters()) {
    const float* data = parameter.data_ptr<float>();
    version.tensors.emplace_back(data, data + parameter.numel());
  }
  return version;
}

}  // namespace

ExampleRun run_example(const ExampleRunOptions& options) {
  torch::set_num_threads(options.threads);
  const example::ModelConfig config;
  example::PretrainOptions pretrain;
  pretrain.steps = options.pretrain_steps;
  pretrain.log_every = 0;
  pretrain.cache_dir = options.cache_dir;
  example::TransformerLM model(config, pretrain.seed);
  (void)example::load_or_pretrain(model, pretrain);

  ExampleRun run{.model = config.describe(), .names = model.parameter_names()};
  for (const at::Tensor& parameter : model.parameters()) {
    const auto sizes = parameter.sizes();
    run.shapes.emplace_back(sizes.begin(), sizes.end());
  }
  example::OptimizerSettings settings;
  settings.lr = options.lr;
  example::Trainer trainer(model, settings);
  run.versions.push_back(copy_weights(model));
  std::uint64_t step = 0;
  for (int window = 0; window < options.windows; ++window) {
    for (int h = 0; h < options.steps_per_window; ++h, ++step) {
      (void)trainer.step(example::make_batch(example::post_training_mix(), pretrain.seed, 0, step,
                                             options.batch_size, config.context));
    }
    run.versions.push_back(copy_weights(model));
  }
  return run;
}

}  // namespace pulseloco::bench
