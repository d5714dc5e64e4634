// The window engine end to end over an in-process group: bit-identity with the scalar reference
// of docs/algorithm.md, replicas identical, atomic failure, start-up checks, dense modes.
#include <pulseloco/engine/engine.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <future>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/inproc/inproc.h>
#include "base/log_capture.h"
#include "engine/engine_test_util.h"

namespace pulseloco {
namespace {

using testing::LocalModel;
using testing::ReferenceState;
using testing::small_options;

void expect_matches_reference(const std::vector<std::unique_ptr<Engine>>& engines,
                              const ReferenceState& reference,
                              const std::vector<LocalModel>& models,
                              const std::vector<LocalModel>& reference_models) {
  for (std::size_t r = 0; r < engines.size(); ++r) {
    for (std::size_t t = 0; t < reference.global.size(); ++t) {
      const auto global = engines[r]->global_weights(t);
      const auto momentum = engines[r]->momentum(t);
      const auto residual = engines[r]->residual(t);
      ASSERT_EQ(global.size(), reference.global[t].size());
      ASSERT_EQ(0, std::memcmp(global.data(), reference.global[t].data(), global.size_bytes()))
          << "θ_g of rank " << r << " tensor " << t;
      ASSERT_EQ(0,
                std::memcmp(momentum.data(), reference.momentum[t].data(), momentum.size_bytes()))
          << "m of rank " << r << " tensor " << t;
      ASSERT_EQ(
          0, std::memcmp(residual.data(), reference.residual[r][t].data(), residual.size_bytes()))
          << "e of rank " << r << " tensor " << t;
      const auto& local = models[r][t];
      const auto& expected_local = reference_models[r][t];
      ASSERT_EQ(local.f32, expected_local.f32) << "θ_l of rank " << r << " tensor " << t;
      ASSERT_EQ(local.bf16, expected_local.bf16) << "θ_l of rank " << r << " tensor " << t;
    }
  }
}

struct PulseCase {
  int world;
  DType dtype;
  kernels::Bf16Delta bf16_delta = kernels::Bf16Delta::exact;
  codec::Encoding encoding = codec::Encoding::pulse;
  Exchange exchange = Exchange::automatic;
};

void PrintTo(const PulseCase& c, std::ostream* out) {
  *out << "world " << c.world << ", " << dtype_name(c.dtype) << ", bf16_delta "
       << kernels::bf16_delta_name(c.bf16_delta) << ", encoding "
       << codec::encoding_name(c.encoding) << ", exchange " << exchange_name(c.exchange);
}

class EnginePulse : public ::testing::TestWithParam<PulseCase> {};

TEST_P(EnginePulse, MatchesTheReferenceBitForBitOverSeveralWindows) {
  const auto [world, dtype, bf16_delta, encoding, exchange] = GetParam();
  // Sizes: empty, one element, odd, several chunks, a non-multiple of the chunk size.
  const std::vector<std::uint64_t> sizes{0, 1, 37, 3000, 4097};
  const float lr = dtype == DType::float32 ? 3e-5f : 3e-3f;  // bf16 models need visible steps
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r) {
    models.push_back(testing::make_model(sizes, dtype, r == 0 ? 7 : 1000 + r));  // rank 0 wins
  }
  EngineOptions options = small_options();
  options.bf16_delta = bf16_delta;
  options.codec.encoding = encoding;
  options.exchange = exchange;
  auto engines = testing::start_engines(models, options);
  // After start-up every replica holds rank 0's weights.
  for (int r = 1; r < world; ++r) {
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      ASSERT_EQ(models[static_cast<std::size_t>(r)][t].f32, models[0][t].f32);
      ASSERT_EQ(models[static_cast<std::size_t>(r)][t].bf16, models[0][t].bf16);
    }
  }
  ReferenceState reference = testing::reference_start(models[0], world);
  std::vector<LocalModel> reference_models = models;

  for (int window = 0; window < 4; ++window) {
    for (int r = 0; r < world; ++r) {
      const auto seed = static_cast<std::uint32_t>(100 * window + r);
      testing::local_training(models[static_cast<std::size_t>(r)], lr, 4, seed);
      testing::local_training(reference_models[static_cast<std::size_t>(r)], lr, 4, seed);
    }
    std::vector<WindowReport> reports(static_cast<std::size_t>(world));
    testing::rethrow_first(testing::run_ranks(world, [&](int r) {
      reports[static_cast<std::size_t>(r)] = engines[static_cast<std::size_t>(r)]->run_window();
    }));
    testing::reference_window(reference, reference_models, options.outer_lr, options.outer_momentum,
                              bf16_delta);
    expect_matches_reference(engines, reference, models, reference_models);
    for (const auto& report : reports) {
      EXPECT_EQ(report.window, static_cast<std::uint64_t>(window));
      EXPECT_TRUE(report.replicas_identical);
      EXPECT_EQ(report.rank_digests.size(), static_cast<std::size_t>(world));
      EXPECT_EQ(report.digest, reports[0].digest);
      EXPECT_GT(report.entries_sent, 0u);
      EXPECT_LT(report.density, 1.0);
      EXPECT_EQ(report.diloco_bytes, report.parameters * 4);
      EXPECT_EQ(report.ddp_bytes, report.parameters * 4 * options.steps_per_window);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    WorldsAndDtypes, EnginePulse,
    ::testing::Values(
        PulseCase{1, DType::float32}, PulseCase{2, DType::float32}, PulseCase{3, DType::bfloat16},
        PulseCase{4, DType::float32}, PulseCase{5, DType::bfloat16},
        PulseCase{2, DType::float32, kernels::Bf16Delta::authors},
        PulseCase{3, DType::bfloat16, kernels::Bf16Delta::authors},
        PulseCase{4, DType::bfloat16, kernels::Bf16Delta::authors},
        // Values coded against θ_g: the same bits, over both exchange kinds.
        PulseCase{2, DType::float32, kernels::Bf16Delta::exact, codec::Encoding::context},
        PulseCase{3, DType::bfloat16, kernels::Bf16Delta::authors, codec::Encoding::context},
        PulseCase{4, DType::bfloat16, kernels::Bf16Delta::exact, codec::Encoding::context,
                  Exchange::reduction},
        // The owners' sums coded less their residue multiples.
        PulseCase{4, DType::bfloat16, kernels::Bf16Delta::authors, codec::Encoding::context,
                  Exchange::reduction},
        PulseCase{3, DType::float32, kernels::Bf16Delta::exact, codec::Encoding::context,
                  Exchange::allgather}),
    [](const ::testing::TestParamInfo<PulseCase>& param_info) {
      const PulseCase& c = param_info.param;
      std::string name = "R" + std::to_string(c.world) + "_" + std::string(dtype_name(c.dtype));
      if (c.bf16_delta == kernels::Bf16Delta::authors) name += "_authors";
      if (c.encoding != codec::Encoding::pulse)
        name += "_" + std::string(codec::encoding_name(c.encoding));
      if (c.exchange != Exchange::automatic) name += "_" + std::string(exchange_name(c.exchange));
      return name;
    });

// The two definitions of Δ on the same run: bf16 local weights take different trajectories from
// the first window after θ_g left the bf16 grid (`authors` carries the cast residue); fp32 local
// weights give the same bits with either choice.
TEST(Engine, Bf16DeltaChoicesDifferOnBf16WeightsAndCoincideOnFp32) {
  constexpr int kWorld = 3;
  constexpr int kWindows = 3;
  const std::vector<std::uint64_t> sizes{3000, 4097};
  for (DType dtype : {DType::float32, DType::bfloat16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    std::vector<std::vector<float>> final_global[2];
    std::uint64_t sent[2] = {0, 0};
    for (int c = 0; c < 2; ++c) {
      EngineOptions options = small_options();
      options.bf16_delta = c == 0 ? kernels::Bf16Delta::exact : kernels::Bf16Delta::authors;
      std::vector<LocalModel> models;
      for (int r = 0; r < kWorld; ++r)
        models.push_back(testing::make_model(sizes, dtype, r == 0 ? 7 : 1000 + r));
      auto engines = testing::start_engines(models, options);
      const float lr = dtype == DType::float32 ? 3e-5f : 3e-3f;
      for (int window = 0; window < kWindows; ++window) {
        std::vector<WindowReport> reports(kWorld);
        testing::rethrow_first(testing::run_ranks(kWorld, [&](int r) {
          const auto index = static_cast<std::size_t>(r);
          testing::local_training(models[index], lr, 4,
                                  static_cast<std::uint32_t>(100 * window + r));
          reports[index] = engines[index]->run_window();
        }));
        for (const WindowReport& report : reports) {
          EXPECT_TRUE(report.replicas_identical);
          sent[c] += report.entries_sent;
        }
      }
      for (std::size_t t = 0; t < sizes.size(); ++t) {
        const auto global = engines[0]->global_weights(t);
        final_global[c].emplace_back(global.begin(), global.end());
      }
    }
    if (dtype == DType::float32) {
      EXPECT_EQ(final_global[0], final_global[1]);
      EXPECT_EQ(sent[0], sent[1]);
    } else {
      EXPECT_NE(final_global[0], final_global[1]);
    }
  }
}

TEST(Engine, AfterOptimizerStepRunsAWindowEveryHSteps) {
  std::vector<LocalModel> models{testing::make_model({100}, DType::float32, 1),
                                 testing::make_model({100}, DType::float32, 2)};
  auto options = small_options();
  options.steps_per_window = 3;
  auto engines = testing::start_engines(models, options);
  testing::rethrow_first(testing::run_ranks(2, [&](int r) {
    Engine& engine = *engines[static_cast<std::size_t>(r)];
    for (int step = 1; step <= 7; ++step) {
      EXPECT_EQ(engine.next_step_runs_window(), step % 3 == 0);
      const auto report = engine.after_optimizer_step();
      EXPECT_EQ(report.has_value(), step % 3 == 0) << "step " << step;
    }
    EXPECT_EQ(engine.committed_windows(), 2u);
  }));
}

// A training loop written against WindowRunner drives an Engine as it drives an ElasticEngine
// (tests/elastic/elastic_engine_test.cpp runs one through the same interface).
TEST(Engine, IsAWindowRunnerWhoseEngineIsItself) {
  std::vector<LocalModel> models{testing::make_model({100}, DType::float32, 1),
                                 testing::make_model({100}, DType::float32, 2)};
  auto options = small_options();
  options.steps_per_window = 2;
  auto engines = testing::start_engines(models, options);
  testing::rethrow_first(testing::run_ranks(2, [&](int r) {
    WindowRunner& runner = *engines[static_cast<std::size_t>(r)];
    EXPECT_EQ(&runner.engine(), engines[static_cast<std::size_t>(r)].get());
    EXPECT_FALSE(runner.after_optimizer_step());
    const std::optional<WindowReport> first = runner.after_optimizer_step();
    ASSERT_TRUE(first);
    EXPECT_EQ(first->window, 0u);
    EXPECT_EQ(runner.run_window().window, 1u);
    EXPECT_FALSE(runner.complete_in_flight());  // blocking: nothing in flight
    EXPECT_EQ(runner.engine().committed_windows(), 2u);
  }));
}

TEST(Engine, OnReportReceivesEveryReportTheEngineReturns) {
  std::vector<LocalModel> models{testing::make_model({100}, DType::float32, 1),
                                 testing::make_model({100}, DType::float32, 2)};
  std::vector<std::vector<std::uint64_t>> received(2);
  std::vector<EngineOptions> options(2, small_options());
  for (int r = 0; r < 2; ++r) {
    options[static_cast<std::size_t>(r)].steps_per_window = 2;
    options[static_cast<std::size_t>(r)].on_report = [&received, r](const WindowReport& report) {
      received[static_cast<std::size_t>(r)].push_back(report.window);
    };
  }
  auto transports = transport::inproc::make_group(2);
  std::vector<std::unique_ptr<Engine>> engines(2);
  testing::rethrow_first(testing::run_ranks(2, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    engines[i] = std::make_unique<Engine>(testing::views_of(models[i]), options[i],
                                          std::move(transports[i]));
    Engine& engine = *engines[i];
    for (int step = 0; step < 4; ++step)
      (void)engine.after_optimizer_step();
    (void)engine.run_window();
    EXPECT_FALSE(engine.complete_in_flight());  // blocking: nothing in flight, nothing delivered
  }));
  for (const auto& windows : received)
    EXPECT_EQ(windows, (std::vector<std::uint64_t>{0, 1, 2}));
}

// Builds an engine on each of `world` ranks of one in-process group (a 10-element model each),
// with small_options() as `adjust(rank, options)` changes them; returns each rank's error.
std::vector<std::exception_ptr> construction_errors(
    int world, const std::function<void(int, EngineOptions&)>& adjust) {
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({10}, DType::float32, static_cast<std::uint32_t>(r + 1)));
  auto transports = transport::inproc::make_group(world);
  return testing::run_ranks(world, [&](int r) {
    auto options = small_options();
    adjust(r, options);
    Engine engine(testing::views_of(models[static_cast<std::size_t>(r)]), options,
                  std::move(transports[static_cast<std::size_t>(r)]));
  });
}

TEST(Engine, MismatchedOptionsAreRejectedNamingTheRanks) {
  const auto errors = construction_errors(3, [](int r, EngineOptions& options) {
    if (r == 2) options.outer_lr = 0.5f;
  });
  for (const auto& error : errors) {
    ASSERT_TRUE(error);
    try {
      std::rethrow_exception(error);
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.context().ranks, std::vector<int>{2}) << e.what();
      EXPECT_NE(std::string(e.what()).find("options"), std::string::npos) << e.what();
    }
  }
}

TEST(Engine, AnOptionMismatchNamesEachDifferingOptionWithEveryValueAndItsRanks) {
  const auto errors = construction_errors(4, [](int r, EngineOptions& options) {
    options.steps_per_window = r >= 2 ? 16 : 8;
    if (r == 3) options.allgather = collectives::CollectiveAlgorithm::direct;
  });
  for (const auto& error : errors) {
    ASSERT_TRUE(error);
    try {
      std::rethrow_exception(error);
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.context().ranks, (std::vector<int>{2, 3})) << e.what();
      const std::string what = e.what();
      EXPECT_NE(what.find("steps_per_window: ranks 0, 1 have 8, ranks 2, 3 have 16"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("allgather: ranks 0, 1, 2 have \"automatic\", rank 3 has \"direct\""),
                std::string::npos)
          << what;
      EXPECT_EQ(what.find("outer_lr"), std::string::npos) << what;
    }
  }
}

TEST(Engine, MismatchedTensorTablesNameTheFirstDifferingTensorOnBothRanks) {
  std::vector<LocalModel> models{testing::make_model({10, 5}, DType::float32, 1),
                                 testing::make_model({10, 6}, DType::float32, 2),
                                 testing::make_model({10, 5}, DType::bfloat16, 3),
                                 testing::make_model({10, 5}, DType::float32, 4)};
  auto transports = transport::inproc::make_group(4);
  const auto errors = testing::run_ranks(4, [&](int r) {
    Engine engine(testing::views_of(models[static_cast<std::size_t>(r)]), small_options(),
                  std::move(transports[static_cast<std::size_t>(r)]));
  });
  for (const auto& error : errors) {
    ASSERT_TRUE(error);
    try {
      std::rethrow_exception(error);
    } catch (const InvalidArgument& e) {
      EXPECT_EQ(e.context().ranks, (std::vector<int>{1, 2})) << e.what();
      const std::string what = e.what();
      EXPECT_NE(what.find("tensor 1: rank 0 has 'tensor1' (shape [5], 5 elements, float32), "
                          "rank 1 has 'tensor1' (shape [6], 6 elements, float32)"),
                std::string::npos)
          << what;
      EXPECT_NE(what.find("tensor 0: rank 0 has 'tensor0' (shape [10], 10 elements, float32), "
                          "rank 2 has 'tensor0' (shape [10], 10 elements, bfloat16)"),
                std::string::npos)
          << what;
    }
  }
}

TEST(Engine, BadOptionsAreRejectedBeforeAnyCommunication) {
  std::vector<LocalModel> models{testing::make_model({10}, DType::float32, 1)};
  auto options = small_options();
  options.steps_per_window = 0;
  auto transports = transport::inproc::make_group(1);
  EXPECT_THROW(Engine(testing::views_of(models[0]), options, std::move(transports[0])),
               InvalidArgument);
}

TEST(Engine, NonFinitePseudoGradientIsReportedAndNothingChanges) {
  std::vector<LocalModel> models{testing::make_model({50, 2000}, DType::float32, 1),
                                 testing::make_model({50, 2000}, DType::float32, 2)};
  auto options = small_options();
  options.timeout = std::chrono::milliseconds(2000);
  auto engines = testing::start_engines(models, options);
  testing::local_training(models[0], 1e-4f, 2, 11);
  testing::local_training(models[1], 1e-4f, 2, 12);
  models[1][1].f32[1234] = std::numeric_limits<float>::infinity();
  const std::vector<Digest> before{engines[0]->state_digest(), engines[1]->state_digest()};
  const auto residual_before =
      std::vector<float>(engines[0]->residual(1).begin(), engines[0]->residual(1).end());
  const auto errors = testing::run_ranks(
      2, [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); });
  ASSERT_TRUE(errors[1]);
  try {
    std::rethrow_exception(errors[1]);
  } catch (const NonFiniteError& e) {
    EXPECT_EQ(e.context().tensor, "tensor1");
    EXPECT_EQ(e.context().index, 1234u);
    EXPECT_EQ(e.context().rank, 1);
  }
  ASSERT_TRUE(errors[0]) << "the healthy rank must not commit a window its peer never joined";
  EXPECT_EQ(engines[0]->state_digest(), before[0]);
  EXPECT_EQ(engines[1]->state_digest(), before[1]);
  EXPECT_EQ(std::vector<float>(engines[0]->residual(1).begin(), engines[0]->residual(1).end()),
            residual_before);
  EXPECT_EQ(engines[0]->committed_windows(), 0u);
}

TEST(Engine, AContextCodedWindowWithAReceiverOfOtherWeightsIsRejectedNamingTheContext) {
  // Rank 1's θ_g differs from rank 0's (every weight of tensor 0 doubled, which changes its
  // exponents): rank 0's context frames decode on rank 1 to other entries, which the frames'
  // digests refuse, or their exponent groups do not fit rank 1's θ_g; the window commits
  // nowhere instead of applying them.
  const int world = 2;
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({3000, 17}, DType::float32, 60 + r));
  EngineOptions options = small_options();
  options.codec.encoding = codec::Encoding::context;
  options.timeout = std::chrono::milliseconds(2000);
  auto engines = testing::start_engines(models, options);
  for (int r = 0; r < world; ++r)
    testing::local_training(models[static_cast<std::size_t>(r)], 3e-5f, 4, 80 + r);
  const std::span<const float> global = engines[1]->global_weights(0);
  float* writable = const_cast<float*>(global.data());  // the replica diverges
  for (std::size_t i = 0; i < global.size(); ++i)
    writable[i] *= 2.0f;
  const auto errors = testing::run_ranks(
      world, [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " committed";
    EXPECT_EQ(engines[static_cast<std::size_t>(r)]->committed_windows(), 0u);
  }
  try {
    std::rethrow_exception(errors[1]);
  } catch (const ProtocolError& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what.find("value digest") != std::string::npos ||
                what.find("this receiver's context") != std::string::npos)
        << what;
    EXPECT_EQ(e.context().peer, 0);
  }
}

TEST(Engine, ACorruptedExchangeLeavesEveryStateUnchangedAndTheWindowCanBeRetried) {
  const int world = 3;
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r) {
    models.push_back(testing::make_model({3000, 17}, DType::float32, 50 + r));
  }
  auto faults = std::make_shared<transport::inproc::FaultInjector>();
  auto options = small_options();
  options.timeout = std::chrono::milliseconds(2000);
  auto engines = testing::start_engines(models, options, {.faults = faults});
  ReferenceState reference = testing::reference_start(models[0], world);
  std::vector<LocalModel> reference_models = models;
  for (int r = 0; r < world; ++r) {
    testing::local_training(models[static_cast<std::size_t>(r)], 3e-5f, 4, 70 + r);
    testing::local_training(reference_models[static_cast<std::size_t>(r)], 3e-5f, 4, 70 + r);
  }
  std::vector<Digest> before;
  for (const auto& engine : engines)
    before.push_back(engine->state_digest());
  const std::vector<LocalModel> models_before = models;

  // Corrupt the first large message rank 2 sends (its window message).
  faults->set_hook([](const transport::inproc::MessageEvent& m) {
    return m.from == 2 && m.bytes > 64 ? transport::inproc::FaultAction::corrupt
                                       : transport::inproc::FaultAction::deliver;
  });
  const auto errors = testing::run_ranks(
      world, [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); });
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " committed";
    EXPECT_EQ(engines[static_cast<std::size_t>(r)]->state_digest(),
              before[static_cast<std::size_t>(r)]);
    EXPECT_EQ(engines[static_cast<std::size_t>(r)]->committed_windows(), 0u);
    for (std::size_t t = 0; t < models[0].size(); ++t) {
      EXPECT_EQ(models[static_cast<std::size_t>(r)][t].f32,
                models_before[static_cast<std::size_t>(r)][t].f32);
    }
  }

  // A failed collective aborts the group. The ranks form a new one, attach to it (which checks
  // that they all still hold the same state), and the retried window gives exactly the
  // reference.
  auto fresh = transport::inproc::make_group(world);
  testing::rethrow_first(testing::run_ranks(world, [&](int r) {
    engines[static_cast<std::size_t>(r)]->attach(std::move(fresh[static_cast<std::size_t>(r)]));
    (void)engines[static_cast<std::size_t>(r)]->run_window();
  }));
  testing::reference_window(reference, reference_models, options.outer_lr, options.outer_momentum);
  expect_matches_reference(engines, reference, models, reference_models);
}

TEST(Engine, AMemberKilledInTheExchangeIsNamedByEverySurvivor) {
  // Rank 3 dies in the all-gather's completion round, after its `done` notices to ranks 0 and
  // 1 and before the one to rank 2: ranks 0 and 1 finish the all-gather, rank 2 fails in it and
  // leaves. Only then do ranks 0 and 1 start the next call (their first message of it waits in
  // the fault hook), where they find both rank 2 and rank 3 gone. Each survivor names rank 3.
  const int world = 4;
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({3000, 17}, DType::float32, 50 + r));
  auto faults = std::make_shared<transport::inproc::FaultInjector>();
  auto options = small_options();
  options.timeout = std::chrono::milliseconds(2000);
  auto engines = testing::start_engines(models, options, {.faults = faults});
  for (int r = 0; r < world; ++r)
    testing::local_training(models[static_cast<std::size_t>(r)], 3e-5f, 4, 70 + r);
  std::vector<Digest> before;
  for (const auto& engine : engines)
    before.push_back(engine->state_digest());

  // Tags: (sequence << 8) | phase (collectives/detail/packets.h); phase 1 is a call's header,
  // phase 2 its notices.
  const auto sequence_of = [](transport::Tag tag) { return (tag >> 8) & 0xFFFF'FFFFULL; };
  const auto phase_of = [](transport::Tag tag) { return tag & 0xFF; };
  std::atomic<std::int64_t> killed_in{-1};  // the all-gather's call number, once rank 3 is dead
  std::promise<void> rank2_failed;
  const std::shared_future<void> rank2_has_failed = rank2_failed.get_future().share();
  faults->set_hook([&](const transport::inproc::MessageEvent& m) {
    if (m.from == 3 && m.to == 2 && phase_of(m.tag) == 2) {
      killed_in = static_cast<std::int64_t>(sequence_of(m.tag));
      return transport::inproc::FaultAction::kill_sender;
    }
    const std::int64_t killed = killed_in.load();
    if (m.from < 2 && phase_of(m.tag) == 1 && killed >= 0 &&
        static_cast<std::int64_t>(sequence_of(m.tag)) == killed + 1) {
      (void)rank2_has_failed.wait_for(std::chrono::seconds(60));
    }
    return transport::inproc::FaultAction::deliver;
  });
  const auto errors = testing::run_ranks(world, [&](int r) {
    try {
      (void)engines[static_cast<std::size_t>(r)]->run_window();
    } catch (...) {
      if (r == 2) rank2_failed.set_value();  // its transport is closed by now
      throw;
    }
  });
  ASSERT_EQ(faults->injected().size(), 1u);
  for (int r = 0; r < world - 1; ++r) {
    const auto i = static_cast<std::size_t>(r);
    ASSERT_TRUE(errors[i]) << "rank " << r << " ran its window without rank 3";
    try {
      std::rethrow_exception(errors[i]);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::peer_lost) << "rank " << r << ": " << e.what();
      EXPECT_EQ(e.context().peer, 3) << "rank " << r << ": " << e.what();
    }
    EXPECT_EQ(engines[i]->state_digest(), before[i]) << "rank " << r;
    EXPECT_EQ(engines[i]->committed_windows(), 0u);
  }
}

TEST(Engine, DilocoModeKeepsReplicasIdenticalAndAveragesThePseudoGradient) {
  const int world = 3;
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r) {
    models.push_back(testing::make_model({5000, 3}, DType::float32, 90 + r));
  }
  auto options = small_options(Mode::diloco);
  auto engines = testing::start_engines(models, options);
  const std::vector<float> start(engines[0]->global_weights(0).begin(),
                                 engines[0]->global_weights(0).end());
  std::vector<std::vector<float>> deltas(world);
  for (int r = 0; r < world; ++r) {
    testing::local_training(models[static_cast<std::size_t>(r)], 1e-4f, 3, 200 + r);
    for (std::size_t i = 0; i < start.size(); ++i) {
      deltas[static_cast<std::size_t>(r)].push_back(start[i] -
                                                    models[static_cast<std::size_t>(r)][0].f32[i]);
    }
  }
  std::vector<WindowReport> reports(world);
  testing::rethrow_first(testing::run_ranks(world, [&](int r) {
    reports[static_cast<std::size_t>(r)] = engines[static_cast<std::size_t>(r)]->run_window();
  }));
  for (int r = 1; r < world; ++r) {
    EXPECT_EQ(reports[static_cast<std::size_t>(r)].digest, reports[0].digest);
    EXPECT_EQ(models[static_cast<std::size_t>(r)][0].f32, models[0][0].f32);
  }
  // First outer step: θ_g = θ_0 - lr * (1 + μ) * mean(Δ) (up to the summation order).
  const auto global = engines[0]->global_weights(0);
  for (std::size_t i = 0; i < start.size(); ++i) {
    const double mean = (static_cast<double>(deltas[0][i]) + deltas[1][i] + deltas[2][i]) / 3.0;
    const double expected = start[i] - 0.7 * 1.9 * mean;
    ASSERT_NEAR(global[i], expected, 1e-6) << i;
  }
  EXPECT_EQ(reports[0].payload_bytes, reports[0].parameters * 4);
  EXPECT_DOUBLE_EQ(reports[0].density, 1.0);
}

TEST(Engine, DdpModeAveragesGradientsAcrossRanks) {
  const int world = 3;
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r) {
    models.push_back(testing::make_model({3000, 10}, DType::float32, 300 + r));
  }
  auto options = small_options(Mode::ddp);
  options.steps_per_window = 2;
  auto engines = testing::start_engines(models, options);
  std::vector<std::vector<std::vector<float>>> grads(world);
  for (int r = 0; r < world; ++r) {
    for (const auto& t : models[static_cast<std::size_t>(r)]) {
      std::vector<float> g(t.numel());
      for (std::size_t i = 0; i < g.size(); ++i)
        g[i] = static_cast<float>(r + 1) * 0.25f;
      grads[static_cast<std::size_t>(r)].push_back(g);
    }
  }
  std::vector<std::optional<WindowReport>> reports(world);
  testing::rethrow_first(testing::run_ranks(world, [&](int r) {
    auto& mine = grads[static_cast<std::size_t>(r)];
    for (int step = 0; step < 2; ++step) {
      std::vector<TensorView> views;
      for (auto& g : mine)
        views.push_back({g.data(), g.size(), DType::float32, Device{}});
      engines[static_cast<std::size_t>(r)]->average_gradients(views);
      reports[static_cast<std::size_t>(r)] =
          engines[static_cast<std::size_t>(r)]->after_optimizer_step();
    }
  }));
  for (int r = 0; r < world; ++r) {
    for (const auto& g : grads[static_cast<std::size_t>(r)]) {
      for (float v : g)
        ASSERT_EQ(v, 0.5f);  // (0.25 + 0.5 + 0.75) / 3, exact
    }
    ASSERT_TRUE(reports[static_cast<std::size_t>(r)].has_value());
    EXPECT_EQ(reports[static_cast<std::size_t>(r)]->payload_bytes, 2 * 3010 * 4u);
  }
}

// Every rank's DivergenceError (a failure for a rank that raised none), for tests of a
// forgotten before_optimizer_step(): its message names the missing call and the ranks.
std::vector<DivergenceError> divergence_of_every_rank(
    const std::vector<std::exception_ptr>& errors) {
  std::vector<DivergenceError> divergences;
  for (std::size_t r = 0; r < errors.size(); ++r) {
    try {
      if (errors[r]) std::rethrow_exception(errors[r]);
      ADD_FAILURE() << "rank " << r << " raised nothing";
    } catch (const DivergenceError& e) {
      EXPECT_NE(std::string(e.what()).find("before_optimizer_step()"), std::string::npos)
          << e.what();
      divergences.push_back(e);
    }
  }
  return divergences;
}

// ddp without average_gradients() (a forgotten before_optimizer_step()): each rank steps on its
// own gradients, and the divergence names the missing call instead of an arbitrary majority.
TEST(Engine, DdpWithoutAveragedGradientsNamesTheMissingCallOnEveryRank) {
  const int world = 2;
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({3000, 10}, DType::float32, 300));
  auto options = small_options(Mode::ddp);
  options.steps_per_window = 2;
  auto engines = testing::start_engines(models, options);
  const auto divergences = divergence_of_every_rank(testing::run_ranks(world, [&](int r) {
    for (int step = 0; step < 2; ++step) {
      testing::local_training(models[static_cast<std::size_t>(r)], 0.01f, 1,
                              static_cast<std::uint32_t>(10 * r + step));
      (void)engines[static_cast<std::size_t>(r)]->after_optimizer_step();
    }
  }));
  ASSERT_EQ(divergences.size(), 2u);
  for (const DivergenceError& e : divergences) {
    const std::string what = e.what();
    EXPECT_NE(what.find("ranks 0, 1 did not call it on every optimizer step"), std::string::npos)
        << what;
    // Two ranks: neither digest is the right one.
    EXPECT_NE(what.find("no digest is held by a majority"), std::string::npos) << what;
    EXPECT_EQ(e.context().ranks, (std::vector<int>{0, 1})) << what;
  }
}

// The same mistake in a loop that runs its windows with run_window() (no optimizer step is
// counted): a rank that averaged nothing in the window is named all the same.
TEST(Engine, DdpWithoutAveragedGradientsIsNamedWhenWindowsRunByRunWindow) {
  const int world = 2;
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({3000, 10}, DType::float32, 300));
  auto engines = testing::start_engines(models, small_options(Mode::ddp));
  const auto divergences = divergence_of_every_rank(testing::run_ranks(world, [&](int r) {
    testing::local_training(models[static_cast<std::size_t>(r)], 0.01f, 1,
                            static_cast<std::uint32_t>(10 * r));
    (void)engines[static_cast<std::size_t>(r)]->run_window();
  }));
  ASSERT_EQ(divergences.size(), 2u);
  for (const DivergenceError& e : divergences)
    EXPECT_NE(std::string(e.what()).find("ranks 0, 1 did not call it"), std::string::npos)
        << e.what();
}

// Without averaging, replicas that happen to stay identical (here: no training at all) raise
// nothing, but the engine warns once that before_optimizer_step() was not called.
TEST(Engine, DdpWithoutAveragedGradientsWarnsOnceEvenWhenReplicasAgree) {
  const int world = 2;
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({100}, DType::float32, 7));
  auto options = small_options(Mode::ddp);
  options.steps_per_window = 2;
  auto engines = testing::start_engines(models, options);
  std::string log;
  {
    const testing::LogCapture capture(spdlog::level::warn);
    testing::rethrow_first(testing::run_ranks(world, [&](int r) {
      for (int step = 0; step < 4; ++step)
        (void)engines[static_cast<std::size_t>(r)]->after_optimizer_step();
    }));
    log = capture.text();
  }
  const std::string warning = "ran 2 optimizer steps but averaged the gradients 0 times";
  std::size_t count = 0;
  for (auto at = log.find(warning); at != std::string::npos; at = log.find(warning, at + 1))
    ++count;
  EXPECT_EQ(count, 2U) << log;  // once per engine, not once per window
  EXPECT_NE(log.find("before_optimizer_step()"), std::string::npos) << log;
}

}  // namespace
}  // namespace pulseloco
