// PULSELOCO_FAULT: every field of its syntax parses, bad input is refused with a message that
// names what was wrong, and an engine started with it fails at the window phase it names.
#include <pulseloco/engine/fault_injection.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/transport/inproc/inproc.h>
#include "engine/engine_test_util.h"

namespace pulseloco {
namespace {

std::string error_of(std::string_view text) {
  try {
    (void)parse_fault_plan(text);
  } catch (const InvalidArgument& error) {
    return error.what();
  }
  return "no error";
}

TEST(FaultPlan, ParsesEveryField) {
  const FaultPlan plan =
      parse_fault_plan(" window=12 , phase=aggregate,action=disconnect,rank=3,worker=w7");
  EXPECT_EQ(plan.window, 12u);
  EXPECT_EQ(plan.phase, WindowPhase::aggregate);
  EXPECT_EQ(plan.action, FaultAction::disconnect);
  EXPECT_EQ(plan.rank, 3);
  EXPECT_EQ(plan.worker, "w7");
  EXPECT_TRUE(plan.matches(12, WindowPhase::aggregate, 3, "w7"));
  EXPECT_FALSE(plan.matches(12, WindowPhase::aggregate, 2, "w7"));
  EXPECT_FALSE(plan.matches(12, WindowPhase::gate, 3, "w7"));
  EXPECT_FALSE(plan.matches(12, WindowPhase::aggregate, 3, "w6"));
}

TEST(FaultPlan, EveryNameParsesBackToItsValue) {
  for (const WindowPhase phase : {WindowPhase::gate, WindowPhase::exchange, WindowPhase::aggregate,
                                  WindowPhase::checkpoint}) {
    const auto text = "window=0,action=kill,phase=" + std::string(window_phase_name(phase));
    EXPECT_EQ(parse_fault_plan(text).phase, phase) << text;
  }
  for (const FaultAction action :
       {FaultAction::kill, FaultAction::stall, FaultAction::disconnect, FaultAction::enospc}) {
    const auto text = "window=0,phase=checkpoint,action=" + std::string(fault_action_name(action));
    EXPECT_EQ(parse_fault_plan(text).action, action) << text;
  }
}

TEST(FaultPlan, BadInputIsRefusedNamingWhatWasWrong) {
  EXPECT_EQ(
      error_of("window=1,phase=apply,action=kill"),
      "invalid argument: PULSELOCO_FAULT: phase 'apply' is not one of gate, exchange, aggregate, "
      "checkpoint");
  EXPECT_EQ(
      error_of("window=1,phase=gate,action=crash"),
      "invalid argument: PULSELOCO_FAULT: action 'crash' is not one of kill, stall, disconnect, "
      "enospc");
  EXPECT_EQ(error_of("window=1,phase=gate,action=enospc"),
            "invalid argument: PULSELOCO_FAULT: action=enospc needs phase=checkpoint");
  EXPECT_NE(error_of("window=-1,phase=gate,action=kill").find("window='-1'"), std::string::npos);
  EXPECT_NE(error_of("window=1,phase=gate,action=kill,color=red").find("unknown key 'color'"),
            std::string::npos);
  EXPECT_NE(error_of("window=1,phase").find("'phase' is not key=value"), std::string::npos);
  EXPECT_NE(error_of("window=1,phase=gate").find("needs window=, phase= and action="),
            std::string::npos);
}

using testing::ScopedVariable;

// Rank 1 aborts its transport once another rank's message of window 1 has arrived: no rank
// may commit window 1 (rank 1 never votes), every state stays as it was, and the window run
// again in a new group gives the reference's result (the fault fires once), whichever exchange
// the windows run.
class FaultInjectionInExchange : public ::testing::TestWithParam<Exchange> {};

TEST_P(FaultInjectionInExchange, ADisconnectFailsTheWindowEverywhereAndARetryMatchesTheReference) {
  EngineOptions options = testing::small_options();
  options.exchange = GetParam();
  const float lr = 3e-5f;
  const int world = 3;
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({37, 3000, 4097}, DType::float32, r == 0 ? 7 : 100 + r));
  std::vector<std::unique_ptr<Engine>> engines(world);
  {
    const ScopedVariable fault("PULSELOCO_FAULT",
                               "window=1,phase=exchange,action=disconnect,rank=1");
    for (std::size_t r = 0; r < engines.size(); ++r)
      engines[r] = std::make_unique<Engine>(testing::views_of(models[r]), options);
  }
  auto attach_all = [&](std::uint64_t generation) {
    auto transports = transport::inproc::make_group(world);
    testing::rethrow_first(testing::run_ranks(world, [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      engines[i]->attach(std::move(transports[i]), GroupInfo{generation, {}});
    }));
  };
  auto run_window = [&] {
    return testing::run_ranks(
        world, [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); });
  };
  attach_all(1);
  testing::ReferenceState reference = testing::reference_start(models[0], world);
  std::vector<testing::LocalModel> reference_models = models;
  auto train = [&](std::uint32_t seed) {
    for (std::size_t r = 0; r < models.size(); ++r) {
      testing::local_training(models[r], lr, 4, seed + static_cast<std::uint32_t>(r));
      testing::local_training(reference_models[r], lr, 4, seed + static_cast<std::uint32_t>(r));
    }
  };
  train(10);
  testing::rethrow_first(run_window());
  testing::reference_window(reference, reference_models, options.outer_lr, options.outer_momentum);

  train(20);
  std::vector<Digest> digests_before;
  for (const auto& engine : engines)
    digests_before.push_back(engine->state_digest());
  const auto errors = run_window();
  for (std::size_t r = 0; r < engines.size(); ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r << " committed a window rank 1 never voted on";
    EXPECT_EQ(engines[r]->committed_windows(), 1u);
    EXPECT_EQ(engines[r]->state_digest(), digests_before[r]) << "rank " << r;
    EXPECT_FALSE(engines[r]->take_committed_report());
  }
  try {
    std::rethrow_exception(errors[1]);
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::aborted) << error.what();
  }

  attach_all(2);
  testing::rethrow_first(run_window());
  testing::reference_window(reference, reference_models, options.outer_lr, options.outer_momentum);
  for (std::size_t r = 0; r < engines.size(); ++r) {
    EXPECT_EQ(engines[r]->committed_windows(), 2u);
    for (std::size_t t = 0; t < reference.global.size(); ++t) {
      const auto global = engines[r]->global_weights(t);
      const auto residual = engines[r]->residual(t);
      EXPECT_TRUE(std::equal(global.begin(), global.end(), reference.global[t].begin()))
          << "θ_g of rank " << r << " tensor " << t;
      EXPECT_TRUE(std::equal(residual.begin(), residual.end(), reference.residual[r][t].begin()))
          << "e of rank " << r << " tensor " << t;
      EXPECT_EQ(models[r][t].f32, reference_models[r][t].f32) << "θ_l of rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Exchanges, FaultInjectionInExchange,
                         ::testing::Values(Exchange::allgather, Exchange::reduction),
                         [](const ::testing::TestParamInfo<Exchange>& param) {
                           return std::string(exchange_name(param.param));
                         });

}  // namespace
}  // namespace pulseloco
