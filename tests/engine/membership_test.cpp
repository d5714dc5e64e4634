// Engine::attach across membership changes, over in-process groups, against the scalar reference
// of docs/algorithm.md: a lost rank (its residual dropped, R shrinks), a new member (takes θ_g
// and m, starts with e = 0), a member that accepted a window the others committed without it
// learning the outcome (its residual is committed on attach), and diverged members (refused).
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/transport/inproc/inproc.h>
#include "engine/engine_test_util.h"

namespace pulseloco {
namespace {

using testing::LocalModel;
using testing::ReferenceState;
using testing::small_options;

const std::vector<std::uint64_t> kMemberSizes{0, 1, 37, 3000, 4097};

// Engines and their models (the models must outlive the engines' views: both in one place).
struct Members {
  std::vector<std::unique_ptr<LocalModel>> models;
  std::vector<std::unique_ptr<Engine>> engines;

  void add(LocalModel model, const EngineOptions& options) {
    models.push_back(std::make_unique<LocalModel>(std::move(model)));
    engines.push_back(std::make_unique<Engine>(testing::views_of(*models.back()), options));
  }
  void erase(std::size_t index) {
    engines.erase(engines.begin() + static_cast<std::ptrdiff_t>(index));
    models.erase(models.begin() + static_cast<std::ptrdiff_t>(index));
  }
  [[nodiscard]] int size() const { return static_cast<int>(engines.size()); }

  // Every member attaches to one new in-process group (collective), generation `generation`.
  void attach_all(std::uint64_t generation, transport::inproc::InprocOptions inproc = {}) {
    auto transports = transport::inproc::make_group(size(), std::move(inproc));
    testing::rethrow_first(testing::run_ranks(size(), [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      engines[i]->attach(std::move(transports[i]), GroupInfo{generation, {}});
    }));
  }

  void train(float lr, std::uint32_t seed_base) {
    for (int r = 0; r < size(); ++r) {
      testing::local_training(*models[static_cast<std::size_t>(r)], lr, 4,
                              seed_base + static_cast<std::uint32_t>(r));
    }
  }

  std::vector<std::exception_ptr> run_window() {
    return testing::run_ranks(
        size(), [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); });
  }

  [[nodiscard]] std::vector<LocalModel> model_copies() const {
    std::vector<LocalModel> copies;
    for (const auto& m : models)
      copies.push_back(*m);
    return copies;
  }
};

void expect_matches(const Members& members, const ReferenceState& reference,
                    const std::vector<LocalModel>& reference_models) {
  ASSERT_EQ(members.engines.size(), reference_models.size());
  ASSERT_EQ(reference.residual.size(), reference_models.size());
  for (std::size_t r = 0; r < members.engines.size(); ++r) {
    const Engine& engine = *members.engines[r];
    for (std::size_t t = 0; t < reference.global.size(); ++t) {
      const auto global = engine.global_weights(t);
      const auto momentum = engine.momentum(t);
      const auto residual = engine.residual(t);
      ASSERT_EQ(0, std::memcmp(global.data(), reference.global[t].data(), global.size_bytes()))
          << "θ_g of member " << r << " tensor " << t;
      ASSERT_EQ(0,
                std::memcmp(momentum.data(), reference.momentum[t].data(), momentum.size_bytes()))
          << "m of member " << r << " tensor " << t;
      ASSERT_EQ(
          0, std::memcmp(residual.data(), reference.residual[r][t].data(), residual.size_bytes()))
          << "e of member " << r << " tensor " << t;
      ASSERT_EQ((*members.models[r])[t].f32, reference_models[r][t].f32)
          << "θ_l of member " << r << " tensor " << t;
      ASSERT_EQ((*members.models[r])[t].bf16, reference_models[r][t].bf16)
          << "θ_l of member " << r << " tensor " << t;
    }
  }
}

// One window on the members and on the reference: every member and its reference copy train 4
// steps from seed seed_base + rank, the window runs, and every member must match the reference.
void window_against_reference(Members& members, ReferenceState& reference,
                              std::vector<LocalModel>& reference_models,
                              const EngineOptions& options, float lr, std::uint32_t seed_base) {
  members.train(lr, seed_base);
  for (std::size_t r = 0; r < reference_models.size(); ++r)
    testing::local_training(reference_models[r], lr, 4, seed_base + static_cast<std::uint32_t>(r));
  testing::rethrow_first(members.run_window());
  testing::reference_window(reference, reference_models, options.outer_lr, options.outer_momentum);
  expect_matches(members, reference, reference_models);
}

class EngineMembership : public ::testing::TestWithParam<DType> {};

TEST_P(EngineMembership, LostAndNewMembersMatchTheReferenceWithTheNewR) {
  const DType dtype = GetParam();
  const float lr = dtype == DType::float32 ? 3e-5f : 3e-3f;
  const EngineOptions options = small_options();
  Members members;
  for (int r = 0; r < 4; ++r)
    members.add(testing::make_model(kMemberSizes, dtype, r == 0 ? 7 : 100 + r), options);
  members.attach_all(1);
  ReferenceState reference = testing::reference_start(*members.models[0], 4);
  std::vector<LocalModel> reference_models = members.model_copies();

  // Window 0 with four members.
  window_against_reference(members, reference, reference_models, options, lr, 10);

  // Member 3 is lost: its residual goes with it; the other three form generation 2.
  members.erase(3);
  reference_models.erase(reference_models.begin() + 3);
  reference.residual.erase(reference.residual.begin() + 3);
  members.attach_all(2);
  expect_matches(members, reference, reference_models);  // attaching changed nothing
  EXPECT_EQ(members.engines[0]->group().generation, 2u);
  EXPECT_EQ(members.engines[2]->rank(), 2);
  EXPECT_EQ(members.engines[2]->world_size(), 3);

  // Window 1 with three: the aggregate divides by R = 3.
  window_against_reference(members, reference, reference_models, options, lr, 20);

  // A new member with weights of its own joins as rank 3 of generation 3: it receives θ_g, m
  // and the window counter, starts with e = 0 and θ_l = cast(θ_g); the others keep everything.
  members.add(testing::make_model(kMemberSizes, dtype, 999), options);
  members.attach_all(3);
  EXPECT_EQ(members.engines[3]->committed_windows(), 2u);
  reference_models.push_back(*members.models[0]);  // cast(θ_g) = θ_l of any member after a window
  reference.residual.emplace_back();
  for (const auto& g : reference.global)
    reference.residual.back().emplace_back(g.size(), 0.0f);
  expect_matches(members, reference, reference_models);

  // Window 2 with four again.
  window_against_reference(members, reference, reference_models, options, lr, 30);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, EngineMembership,
                         ::testing::Values(DType::float32, DType::bfloat16),
                         [](const ::testing::TestParamInfo<DType>& param_info) {
                           return std::string(dtype_name(param_info.param));
                         });

TEST(EngineMembership, AMemberThatAcceptedAWindowTheOthersCommittedCatchesUpOnAttach) {
  // Rank 1's completion notice of window 1's vote never reaches rank 0: ranks 1 and 2 commit
  // window 1, rank 0 times out not knowing the outcome (it had accepted every message). After
  // the next attach every member must hold exactly the reference state of window 1, rank 0's
  // residual included.
  const EngineOptions options = [] {
    EngineOptions o = small_options();
    o.timeout = std::chrono::milliseconds(1500);
    o.exchange = Exchange::allgather;  // the window's calls: all-gather, vote, digests
    return o;
  }();
  const float lr = 3e-5f;
  struct Setup {
    Members members;
    std::shared_ptr<transport::inproc::FaultInjector> faults =
        std::make_shared<transport::inproc::FaultInjector>();
  };
  auto prepare = [&](Setup& setup) {
    for (int r = 0; r < 3; ++r) {
      setup.members.add(testing::make_model(kMemberSizes, DType::float32, r == 0 ? 7 : 100 + r),
                        options);
    }
    setup.members.attach_all(1, {.faults = setup.faults});
    setup.members.train(lr, 10);
    testing::rethrow_first(setup.members.run_window());
    setup.members.train(lr, 20);
  };

  // Pass 1 learns the sequence numbers of window 1's calls (sparse all-gather, vote, digests).
  std::uint64_t vote_sequence = 0;
  {
    Setup setup;
    prepare(setup);
    testing::CallSequences sequences;
    setup.faults->set_hook(sequences.hook());
    testing::rethrow_first(setup.members.run_window());
    ASSERT_EQ(sequences.seen().size(), 3u);
    vote_sequence = sequences.seen()[1];
  }

  // Pass 2: the same run, with that one notice dropped (`dropped` outlives the setup, whose
  // transports may call the hook until they are destroyed).
  std::atomic<bool> dropped{false};
  Setup setup;
  prepare(setup);
  std::vector<LocalModel> reference_models = setup.members.model_copies();
  ReferenceState reference;
  {
    // The reference of window 0 (every member starts from rank 0's weights).
    const LocalModel rank0 = testing::make_model(kMemberSizes, DType::float32, 7);
    reference = testing::reference_start(rank0, 3);
    std::vector<LocalModel> window0(3, rank0);
    for (std::size_t r = 0; r < 3; ++r)
      testing::local_training(window0[r], lr, 4, 10 + static_cast<std::uint32_t>(r));
    testing::reference_window(reference, window0, options.outer_lr, options.outer_momentum);
  }
  setup.faults->set_hook(testing::drop_notice(1, 0, vote_sequence, dropped));
  const auto errors = setup.members.run_window();
  ASSERT_TRUE(dropped.load());
  ASSERT_TRUE(errors[0]) << "rank 0 should not have learnt the outcome";
  EXPECT_EQ(setup.members.engines[0]->committed_windows(), 1u);
  EXPECT_FALSE(setup.members.engines[0]->take_committed_report());
  for (std::size_t r = 1; r < 3; ++r) {
    ASSERT_EQ(setup.members.engines[r]->committed_windows(), 2u)
        << "rank " << r << " should have committed";
    EXPECT_TRUE(setup.members.engines[r]->take_committed_report());
  }

  setup.members.attach_all(2);
  testing::reference_window(reference, reference_models, options.outer_lr, options.outer_momentum);
  EXPECT_EQ(setup.members.engines[0]->committed_windows(), 2u);
  expect_matches(setup.members, reference, reference_models);
}

TEST(EngineMembership, MembersThatDivergedAreRefused) {
  const EngineOptions options = small_options();
  // Two separate groups of two train differently for one window each.
  Members first;
  Members second;
  for (int r = 0; r < 2; ++r) {
    first.add(testing::make_model(kMemberSizes, DType::float32, 7), options);
    second.add(testing::make_model(kMemberSizes, DType::float32, 7), options);
  }
  first.attach_all(1);
  second.attach_all(1);
  first.train(3e-5f, 10);
  second.train(3e-5f, 50);
  testing::rethrow_first(first.run_window());
  testing::rethrow_first(second.run_window());
  // One member of each now tries to form a group: same window, different θ_g.
  Members mixed;
  mixed.models.push_back(std::move(first.models[0]));
  mixed.engines.push_back(std::move(first.engines[0]));
  mixed.models.push_back(std::move(second.models[0]));
  mixed.engines.push_back(std::move(second.engines[0]));
  const std::vector<Digest> before{mixed.engines[0]->state_digest(),
                                   mixed.engines[1]->state_digest()};
  auto transports = transport::inproc::make_group(2);
  const auto errors = testing::run_ranks(2, [&](int r) {
    mixed.engines[static_cast<std::size_t>(r)]->attach(
        std::move(transports[static_cast<std::size_t>(r)]));
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]);
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const DivergenceError& e) {
      EXPECT_EQ(e.context().ranks, std::vector<int>{1}) << e.what();
    }
    // Nothing was changed by the refused attach.
    EXPECT_EQ(mixed.engines[static_cast<std::size_t>(r)]->state_digest(),
              before[static_cast<std::size_t>(r)]);
  }
}

TEST(EngineMembership, AnEngineWithoutAGroupRefusesWindows) {
  LocalModel model = testing::make_model({10}, DType::float32, 1);
  Engine engine(testing::views_of(model), small_options());
  EXPECT_THROW((void)engine.run_window(), InvalidArgument);
  EXPECT_THROW((void)engine.transport(), InvalidArgument);
}

}  // namespace
}  // namespace pulseloco
