// The libtorch adapter's optimizer files: an optimizer's state saved with a checkpoint
// (optimizer_file) comes back identical (load_optimizer), and one flipped bit in it is an
// error on every rank that names the file, before any state changes.
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <pulseloco/torch.h>
#include "engine/engine_test_util.h"

namespace pulseloco {
namespace {

namespace fs = std::filesystem;
constexpr int kWorld = 2;

// One rank's model, its AdamW optimizer (with state after a step) and its synchronizer.
struct Rank {
  torch::nn::Linear model{torch::nn::Linear(8, 4)};
  std::unique_ptr<torch::optim::AdamW> optimizer;
  std::unique_ptr<libtorch::Synchronizer> sync;
};

// AdamW's first moments of every parameter, copied.
std::vector<torch::Tensor> first_moments(torch::optim::AdamW& optimizer) {
  std::vector<torch::Tensor> moments;
  for (const auto& parameter : optimizer.param_groups()[0].params()) {
    const auto& state = static_cast<torch::optim::AdamWParamState&>(
        *optimizer.state().at(c10::guts::to_string(parameter.unsafeGetTensorImpl())));
    moments.push_back(state.exp_avg().clone());
  }
  return moments;
}

void step(Rank& rank, int seed) {
  torch::manual_seed(seed);
  rank.optimizer->zero_grad();
  rank.model->forward(torch::randn({16, 8})).pow(2).mean().backward();
  rank.optimizer->step();
}

TEST(TorchCheckpoint, TheOptimizerStateComesBackAndAFlippedBitInItIsNamedOnEveryRank) {
  const fs::path root = testing::fresh_test_dir("torch_optimizer");
  std::vector<Rank> ranks(kWorld);
  auto transports = transport::inproc::make_group(kWorld);
  EngineOptions options;
  options.steps_per_window = 1;
  testing::rethrow_first(testing::run_ranks(kWorld, [&](int r) {
    Rank& rank = ranks[static_cast<std::size_t>(r)];
    rank.optimizer = std::make_unique<torch::optim::AdamW>(rank.model->parameters());
    rank.sync = std::make_unique<libtorch::Synchronizer>(
        rank.model->named_parameters(), options,
        std::move(transports[static_cast<std::size_t>(r)]));
    step(rank, 10 + r);
    (void)rank.sync->after_optimizer_step();
    (void)rank.sync->save_checkpoint(root, {.files = {libtorch::optimizer_file(*rank.optimizer)}});
  }));
  std::vector<std::vector<torch::Tensor>> saved;
  for (Rank& rank : ranks)
    saved.push_back(first_moments(*rank.optimizer));
  for (Rank& rank : ranks)
    step(rank, 20);  // the optimizers move on

  // One flipped bit in rank 1's optimizer file: every rank fails naming it; nothing changes.
  const fs::path file = root / "window-000001" / "rank-00001.optimizer.pt";
  const std::string original = testing::file_bytes(file);
  std::string flipped = original;
  flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x20);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << flipped;
  const std::vector<Digest> digests_before{ranks[0].sync->engine().state_digest(),
                                           ranks[1].sync->engine().state_digest()};
  const auto errors = testing::run_ranks(
      kWorld, [&](int r) { (void)ranks[static_cast<std::size_t>(r)].sync->load_checkpoint(root); });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r;
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::protocol) << e.what();
      EXPECT_NE(std::string(e.what()).find(file.string() + ": the file is damaged"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(ranks[static_cast<std::size_t>(r)].sync->engine().state_digest(),
              digests_before[static_cast<std::size_t>(r)]);
  }

  // Intact, it restores each rank's optimizer to the state it had when saved.
  std::ofstream(file, std::ios::binary | std::ios::trunc) << original;
  testing::rethrow_first(testing::run_ranks(kWorld, [&](int r) {
    Rank& rank = ranks[static_cast<std::size_t>(r)];
    const LoadedCheckpoint loaded = rank.sync->load_checkpoint(root);
    libtorch::load_optimizer(*rank.optimizer, loaded);
    EXPECT_THROW(libtorch::load_optimizer(*rank.optimizer, loaded, "missing.pt"), InvalidArgument);
  }));
  for (int r = 0; r < kWorld; ++r) {
    const auto restored = first_moments(*ranks[static_cast<std::size_t>(r)].optimizer);
    ASSERT_EQ(restored.size(), saved[static_cast<std::size_t>(r)].size());
    for (std::size_t i = 0; i < restored.size(); ++i)
      EXPECT_TRUE(torch::equal(restored[i], saved[static_cast<std::size_t>(r)][i]))
          << "rank " << r << " parameter " << i;
  }
  fs::remove_all(root);
}

}  // namespace
}  // namespace pulseloco
