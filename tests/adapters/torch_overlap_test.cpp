// The libtorch adapter with overlapped windows: each boundary applies the window before it, the
// replicas' digests agree at every boundary, and complete_in_flight() applies the last window
// and writes the global weights into every rank's parameters.
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pulseloco/torch.h>
#include "engine/engine_test_util.h"

// A namespace of its own: the adapter's tests may be built as one unity source.
namespace pulseloco::torch_overlap {
namespace {

constexpr int kWorld = 2;
constexpr int kBoundaries = 3;
constexpr std::uint32_t kInnerSteps = 2;

// One rank's model, optimizer and synchronizer, and the report of each boundary.
struct Rank {
  torch::nn::Linear model{torch::nn::Linear(8, 4)};
  std::unique_ptr<torch::optim::SGD> optimizer;
  std::unique_ptr<libtorch::Synchronizer> sync;
  std::vector<WindowReport> reports;
  std::optional<WindowReport> completed;
  std::optional<WindowReport> completed_again;
};

// A step on data of this rank's own (no random generator: the ranks run on threads).
void step(Rank& rank, int r, int index) {
  rank.optimizer->zero_grad();
  const auto x = torch::sin(torch::arange(128, torch::kFloat32).reshape({16, 8}) *
                            static_cast<float>(1 + r + 3 * index));
  rank.model->forward(x).pow(2).mean().backward();
  rank.optimizer->step();
}

class TorchOverlap : public ::testing::TestWithParam<Overlap> {};

TEST_P(TorchOverlap, BoundariesApplyThePreviousWindowAndCompleteInFlightAppliesTheLast) {
  std::vector<Rank> ranks(kWorld);
  auto transports = transport::inproc::make_group(kWorld);
  EngineOptions options;
  options.steps_per_window = kInnerSteps;
  options.overlap = GetParam();
  testing::rethrow_first(testing::run_ranks(kWorld, [&](int r) {
    Rank& rank = ranks[static_cast<std::size_t>(r)];
    rank.optimizer = std::make_unique<torch::optim::SGD>(rank.model->parameters(),
                                                         torch::optim::SGDOptions(0.05));
    rank.sync = std::make_unique<libtorch::Synchronizer>(
        rank.model->named_parameters(), options,
        std::move(transports[static_cast<std::size_t>(r)]));
    for (int s = 0; s < kBoundaries * static_cast<int>(kInnerSteps); ++s) {
      step(rank, r, s);
      if (auto report = rank.sync->after_optimizer_step()) rank.reports.push_back(*report);
    }
    EXPECT_TRUE(rank.sync->engine().window_in_flight());
    rank.completed = rank.sync->complete_in_flight();
    EXPECT_FALSE(rank.sync->engine().window_in_flight());
    rank.completed_again = rank.sync->complete_in_flight();
  }));

  for (int b = 0; b < kBoundaries; ++b) {
    const auto i = static_cast<std::size_t>(b);
    for (const Rank& rank : ranks) {
      ASSERT_EQ(rank.reports.size(), static_cast<std::size_t>(kBoundaries));
      const WindowReport& report = rank.reports[i];
      EXPECT_EQ(report.window, i);
      EXPECT_EQ(report.overlap, GetParam());
      EXPECT_TRUE(report.replicas_identical);
      if (b == 0) {
        EXPECT_FALSE(report.applied_window.has_value());
      } else {
        EXPECT_EQ(report.applied_window, std::optional<std::uint64_t>(i - 1));
      }
      EXPECT_EQ(report.digest, ranks[0].reports[i].digest) << "boundary " << b;
    }
  }
  // The models trained on different data: the applied windows changed θ_g.
  EXPECT_NE(ranks[0].reports.front().digest, ranks[0].reports.back().digest);

  for (Rank& rank : ranks) {
    ASSERT_TRUE(rank.completed.has_value());
    EXPECT_EQ(rank.completed->window, static_cast<std::uint64_t>(kBoundaries - 1));
    EXPECT_EQ(rank.completed->applied_window, std::optional<std::uint64_t>(kBoundaries - 1));
    EXPECT_EQ(rank.completed->digest, ranks[0].completed->digest);
    EXPECT_FALSE(rank.completed_again.has_value()) << "nothing was in flight any more";
    EXPECT_EQ(rank.sync->engine().committed_windows(), static_cast<std::uint64_t>(kBoundaries));
    // The parameters restart from θ_g (fp32: the same values) on every rank.
    const auto parameters = rank.model->parameters();
    for (std::size_t t = 0; t < parameters.size(); ++t) {
      const std::vector<float> global =
          rank.sync->engine().copy_state(Engine::StateTensor::global_weights, t);
      const auto expected = torch::from_blob(const_cast<float*>(global.data()),
                                             {static_cast<std::int64_t>(global.size())});
      EXPECT_TRUE(torch::equal(parameters[t].detach().reshape({-1}), expected)) << "tensor " << t;
      EXPECT_TRUE(torch::equal(parameters[t], ranks[0].model->parameters()[t])) << "tensor " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, TorchOverlap,
                         ::testing::Values(Overlap::delayed, Overlap::eager),
                         [](const auto& variant) {
                           return std::string(overlap_name(variant.param));
                         });

}  // namespace
}  // namespace pulseloco::torch_overlap
