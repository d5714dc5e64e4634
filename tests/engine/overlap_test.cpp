// Overlapped windows (docs/algorithm.md, "Overlapped windows") over an in-process group:
// bit-identity with a scalar reference of the boundary order, the report's window numbers, the
// end of training, checkpoints with a window in flight, a failed exchange, and refusals.
#include <pulseloco/engine/engine.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <map>

#include <fmt/format.h>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/replay.h>
#include <pulseloco/engine/state_files.h>
#include <pulseloco/transport/inproc/inproc.h>
#include "base/log_capture.h"
#include "engine/engine_test_util.h"

// A named namespace: the engine tests are one unity build, whose other files have helpers of the
// same names.
namespace pulseloco::overlap_test {

using testing::LocalModel;
using testing::LocalTensor;

// Every rank's state as the reference tracks it: the replicated θ_g and m, and per rank e, the
// start point S and the entries of the message in flight (per tensor, index -> s).
struct OverlapReference {
  std::vector<std::vector<float>> global;
  std::vector<std::vector<float>> momentum;
  bool momentum_initialised = false;
  std::vector<std::vector<std::vector<float>>> residual;             // [rank][tensor]
  std::vector<std::vector<std::vector<float>>> start;                // [rank][tensor]
  std::vector<std::vector<std::map<std::size_t, float>>> in_flight;  // [rank][tensor]
  bool has_in_flight = false;
};

OverlapReference overlap_reference_start(const LocalModel& rank0, int world) {
  testing::ReferenceState blocking = testing::reference_start(rank0, world);
  OverlapReference state;
  state.global = std::move(blocking.global);
  state.momentum = std::move(blocking.momentum);
  state.residual = std::move(blocking.residual);
  state.start.assign(static_cast<std::size_t>(world), state.global);
  state.in_flight.assign(static_cast<std::size_t>(world),
                         std::vector<std::map<std::size_t, float>>(rank0.size()));
  return state;
}

// One boundary in the order docs/algorithm.md states: finish and aggregate the window in
// flight, gate against S and commit e, apply, restart θ_l (and S), put the new messages in
// flight. `apply_only`: Engine::complete_in_flight() (no gate).
void reference_boundary(OverlapReference& state, std::vector<LocalModel>& models, Overlap overlap,
                        float lr, float mu, bool apply_only = false) {
  const std::size_t world = models.size();
  for (std::size_t t = 0; t < state.global.size(); ++t) {
    const std::size_t n = state.global[t].size();
    std::vector<float> g(n, 0.0f);
    if (state.has_in_flight) {
      for (std::size_t r = 0; r < world; ++r) {
        for (const auto& [i, s] : state.in_flight[r][t])
          g[i] = g[i] + s;
      }
      for (std::size_t i = 0; i < n; ++i)
        g[i] = g[i] / static_cast<float>(world);
    }
    std::vector<std::map<std::size_t, float>> sent(world);
    for (std::size_t r = 0; r < world && !apply_only; ++r) {
      const LocalTensor& local = models[r][t];
      for (std::size_t i = 0; i < n; ++i) {
        const float base = state.start[r][t][i];
        const float seen = local.dtype == DType::bfloat16 ? round_to_bf16(base) : base;
        const float s = state.residual[r][t][i] + (seen - local.get(i));
        const bool fire =
            !bf16_numeric_equal(float_to_bf16_bits(base), float_to_bf16_bits(base - s));
        state.residual[r][t][i] = fire ? 0.0f : s;
        if (fire) sent[r][i] = s;
      }
    }
    if (state.has_in_flight) {
      for (std::size_t i = 0; i < n; ++i)
        testing::reference_outer_step(state.global[t][i], state.momentum[t][i], g[i],
                                      state.momentum_initialised, lr, mu);
    }
    for (std::size_t r = 0; r < world; ++r) {
      state.start[r][t] = state.global[t];
      if (overlap == Overlap::eager && !apply_only) {
        std::vector<float> m = state.momentum[t];
        const bool initialised = state.momentum_initialised || state.has_in_flight;
        for (std::size_t i = 0; i < n; ++i) {
          const auto it = sent[r].find(i);
          testing::reference_outer_step(state.start[r][t][i], m[i],
                                        it == sent[r].end() ? 0.0f : it->second, initialised, lr,
                                        mu);
        }
      }
      for (std::size_t i = 0; i < n; ++i)
        models[r][t].set_from_global(i, state.start[r][t][i]);
      state.in_flight[r][t] = sent[r];
    }
  }
  if (state.has_in_flight) state.momentum_initialised = true;
  state.has_in_flight = !apply_only;
}

void expect_matches(const std::vector<std::unique_ptr<Engine>>& engines,
                    const OverlapReference& reference, const std::vector<LocalModel>& models,
                    const std::vector<LocalModel>& reference_models, const std::string& where) {
  for (std::size_t r = 0; r < engines.size(); ++r) {
    for (std::size_t t = 0; t < reference.global.size(); ++t) {
      const auto global = engines[r]->global_weights(t);
      const auto momentum = engines[r]->momentum(t);
      const auto residual = engines[r]->residual(t);
      ASSERT_EQ(0, std::memcmp(global.data(), reference.global[t].data(), global.size_bytes()))
          << where << ": θ_g of rank " << r << " tensor " << t;
      ASSERT_EQ(0,
                std::memcmp(momentum.data(), reference.momentum[t].data(), momentum.size_bytes()))
          << where << ": m of rank " << r << " tensor " << t;
      ASSERT_EQ(
          0, std::memcmp(residual.data(), reference.residual[r][t].data(), residual.size_bytes()))
          << where << ": e of rank " << r << " tensor " << t;
      ASSERT_EQ(models[r][t].f32, reference_models[r][t].f32)
          << where << ": θ_l of rank " << r << " tensor " << t;
      ASSERT_EQ(models[r][t].bf16, reference_models[r][t].bf16)
          << where << ": θ_l of rank " << r << " tensor " << t;
    }
  }
}

EngineOptions overlap_options(Overlap overlap) {
  EngineOptions options = testing::small_options();
  options.overlap = overlap;
  return options;
}

// Local training of window `window` on every rank, in the engines' models and the reference's.
void train(std::vector<LocalModel>& models, std::vector<LocalModel>& reference_models, float lr,
           int window) {
  for (std::size_t r = 0; r < models.size(); ++r) {
    const auto seed = static_cast<std::uint32_t>(100 * window + static_cast<int>(r));
    testing::local_training(models[r], lr, 4, seed);
    testing::local_training(reference_models[r], lr, 4, seed);
  }
}

std::vector<WindowReport> run_boundary(std::vector<std::unique_ptr<Engine>>& engines) {
  std::vector<WindowReport> reports(engines.size());
  testing::rethrow_first(testing::run_ranks(static_cast<int>(engines.size()), [&](int r) {
    reports[static_cast<std::size_t>(r)] = engines[static_cast<std::size_t>(r)]->run_window();
  }));
  return reports;
}

struct OverlapCase {
  Overlap overlap;
  int world;
  DType dtype;
  codec::Encoding encoding = codec::Encoding::pulse;
};

void PrintTo(const OverlapCase& c, std::ostream* out) {
  *out << overlap_name(c.overlap) << ", world " << c.world << ", " << dtype_name(c.dtype) << ", "
       << codec::encoding_name(c.encoding);
}

// How many frames of the traced message of `rank` in `window` are context-coded (the message's
// encoding must be `encoding`).
std::size_t context_frames_sent(const std::filesystem::path& traces, std::uint64_t window, int rank,
                                codec::Encoding encoding) {
  const std::string bytes =
      testing::file_bytes(state_files::trace_message_file(traces, window, rank));
  const codec::MessageView view = codec::MessageView::parse(std::as_bytes(std::span(bytes)));
  EXPECT_EQ(view.header().encoding, encoding) << "window " << window << " rank " << rank;
  std::size_t frames = 0;
  for (std::size_t f = 0; f < view.frame_count(); ++f)
    frames += view.frame(f).encoding == codec::Encoding::context ? 1 : 0;
  return frames;
}

class EngineOverlap : public ::testing::TestWithParam<OverlapCase> {};

TEST_P(EngineOverlap, MatchesTheReferenceAndReplicasStayIdentical) {
  const auto [overlap, world, dtype, encoding] = GetParam();
  const std::vector<std::uint64_t> sizes{0, 1, 37, 3000, 4097};
  const float lr = dtype == DType::float32 ? 3e-5f : 3e-3f;
  std::vector<LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model(sizes, dtype, r == 0 ? 7 : 1000 + r));
  EngineOptions options = overlap_options(overlap);
  options.codec.encoding = encoding;
  // The context encoding: the traced messages show what was sent.
  const std::filesystem::path traces =
      encoding == codec::Encoding::pulse ? std::filesystem::path()
                                         : testing::fresh_test_dir(fmt::format(
                                               "overlap_{}_R{}_{}_{}", overlap_name(overlap), world,
                                               dtype_name(dtype), codec::encoding_name(encoding)));
  options.trace_dir = traces.string();
  auto engines = testing::start_engines(models, options);
  OverlapReference reference = overlap_reference_start(models[0], world);
  std::vector<LocalModel> reference_models = models;

  const int windows = 6;
  for (int window = 0; window < windows; ++window) {
    train(models, reference_models, lr, window);
    const auto reports = run_boundary(engines);
    reference_boundary(reference, reference_models, overlap, options.outer_lr,
                       options.outer_momentum);
    expect_matches(engines, reference, models, reference_models,
                   "boundary " + std::to_string(window));
    for (const auto& report : reports) {
      EXPECT_EQ(report.window, static_cast<std::uint64_t>(window));
      EXPECT_EQ(report.overlap, overlap);
      if (window == 0) {
        EXPECT_FALSE(report.applied_window);
      } else {
        ASSERT_TRUE(report.applied_window);
        EXPECT_EQ(*report.applied_window, static_cast<std::uint64_t>(window - 1));
      }
      EXPECT_TRUE(report.replicas_identical);
      EXPECT_EQ(report.digest, reports[0].digest);
      EXPECT_GT(report.entries_sent, 0u);
      EXPECT_FALSE(completes_in_flight(report));
    }
    if (encoding == codec::Encoding::context) {
      std::size_t context_frames = 0;
      for (int r = 0; r < world; ++r)
        context_frames +=
            context_frames_sent(traces, static_cast<std::uint64_t>(window), r, encoding);
      EXPECT_GT(context_frames, 0u) << "boundary " << window;
    }
    for (const auto& engine : engines) {
      EXPECT_TRUE(engine->window_in_flight());
      EXPECT_EQ(engine->committed_windows(),
                static_cast<std::uint64_t>(window));  // outer steps applied
    }
  }

  // The end of training: the last window is applied, nothing more is sent.
  std::vector<std::optional<WindowReport>> last(engines.size());
  testing::rethrow_first(testing::run_ranks(world, [&](int r) {
    last[static_cast<std::size_t>(r)] = engines[static_cast<std::size_t>(r)]->complete_in_flight();
  }));
  reference_boundary(reference, reference_models, overlap, options.outer_lr, options.outer_momentum,
                     /*apply_only=*/true);
  expect_matches(engines, reference, models, reference_models, "complete_in_flight");
  for (std::size_t r = 0; r < engines.size(); ++r) {
    ASSERT_TRUE(last[r]);
    EXPECT_EQ(last[r]->window, static_cast<std::uint64_t>(windows - 1));
    EXPECT_EQ(last[r]->applied_window, std::optional<std::uint64_t>(windows - 1));
    EXPECT_EQ(last[r]->payload_bytes, 0u);
    EXPECT_TRUE(last[r]->replicas_identical);
    // Its log line says what it was, not an empty window's "density 0.000%, payload 0 B".
    EXPECT_TRUE(completes_in_flight(*last[r]));
    const std::string line = summary_line(*last[r]);
    EXPECT_NE(line.find("completed in flight"), std::string::npos) << line;
    EXPECT_EQ(line.find("density"), std::string::npos) << line;
    EXPECT_FALSE(engines[r]->window_in_flight());
    EXPECT_EQ(engines[r]->committed_windows(), static_cast<std::uint64_t>(windows));
    EXPECT_FALSE(engines[r]->complete_in_flight());  // nothing in flight any more
  }
  if (!traces.empty()) std::filesystem::remove_all(traces);
}

INSTANTIATE_TEST_SUITE_P(
    Variants, EngineOverlap,
    ::testing::Values(OverlapCase{Overlap::delayed, 1, DType::float32},
                      OverlapCase{Overlap::delayed, 4, DType::float32},
                      OverlapCase{Overlap::delayed, 3, DType::bfloat16},
                      OverlapCase{Overlap::eager, 1, DType::float32},
                      OverlapCase{Overlap::eager, 4, DType::float32},
                      OverlapCase{Overlap::eager, 3, DType::bfloat16},
                      OverlapCase{Overlap::delayed, 4, DType::float32, codec::Encoding::context},
                      OverlapCase{Overlap::eager, 3, DType::bfloat16, codec::Encoding::context},
                      OverlapCase{Overlap::eager, 4, DType::float32, codec::Encoding::context}),
    [](const ::testing::TestParamInfo<OverlapCase>& param_info) {
      const OverlapCase& c = param_info.param;
      return std::string(overlap_name(c.overlap)) + "_R" + std::to_string(c.world) + "_" +
             std::string(dtype_name(c.dtype)) +
             (c.encoding == codec::Encoding::pulse
                  ? std::string()
                  : "_" + std::string(codec::encoding_name(c.encoding)));
    });

// A dropped window: every rank's message in flight goes back into its residual (e = s where
// it fired; e was 0 there).
void reference_drop(OverlapReference& state) {
  for (std::size_t r = 0; r < state.residual.size(); ++r) {
    for (std::size_t t = 0; t < state.global.size(); ++t) {
      for (const auto& [i, s] : state.in_flight[r][t])
        state.residual[r][t][i] = s;
      state.in_flight[r][t].clear();
    }
  }
  state.has_in_flight = false;
}

// A member killed while a window is in flight: the others' next boundary fails with a named
// error and changes nothing; they form a new group, which drops the window in flight on every
// member (its entries back in e), and continue with identical replicas, as the reference says.
TEST(EngineOverlapMembership, AMemberLostWithAWindowInFlightIsDroppedAndTheOthersContinue) {
  for (const auto& [overlap, encoding] : {std::pair{Overlap::delayed, codec::Encoding::pulse},
                                          std::pair{Overlap::eager, codec::Encoding::pulse},
                                          std::pair{Overlap::eager, codec::Encoding::context}}) {
    SCOPED_TRACE(fmt::format("{}, {}", overlap_name(overlap), codec::encoding_name(encoding)));
    const std::vector<std::uint64_t> sizes{1, 37, 3000, 4097};
    const float lr = 3e-5f;
    constexpr int kMembers = 4;
    std::vector<std::unique_ptr<LocalModel>> models;
    std::vector<std::unique_ptr<Engine>> engines;
    EngineOptions options = overlap_options(overlap);
    options.codec.encoding = encoding;
    options.timeout = std::chrono::milliseconds(5'000);
    const std::filesystem::path traces = testing::fresh_test_dir(fmt::format(
        "overlap_membership_{}_{}", overlap_name(overlap), codec::encoding_name(encoding)));
    options.trace_dir = traces.string();
    for (int r = 0; r < kMembers; ++r) {
      models.push_back(
          std::make_unique<LocalModel>(testing::make_model(sizes, DType::float32, 7 + r)));
      engines.push_back(std::make_unique<Engine>(testing::views_of(*models.back()), options));
    }
    const auto attach_all = [&](std::uint64_t generation,
                                transport::inproc::InprocOptions inproc = {}) {
      auto transports = transport::inproc::make_group(static_cast<int>(engines.size()), inproc);
      testing::rethrow_first(testing::run_ranks(static_cast<int>(engines.size()), [&](int r) {
        const auto i = static_cast<std::size_t>(r);
        engines[i]->attach(std::move(transports[i]), GroupInfo{generation, {}});
      }));
    };
    const auto faults = std::make_shared<transport::inproc::FaultInjector>();
    attach_all(1, {.faults = faults});
    OverlapReference reference = overlap_reference_start(*models[0], kMembers);
    std::vector<LocalModel> reference_models;
    for (const auto& m : models)
      reference_models.push_back(*m);
    const auto boundary = [&](int window, std::optional<std::uint64_t> applied) {
      std::vector<LocalModel> current;
      for (std::size_t r = 0; r < engines.size(); ++r) {
        const auto seed = static_cast<std::uint32_t>(100 * window + static_cast<int>(r));
        testing::local_training(*models[r], lr, 4, seed);
        testing::local_training(reference_models[r], lr, 4, seed);
      }
      std::vector<WindowReport> reports(engines.size());
      testing::rethrow_first(testing::run_ranks(static_cast<int>(engines.size()), [&](int r) {
        reports[static_cast<std::size_t>(r)] = engines[static_cast<std::size_t>(r)]->run_window();
      }));
      for (const auto& report : reports) {
        EXPECT_EQ(report.window, static_cast<std::uint64_t>(window));
        EXPECT_EQ(report.applied_window, applied);
      }
      reference_boundary(reference, reference_models, overlap, options.outer_lr,
                         options.outer_momentum);
      for (const auto& m : models)
        current.push_back(*m);
      std::vector<std::unique_ptr<Engine>>& all = engines;
      expect_matches(all, reference, current, reference_models,
                     "boundary " + std::to_string(window));
    };
    boundary(0, std::nullopt);
    boundary(1, 0);  // window 1 is in flight on every member

    // Member 3 dies; the survivors reach their next boundary.
    faults->kill(3);
    std::vector<Digest> before;
    for (const auto& engine : engines)
      before.push_back(engine->state_digest());
    const auto errors = testing::run_ranks(kMembers - 1, [&](int r) {
      testing::local_training(*models[static_cast<std::size_t>(r)], lr, 4, 900);
      (void)engines[static_cast<std::size_t>(r)]->run_window();
    });
    for (int r = 0; r < kMembers - 1; ++r) {
      const auto i = static_cast<std::size_t>(r);
      ASSERT_TRUE(errors[i]) << "member " << r << " ran its boundary without member 3";
      try {
        std::rethrow_exception(errors[i]);
      } catch (const Error& e) {
        // Every survivor names the member that died, whichever survivor failed first.
        EXPECT_EQ(e.kind(), ErrorKind::peer_lost) << "member " << r << ": " << e.what();
        EXPECT_EQ(e.context().peer, 3) << "member " << r << ": " << e.what();
      }
      EXPECT_EQ(engines[i]->state_digest(), before[i]);  // nothing applied
      EXPECT_EQ(engines[i]->committed_windows(), 1u);
      EXPECT_TRUE(engines[i]->window_in_flight());
    }
    // Their local steps of the failed boundary are undone in the test (the reference never
    // saw them): each survivor trains again from its model before the failure.
    engines.pop_back();
    models.pop_back();
    for (int r = 0; r < kMembers - 1; ++r) {
      for (std::size_t t = 0; t < sizes.size(); ++t) {  // in place: the engines hold views
        const auto& saved = reference_models[static_cast<std::size_t>(r)][t].f32;
        std::copy(saved.begin(), saved.end(),
                  (*models[static_cast<std::size_t>(r)])[t].f32.begin());
      }
    }
    reference_models.pop_back();
    reference.residual.pop_back();
    reference.start.pop_back();
    reference.in_flight.pop_back();

    attach_all(2);
    reference_drop(reference);
    for (const auto& engine : engines) {
      EXPECT_FALSE(engine->window_in_flight());
      EXPECT_EQ(engine->committed_windows(), 1u);
    }
    // Window 1 was dropped: its number is not used again, and nothing is in flight to apply.
    boundary(2, std::nullopt);
    boundary(3, 2);
    std::vector<Digest> after;
    for (const auto& engine : engines)
      after.push_back(engine->state_digest());
    EXPECT_EQ(after, std::vector<Digest>(after.size(), after[0]));
    // Every boundary replays from its trace, the one after the regroup (the failed attempt's
    // inputs are of the old generation) and eager's start points included.
    EXPECT_EQ(traced_windows(traces), (std::vector<std::uint64_t>{0, 1, 2, 3}));
    for (const std::uint64_t window : traced_windows(traces)) {
      EXPECT_TRUE(replay_window(traces, window).identical()) << "window " << window;
    }
    std::filesystem::remove_all(traces);
  }
}

// Once a window was dropped, window numbers run ahead of the windows committed. A member whose
// window in flight the others applied without it learning the outcome (rank 1's completion
// notice of that window's vote never reaches rank 0) names that window by its number on attach,
// and every member continues numbering after the highest one used.
TEST(EngineOverlapMembership, AMemberThatMissedItsWindowsOutcomeNamesItByItsNumberAfterADrop) {
  constexpr int kMembers = 3;
  const float lr = 3e-5f;
  EngineOptions options = overlap_options(Overlap::delayed);
  options.timeout = std::chrono::milliseconds(1500);
  options.exchange = Exchange::allgather;  // the calls counted below: one collective per exchange
  struct Run {
    std::vector<std::unique_ptr<LocalModel>> models;
    std::vector<std::unique_ptr<Engine>> engines;
    std::shared_ptr<transport::inproc::FaultInjector> faults =
        std::make_shared<transport::inproc::FaultInjector>();

    void attach_all(std::uint64_t generation, transport::inproc::InprocOptions inproc = {}) {
      auto transports = transport::inproc::make_group(kMembers, std::move(inproc));
      testing::rethrow_first(testing::run_ranks(kMembers, [&](int r) {
        const auto i = static_cast<std::size_t>(r);
        engines[i]->attach(std::move(transports[i]), GroupInfo{generation, {}});
      }));
    }
    std::vector<std::exception_ptr> boundary(float lr, std::uint32_t seed) {
      for (std::size_t r = 0; r < models.size(); ++r)
        testing::local_training(*models[r], lr, 4, seed + static_cast<std::uint32_t>(r));
      return testing::run_ranks(
          kMembers, [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); });
    }
  };
  // Windows 0 and 1 run; a regroup drops window 1 (every member was up to date); window 2 is
  // gated and in flight: its number is one above the windows committed.
  const auto prepare = [&](Run& run) {
    for (int r = 0; r < kMembers; ++r) {
      run.models.push_back(std::make_unique<LocalModel>(
          testing::make_model({1, 37, 3000}, DType::float32, r == 0 ? 7 : 100 + r)));
      run.engines.push_back(
          std::make_unique<Engine>(testing::views_of(*run.models.back()), options));
    }
    run.attach_all(1);
    testing::rethrow_first(run.boundary(lr, 10));
    testing::rethrow_first(run.boundary(lr, 20));
    run.attach_all(2, {.faults = run.faults});
    for (const auto& engine : run.engines)
      ASSERT_EQ(engine->next_window(), 2u);
  };

  // Pass 1 learns the sequence numbers of the calls of the next two boundaries: the digests of
  // the first, window 2's exchange, its vote and the digests of the second (then window 3's
  // exchange starts in the background).
  std::uint64_t vote_sequence = 0;
  {
    Run run;
    prepare(run);
    testing::CallSequences sequences;
    run.faults->set_hook(sequences.hook());
    testing::rethrow_first(run.boundary(lr, 30));
    testing::rethrow_first(run.boundary(lr, 40));
    ASSERT_GE(sequences.seen().size(), 4u);
    vote_sequence = sequences.seen()[2];
  }

  // Pass 2: the same run, with that one notice dropped (`dropped` outlives the run, whose
  // background exchange may call the hook until its engines are destroyed).
  std::atomic<bool> dropped{false};
  Run run;
  prepare(run);
  run.faults->set_hook(testing::drop_notice(1, 0, vote_sequence, dropped));
  testing::rethrow_first(run.boundary(lr, 30));
  const auto errors = run.boundary(lr, 40);
  ASSERT_TRUE(dropped.load());
  ASSERT_TRUE(errors[0]) << "rank 0 should not have learnt the outcome";
  ASSERT_EQ(run.engines[0]->committed_windows(), 1u);
  ASSERT_TRUE(run.engines[0]->window_in_flight());
  for (std::size_t r = 1; r < kMembers; ++r)
    ASSERT_EQ(run.engines[r]->committed_windows(), 2u)
        << "rank " << r << " should have applied window 2";

  std::string log;
  {
    const testing::LogCapture capture;
    run.attach_all(3);
    log = capture.text();
  }
  EXPECT_NE(log.find("window 2 (in flight here) was applied in the old group"), std::string::npos)
      << log;
  // Ranks 1 and 2 had window 3 in flight: the new group drops it, and its number is not reused.
  EXPECT_NE(log.find("window 3 was in flight when the group changed"), std::string::npos) << log;
  for (const auto& engine : run.engines) {
    EXPECT_EQ(engine->committed_windows(), 2u);
    EXPECT_FALSE(engine->window_in_flight());
    EXPECT_EQ(engine->next_window(), 4u);
  }
}

}  // namespace pulseloco::overlap_test
