// The training example's model and task: determinism, task correctness, training progress,
// weight files and the pretrained cache.
#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/io/safetensors.h>
#include "io/python_check.h"
#include "io/test_files.h"
#include "model.h"
#include "pretrain.h"
#include "task.h"

namespace pulseloco::example {
namespace {

using io::test::TempDir;

// A smaller model keeps the tests fast; the production config is checked separately.
ModelConfig small_config() {
  ModelConfig config;
  config.d_model = 64;
  config.layers = 2;
  config.heads = 4;
  config.d_ff = 256;
  return config;
}

Digest batch_digest(const Batch& batch) {
  const Digest parts[] = {digest_of(std::span<const std::int64_t>(batch.inputs)),
                          digest_of(std::span<const std::int64_t>(batch.targets))};
  return combine_digests(parts);
}

TEST(ExampleTask, SameArgumentsGiveIdenticalBatches) {
  const TaskMix mix = post_training_mix();
  const Batch a = make_batch(mix, 42, 1, 7, 4, 64);
  const Batch b = make_batch(mix, 42, 1, 7, 4, 64);
  EXPECT_EQ(a.inputs, b.inputs);
  EXPECT_EQ(a.targets, b.targets);
  // Different rank, step or seed: different data.
  EXPECT_NE(make_batch(mix, 42, 2, 7, 4, 64).inputs, a.inputs);
  EXPECT_NE(make_batch(mix, 42, 1, 8, 4, 64).inputs, a.inputs);
  EXPECT_NE(make_batch(mix, 43, 1, 7, 4, 64).inputs, a.inputs);
  // A batch's rows do not depend on the batch size (row r is its own stream).
  const Batch wide = make_batch(mix, 42, 1, 7, 6, 64);
  EXPECT_TRUE(std::equal(a.inputs.begin(), a.inputs.end(), wide.inputs.begin()));
  // The held-out batch is none of the training batches.
  const Batch eval = make_eval_batch(mix, 42, 4, 64);
  for (int rank = 0; rank < 4; ++rank) {
    for (std::uint64_t step = 0; step < 16; ++step) {
      EXPECT_NE(make_batch(mix, 42, rank, step, 4, 64).inputs, eval.inputs);
    }
  }
}

TEST(ExampleTask, FirstBatchIsStableAcrossBuilds) {
  // The generator is integer-only code: these bits must never change by accident (a deliberate
  // change must also bump kPretrainVersion in pretrain.cpp, so old caches are rebuilt).
  const Batch batch = make_batch(pretraining_mix(), 1234, 0, 0, 2, 64);
  EXPECT_EQ(digest_hex(batch_digest(batch)), "9b44823b561c6fed")
      << "first tokens: " << batch.inputs[0] << " " << batch.inputs[1] << " " << batch.inputs[2];
}

// Parses every packed example of a batch and checks its answer against the sub-task's rule.
TEST(ExampleTask, AnswersFollowTheSubTaskRules) {
  std::set<std::int64_t> tasks_seen;
  std::size_t examples = 0;
  for (std::uint64_t step = 0; step < 20; ++step) {
    const Batch batch = make_batch(post_training_mix(), 5, 0, step, 8, 64);
    ASSERT_EQ(batch.inputs.size(), 8u * 64u);
    for (int row = 0; row < batch.batch_size; ++row) {
      const auto* in = batch.inputs.data() + static_cast<std::size_t>(row) * batch.context;
      const auto* target = batch.targets.data() + static_cast<std::size_t>(row) * batch.context;
      std::size_t t = 0;
      while (t < static_cast<std::size_t>(batch.context) && in[t] == kBosToken) {
        const std::int64_t task = in[t + 1] - kFirstTaskToken;
        tasks_seen.insert(task);
        std::vector<std::int64_t> x;
        std::size_t p = t + 2;
        while (in[p] != kSepToken) {
          x.push_back(in[p] - kFirstSymbolToken);
          ++p;
          ASSERT_LT(p, static_cast<std::size_t>(batch.context));
        }
        // Prompt positions carry no target; from SEP on, targets are the answer then EOS.
        for (std::size_t q = t; q < p; ++q)
          EXPECT_EQ(target[q], kIgnoreTarget);
        std::vector<std::int64_t> expected = x;
        switch (static_cast<SubTask>(task)) {
          case SubTask::count:
            ASSERT_EQ(x.size(), 1u);
            expected.clear();
            // The answer's length is not in the prompt: read it up to EOS.
            for (std::size_t q = p + 1;
                 q < static_cast<std::size_t>(batch.context) && in[q] != kEosToken; ++q) {
              expected.push_back((x[0] + static_cast<std::int64_t>(expected.size()) + 1) %
                                 kAlphabet);
            }
            EXPECT_GE(expected.size(), 3u);
            break;
          case SubTask::copy:
            break;
          case SubTask::reverse:
            std::reverse(expected.begin(), expected.end());
            break;
          case SubTask::sort:
            std::sort(expected.begin(), expected.end());
            break;
          case SubTask::mod_add:
            ASSERT_EQ(x.size(), 2u);
            expected = {(x[0] + x[1]) % kModulus};
            break;
          default:
            FAIL() << "unknown task token " << in[t + 1];
        }
        for (std::size_t i = 0; i < expected.size(); ++i) {
          ASSERT_LT(p + i, static_cast<std::size_t>(batch.context));
          EXPECT_EQ(target[p + i], kFirstSymbolToken + expected[i]) << "task " << task;
          EXPECT_EQ(in[p + 1 + i], kFirstSymbolToken + expected[i]);
        }
        // The EOS target may fall just past the row (the example then ends the row).
        if (p + expected.size() < static_cast<std::size_t>(batch.context)) {
          EXPECT_EQ(target[p + expected.size()], kEosToken);
        }
        t = p + expected.size() + 2;
        ++examples;
      }
      for (; t < static_cast<std::size_t>(batch.context); ++t) {
        EXPECT_EQ(in[t], kPadToken);
        EXPECT_EQ(target[t], kIgnoreTarget);
      }
    }
  }
  EXPECT_EQ(tasks_seen.size(), kSubTaskCount);
  EXPECT_GT(examples, 20u * 8u);  // several examples packed per row
}

TEST(ExampleTask, InvalidMixesAreRefused) {
  TaskMix mix = pretraining_mix();
  mix.weights = {0, 0, 0, 0, 0};
  EXPECT_THROW((void)make_batch(mix, 1, 0, 0, 1, 64), InvalidArgument);
  mix = pretraining_mix();
  mix.max_length = 40;  // an example of 84 tokens cannot fit a context of 64
  EXPECT_THROW((void)make_batch(mix, 1, 0, 0, 1, 64), InvalidArgument);
  EXPECT_THROW((void)make_batch(pretraining_mix(), 1, -1, 0, 1, 64), InvalidArgument);
}

TEST(ExampleModel, ProductionConfigSizeAndShapes) {
  const ModelConfig config;
  EXPECT_EQ(config.parameter_count(), 5'003'776u);
  EXPECT_GE(config.parameter_count(), 5'000'000u);
  EXPECT_LE(config.parameter_count(), 20'000'000u);
  ModelConfig bad = config;
  bad.heads = 7;
  EXPECT_THROW(bad.validate(), InvalidArgument);
  bad = config;
  bad.vocabulary = 30;
  EXPECT_THROW(bad.validate(), InvalidArgument);
}

TEST(ExampleModel, SameSeedGivesIdenticalInitialWeights) {
  const ModelConfig config = small_config();
  TransformerLM a(config, 11);
  // Whatever else used libtorch's global generator in between does not matter.
  torch::manual_seed(99);
  (void)torch::randn({100});
  TransformerLM b(config, 11);
  TransformerLM c(config, 12);
  EXPECT_EQ(a.parameter_count(), config.parameter_count());
  EXPECT_EQ(a.parameter_names(), b.parameter_names());
  const auto pa = a.parameters();
  const auto pb = b.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pa[i].is_contiguous());
    EXPECT_EQ(std::memcmp(pa[i].data_ptr(), pb[i].data_ptr(), pa[i].nbytes()), 0)
        << a.parameter_names()[i];
  }
  EXPECT_EQ(a.weights_digest(), b.weights_digest());
  EXPECT_NE(a.weights_digest(), c.weights_digest());
  // Initial matrices have the intended scale (std 0.02).
  const auto names = a.parameter_names();
  const auto it = std::find(names.begin(), names.end(), "blocks.0.fc.weight");
  ASSERT_NE(it, names.end());
  const double std_dev = pa[static_cast<std::size_t>(it - names.begin())].std().item<double>();
  EXPECT_NEAR(std_dev, 0.02, 0.001);
}

TEST(ExampleModel, CausalMaskKeepsTheFutureOut) {
  TransformerLM model(small_config(), 3);
  torch::NoGradGuard no_grad;
  torch::manual_seed(3);  // libtorch seeds its default generator at random in every process
  auto tokens = torch::randint(16, 80, {1, 64}, torch::kInt64);
  auto changed = tokens.clone();
  changed[0][40] = tokens[0][40].item<std::int64_t>() == 17 ? 18 : 17;  // only position 40 differs
  const auto a = model.forward(tokens);
  const auto b = model.forward(changed);
  // Not bitwise: the BLAS may take another code path for another allocation's alignment, which
  // rounds differently in the last bits. A leak of the future would move the earlier positions'
  // outputs far more than that; the changed position's own output moves by much more.
  const double before_change = (a.slice(1, 0, 40) - b.slice(1, 0, 40)).abs().max().item<double>();
  const double at_change = (a.slice(1, 40, 41) - b.slice(1, 40, 41)).abs().max().item<double>();
  EXPECT_LT(before_change, 1e-5);
  EXPECT_GT(at_change, 1e-2);
}

TEST(ExampleModel, TrainingStepsReduceLossOnAFixedBatch) {
  TransformerLM model(small_config(), 5);
  const Batch batch = make_batch(pretraining_mix(), 5, 0, 0, 8, 64);
  OptimizerSettings settings;
  settings.lr = 3e-3;
  Trainer trainer(model, settings);
  const double before = model.evaluate(batch);
  EXPECT_NEAR(before, std::log(512.0), 0.3);  // near-uniform predictions at initialisation
  for (int i = 0; i < 15; ++i)
    (void)trainer.step(batch);
  const double after = model.evaluate(batch);
  EXPECT_LT(after, 0.7 * before) << "before " << before << " after " << after;
}

TEST(ExampleModel, TrainingIsDeterministic) {
  const Batch batch = make_batch(post_training_mix(), 9, 0, 0, 4, 64);
  auto run = [&] {
    TransformerLM model(small_config(), 9);
    OptimizerSettings settings;
    settings.lr = 1e-3;
    Trainer trainer(model, settings);
    for (int i = 0; i < 3; ++i)
      (void)trainer.step(batch);
    return model.weights_digest();
  };
  EXPECT_EQ(run(), run());
}

TEST(ExampleModel, Bf16SparsityFollowsTheLearningRate) {
  TransformerLM model(small_config(), 21);
  const Batch batch = make_batch(post_training_mix(), 21, 0, 0, 4, 64);
  OptimizerSettings settings;
  settings.lr = 0;
  settings.weight_decay = 0.1;
  Trainer trainer(model, settings);
  auto before = bf16_snapshot(model);
  (void)trainer.step(batch);
  EXPECT_EQ(bf16_unchanged_fraction(before, bf16_snapshot(model)), 1.0);  // lr 0 moves nothing
  trainer.set_lr(1e-6);
  before = bf16_snapshot(model);
  (void)trainer.step(batch);
  const double tiny = bf16_unchanged_fraction(before, bf16_snapshot(model));
  trainer.set_lr(1e-2);
  before = bf16_snapshot(model);
  (void)trainer.step(batch);
  const double large = bf16_unchanged_fraction(before, bf16_snapshot(model));
  EXPECT_GT(tiny, 0.9);
  EXPECT_LT(tiny, 1.0);
  EXPECT_LT(large, 0.5);
  EXPECT_THROW((void)bf16_unchanged_fraction(before, {}), InvalidArgument);
}

// bf16 weights: the model computes on exactly the bf16 values, and each optimizer step's result
// is rounded to nearest even into the bf16 tensors (and the model set to the rounded values).
TEST(ExampleModel, Bf16WeightsHoldTheModelOnTheBf16Grid) {
  TransformerLM model(small_config(), 23);
  const std::vector<std::uint16_t> rounded = bf16_snapshot(model);
  Bf16Weights weights(model);
  ASSERT_EQ(weights.tensors().size(), model.parameters().size());
  for (const auto& t : weights.tensors())
    EXPECT_EQ(t.scalar_type(), torch::kBFloat16);
  const auto on_grid = [&] {
    std::size_t i = 0;
    for (const auto& p : model.parameters()) {
      const auto expected = weights.tensors()[i++].to(torch::kFloat32);
      if (!torch::equal(p.detach(), expected)) return false;
    }
    return true;
  };
  EXPECT_TRUE(on_grid());
  EXPECT_EQ(bf16_snapshot(model), rounded);

  OptimizerSettings settings;
  settings.lr = 1e-3;
  Trainer trainer(model, settings);
  (void)trainer.forward_backward(make_batch(post_training_mix(), 23, 0, 0, 2, 64));
  trainer.optimizer_step();
  const std::vector<std::uint16_t> stepped = bf16_snapshot(model);  // bf16(fp32 result)
  weights.round_from_model();
  EXPECT_TRUE(on_grid());
  EXPECT_EQ(bf16_snapshot(model), stepped);
  EXPECT_LT(bf16_unchanged_fraction(rounded, stepped), 1.0);

  // A window resets the bf16 tensors; load_into_model makes the model compute on them again.
  weights.tensors()[0].fill_(0.5);
  weights.load_into_model();
  EXPECT_TRUE(on_grid());
}

TEST(ExampleModel, WeightFilesRoundTripAndRefuseMismatches) {
  TempDir dir;
  const auto path = dir.path() / "w.safetensors";
  TransformerLM a(small_config(), 1);
  save_weights(a, path, {{"what", "test"}});
  TransformerLM b(small_config(), 2);
  ASSERT_NE(a.weights_digest(), b.weights_digest());
  load_weights(b, path);
  EXPECT_EQ(a.weights_digest(), b.weights_digest());
  // Another architecture: refused before any weight changes.
  ModelConfig other = small_config();
  other.d_ff = 128;
  TransformerLM c(other, 3);
  const auto digest = c.weights_digest();
  EXPECT_THROW(load_weights(c, path), ProtocolError);
  EXPECT_EQ(c.weights_digest(), digest);
  // Standard safetensors layout: one F32 tensor per parameter.
  io::SafetensorsReader reader(path);
  EXPECT_EQ(reader.tensors().size(), a.parameter_names().size());
  EXPECT_EQ(reader.metadata().at("what"), "test");
}

TEST(ExampleModel, WeightFilesOpenInPythonSafetensors) {
  TempDir dir;
  const auto path = dir.path() / "w.safetensors";
  TransformerLM model(small_config(), 4);
  const io::Metadata metadata{{"format", "test"}, {"model_config", small_config().describe()}};
  save_weights(model, path, metadata);
  std::vector<io::test::ExpectedTensor> expected;
  const auto names = model.parameter_names();
  const auto parameters = model.parameters();
  for (std::size_t i = 0; i < names.size(); ++i) {
    io::test::ExpectedTensor tensor{names[i], io::TensorDType::f32, {}, {}};
    for (const auto dim : parameters[i].sizes())
      tensor.shape.push_back(static_cast<std::uint64_t>(dim));
    const auto* bytes = static_cast<const std::byte*>(parameters[i].data_ptr());
    tensor.bytes.assign(bytes, bytes + parameters[i].nbytes());
    expected.push_back(std::move(tensor));
  }
  io::test::write_expectation(dir.path() / "w.json", metadata, expected);
  EXPECT_EQ(io::test::run_safetensors_checker("check", path, dir.path() / "w.json"), 0);
}

TEST(ExamplePretrain, CachesAndRebuildsOnMismatchOrDamage) {
  TempDir dir;
  PretrainOptions options;
  options.seed = 77;
  options.steps = 3;
  options.batch_size = 2;
  options.warmup_steps = 1;
  options.eval_batch_size = 4;
  options.log_every = 0;
  options.cache_dir = dir.path() / "cache";
  const ModelConfig config = small_config();

  TransformerLM first(config, options.seed);
  const PretrainResult trained = load_or_pretrain(first, options);
  EXPECT_FALSE(trained.loaded_from_cache);
  EXPECT_TRUE(trained.rebuild_reason.empty());
  EXPECT_TRUE(std::filesystem::exists(trained.checkpoint));
  EXPECT_EQ(trained.checkpoint, pretrain_cache_path(config, options));
  EXPECT_LT(trained.eval_loss_final, trained.eval_loss_initial);

  TransformerLM second(config, options.seed);
  const PretrainResult loaded = load_or_pretrain(second, options);
  EXPECT_TRUE(loaded.loaded_from_cache);
  EXPECT_EQ(second.weights_digest(), first.weights_digest());
  EXPECT_EQ(loaded.eval_loss_initial, trained.eval_loss_initial);
  EXPECT_EQ(loaded.eval_loss_final, trained.eval_loss_final);

  // A different identity uses another file.
  PretrainOptions longer = options;
  longer.steps = 4;
  EXPECT_NE(pretrain_cache_path(config, longer), trained.checkpoint);

  // A damaged cache is rebuilt (and the result is the same pretrained state).
  const std::string bytes = io::test::read_file_bytes(trained.checkpoint);
  io::test::write_file_bytes(trained.checkpoint, bytes.substr(0, bytes.size() - 5));
  TransformerLM third(config, options.seed);
  const PretrainResult rebuilt = load_or_pretrain(third, options);
  EXPECT_FALSE(rebuilt.loaded_from_cache);
  EXPECT_FALSE(rebuilt.rebuild_reason.empty());
  EXPECT_EQ(third.weights_digest(), first.weights_digest());

  // A file under the right name whose metadata says otherwise is not trusted.
  TransformerLM impostor(config, options.seed);
  save_weights(impostor, trained.checkpoint, {{"format", "something else"}});
  TransformerLM fourth(config, options.seed);
  const PretrainResult rebuilt_again = load_or_pretrain(fourth, options);
  EXPECT_FALSE(rebuilt_again.loaded_from_cache);
  EXPECT_NE(rebuilt_again.rebuild_reason.find("expected"), std::string::npos)
      << rebuilt_again.rebuild_reason;
  EXPECT_EQ(fourth.weights_digest(), first.weights_digest());

  // The model must have been built with the pretraining seed.
  TransformerLM wrong_seed(config, options.seed + 1);
  EXPECT_THROW((void)load_or_pretrain(wrong_seed, options), InvalidArgument);
}

}  // namespace
}  // namespace pulseloco::example
