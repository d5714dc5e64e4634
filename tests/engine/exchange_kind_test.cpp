// The exchange kinds (EngineOptions::exchange): the choice rule and the owner ranges as pure
// functions, the owners' sum against aggregate(), and the window's bits: every kind gives the
// all-gather's digests, for 1 to 8 ranks, fp32 and bf16 locals, sets that overlap not at all,
// partly or totally, and empty messages, in blocking and overlapped windows, in-process and
// over TCP.
#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <cstring>
#include <random>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/exchange_choice.h>
#include <pulseloco/kernels/window_kernels.h>
#include "collectives/test_groups.h"
#include "engine/engine_test_util.h"

namespace pulseloco {
namespace {

using engine_detail::choice_needs_sketches;
using engine_detail::choose_exchange;
using engine_detail::ExchangeInputs;
using engine_detail::kLatencyBoundEntries;
using engine_detail::owner_bounds;
using engine_detail::UnionSketch;

ExchangeInputs automatic(int world, std::uint64_t group_entries, std::uint64_t union_entries) {
  return {.world = world, .group_entries = group_entries, .union_estimate = union_entries};
}

TEST(ChooseExchange, ReductionWhenItsEstimatedTrafficIsBelowTheAdvantageThreshold) {
  const std::uint64_t g = 100 * kLatencyBoundEntries;
  // 10 (G + R U) < 9 R G with R = 4: U < 0.65 G.
  EXPECT_EQ(choose_exchange(automatic(4, g, g * 64 / 100)), Exchange::reduction);
  EXPECT_EQ(choose_exchange(automatic(4, g, g * 66 / 100)), Exchange::allgather);
  // Identical sets (U = G/R) gain from 3 ranks on; disjoint ones (U = G) never do.
  EXPECT_EQ(choose_exchange(automatic(3, g, g / 3)), Exchange::reduction);
  EXPECT_EQ(choose_exchange(automatic(16, g, g)), Exchange::allgather);
  // 16 ranks whose union is an eighth of their sets' sum.
  EXPECT_EQ(choose_exchange(automatic(16, g, g / 8)), Exchange::reduction);
}

TEST(ChooseExchange, AllgatherWhereTheReductionCannotGainOrRun) {
  const std::uint64_t g = 100 * kLatencyBoundEntries;
  EXPECT_EQ(choose_exchange(automatic(2, g, g / 2)), Exchange::allgather);  // two ranks
  EXPECT_EQ(choose_exchange(automatic(8, kLatencyBoundEntries - 1, 1)), Exchange::allgather);
  ExchangeInputs ordered = automatic(8, g, g / 8);
  ordered.ordered_transport = true;
  EXPECT_EQ(choose_exchange(ordered), Exchange::allgather);
  EXPECT_FALSE(choice_needs_sketches(Exchange::automatic, 8, true));
  EXPECT_FALSE(choice_needs_sketches(Exchange::automatic, 2, false));
  EXPECT_FALSE(choice_needs_sketches(Exchange::reduction, 8, false));
  EXPECT_TRUE(choice_needs_sketches(Exchange::automatic, 3, false));
}

TEST(ChooseExchange, ForcedKindsAndOrderMatchingTransports) {
  ExchangeInputs in{.option = Exchange::reduction, .world = 2};
  EXPECT_EQ(choose_exchange(in), Exchange::reduction);
  in = automatic(8, 100 * kLatencyBoundEntries, 1);
  in.option = Exchange::allgather;
  EXPECT_EQ(choose_exchange(in), Exchange::allgather);
  in.option = Exchange::reduction;
  in.ordered_transport = true;
  EXPECT_THROW((void)choose_exchange(in), InvalidArgument);
}

TEST(UnionSketch, EstimatesTheUnionOfMergedSetsWithinAFewPercent) {
  for (const std::uint64_t distinct : {5'000ULL, 50'000ULL, 2'000'000ULL}) {
    // Three ranks: the first two share half their elements, the third is disjoint from both.
    UnionSketch a;
    UnionSketch b;
    UnionSketch c;
    for (std::uint64_t i = 0; i < distinct; ++i) {
      const std::uint64_t chunk = i >> 20;
      const auto offset = static_cast<std::uint32_t>(i & 0xFFFFF);
      if (i % 4 == 0) {
        a.add(chunk, offset);
        b.add(chunk, offset);
      } else if (i % 4 == 1) {
        a.add(chunk, offset);
      } else if (i % 4 == 2) {
        b.add(chunk, offset);
      } else {
        c.add(chunk, offset);
      }
    }
    UnionSketch merged;
    for (const UnionSketch* s : {&a, &b, &c})
      merged.merge(*s);
    const double estimate = static_cast<double>(merged.estimate());
    // 3 standard errors of a 2^10-register HyperLogLog.
    EXPECT_NEAR(estimate / static_cast<double>(distinct), 1.0, 0.1) << distinct;
    // Adding an element twice changes nothing; the bytes round-trip.
    const std::uint64_t before = a.estimate();
    a.add(0, 0);
    EXPECT_EQ(a.estimate(), before);
    EXPECT_EQ(UnionSketch::from_bytes(merged.bytes()).estimate(), merged.estimate());
  }
  std::array<std::uint8_t, UnionSketch::kBytes> bad{};
  bad[3] = 200;
  EXPECT_THROW((void)UnionSketch::from_bytes(bad), ProtocolError);
}

TEST(OwnerBounds, ContiguousBalancedRangesCoveringEveryChunk) {
  std::vector<ChunkRef> chunks;
  for (int i = 0; i < 37; ++i)
    chunks.push_back({.tensor = 0, .begin = 0, .length = static_cast<std::uint64_t>(100 + i * 7)});
  for (const int world : {1, 2, 3, 5, 8, 37, 50}) {
    const std::vector<std::size_t> bounds = owner_bounds(chunks, world);
    ASSERT_EQ(bounds.size(), static_cast<std::size_t>(world) + 1) << world;
    EXPECT_EQ(bounds.front(), 0u);
    EXPECT_EQ(bounds.back(), chunks.size());
    EXPECT_TRUE(std::is_sorted(bounds.begin(), bounds.end()));
    std::uint64_t total = 0;
    for (const auto& chunk : chunks)
      total += chunk.length;
    for (int o = 0; o < world; ++o) {
      std::uint64_t mine = 0;
      for (std::size_t c = bounds[static_cast<std::size_t>(o)];
           c < bounds[static_cast<std::size_t>(o) + 1]; ++c)
        mine += chunks[c].length;
      // Within about one chunk (the largest is 352 elements) of an equal share.
      EXPECT_LE(mine, total / static_cast<std::uint64_t>(world) + 352) << world << " " << o;
    }
  }
  EXPECT_EQ(owner_bounds({}, 3), (std::vector<std::size_t>{0, 0, 0, 0}));
}

TEST(SparseSum, DividedByTheRankCountItIsAggregateBitForBit) {
  std::mt19937 rng(11);
  const std::uint64_t count = 3000;
  for (const int ranks : {1, 2, 3, 7}) {
    std::vector<std::vector<std::uint32_t>> offsets(static_cast<std::size_t>(ranks));
    std::vector<std::vector<float>> values(static_cast<std::size_t>(ranks));
    std::normal_distribution<float> normal(0.0f, 1e-3f);
    std::vector<kernels::SparseEntries> entries;
    for (int r = 0; r < ranks; ++r) {
      for (std::uint32_t i = 0; i < count; ++i) {
        // Overlapping sets (every rank fires near the same elements), some values of opposite
        // signs that cancel exactly, and some -0.
        if (rng() % 5 == 0 || i % 97 == 0) {
          offsets[static_cast<std::size_t>(r)].push_back(i);
          const float v = i % 97 == 0 ? (r % 2 == 0 ? 0.25f : -0.25f) : normal(rng);
          values[static_cast<std::size_t>(r)].push_back(i % 389 == 0 ? -0.0f : v);
        }
      }
      entries.push_back(
          {offsets[static_cast<std::size_t>(r)], values[static_cast<std::size_t>(r)]});
    }
    std::vector<float> expected(count);
    kernels::aggregate(entries, expected.data(), count);

    std::vector<float> sum(count);
    std::vector<std::uint8_t> seen(count, 0);
    std::vector<std::uint32_t> sum_offsets(count);
    std::vector<float> sum_values(count);
    const std::uint64_t n = kernels::sparse_sum(entries, count, sum.data(), seen.data(),
                                                sum_offsets.data(), sum_values.data());
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](std::uint8_t s) { return s == 0; }));
    std::vector<kernels::SparseEntries> as_one(static_cast<std::size_t>(ranks));
    as_one[0] = {std::span(sum_offsets.data(), n), std::span(sum_values.data(), n)};
    std::vector<float> got(count);
    kernels::aggregate(as_one, got.data(), count);
    EXPECT_EQ(std::memcmp(got.data(), expected.data(), count * sizeof(float)), 0) << ranks;
  }
}

// How the ranks' sets relate.
enum class Sets { disjoint, partial, identical, empty, one_empty };

std::string sets_name(Sets sets) {
  switch (sets) {
    case Sets::disjoint:
      return "disjoint";
    case Sets::partial:
      return "partial";
    case Sets::identical:
      return "identical";
    case Sets::empty:
      return "empty";
    case Sets::one_empty:
      return "one_empty";
  }
  return "?";
}

// Window `window`'s inner steps on rank r.
void train(testing::LocalModel& model, Sets sets, int rank, int world, int window) {
  const auto seed = static_cast<std::uint32_t>(900 + 10 * window);
  switch (sets) {
    case Sets::identical:
      testing::local_training(model, 4e-3f, 2, seed);
      return;
    case Sets::partial:
      testing::local_training(model, 4e-3f, 2, seed + static_cast<std::uint32_t>(rank % 2));
      return;
    case Sets::empty:
      return;
    case Sets::one_empty:
      if (rank != world - 1) testing::local_training(model, 4e-3f, 2, seed + rank);
      return;
    case Sets::disjoint:
      // Rank r moves only elements i with i % world == r, by far more than one bf16 step.
      for (auto& tensor : model) {
        for (std::size_t i = static_cast<std::size_t>(rank); i < tensor.numel();
             i += static_cast<std::size_t>(world)) {
          const float w = tensor.get(i) + 0.05f * static_cast<float>(1 + window);
          if (tensor.dtype == DType::float32) {
            tensor.f32[i] = w;
          } else {
            tensor.bf16[i] = float_to_bf16_bits(w);
          }
        }
      }
      return;
  }
}

struct WindowsRun {
  std::vector<std::vector<Digest>> digests;  // per window, per rank
  std::vector<std::vector<std::string>> kinds;
  std::vector<std::uint64_t> union_entries;  // per window (rank 0)
};

WindowsRun run_windows(const std::string& backend, int world, DType dtype, Sets sets,
                       Exchange exchange, Overlap overlap, int windows) {
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({5000, 1500, 700}, dtype, 40));
  EngineOptions options = testing::small_options();
  options.exchange = exchange;
  options.overlap = overlap;
  options.threads = 1;
  auto transports = testing::make_test_group(backend, world);
  std::vector<std::unique_ptr<Engine>> engines(static_cast<std::size_t>(world));
  testing::rethrow_first(testing::run_ranks(world, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    engines[i] =
        std::make_unique<Engine>(testing::views_of(models[i]), options, std::move(transports[i]));
  }));
  WindowsRun run;
  for (int w = 0; w < windows; ++w) {
    for (int r = 0; r < world; ++r)
      train(models[static_cast<std::size_t>(r)], sets, r, world, w);
    std::vector<WindowReport> reports(static_cast<std::size_t>(world));
    testing::rethrow_first(testing::run_ranks(world, [&](int r) {
      reports[static_cast<std::size_t>(r)] = engines[static_cast<std::size_t>(r)]->run_window();
    }));
    run.digests.emplace_back();
    run.kinds.emplace_back();
    for (const WindowReport& report : reports) {
      run.digests.back().push_back(report.digest);
      run.kinds.back().push_back(report.exchange);
      EXPECT_TRUE(report.replicas_identical);
    }
    run.union_entries.push_back(reports[0].union_entries);
  }
  if (overlap != Overlap::blocking) {
    std::vector<Digest> last(static_cast<std::size_t>(world));
    testing::rethrow_first(testing::run_ranks(world, [&](int r) {
      auto& engine = *engines[static_cast<std::size_t>(r)];
      (void)engine.complete_in_flight();
      last[static_cast<std::size_t>(r)] = engine.state_digest();
    }));
    run.digests.push_back(last);
  }
  return run;
}

// Large enough sets for the choice to look at them: 8 ranks with identical sets take the
// reduction, with disjoint sets the all-gather, from the first window on.
TEST(ExchangeKind, AutomaticChoosesFromTheSetsOfThisVeryWindow) {
  for (const Sets sets : {Sets::identical, Sets::disjoint}) {
    const int world = 8;
    std::vector<testing::LocalModel> models;
    for (int r = 0; r < world; ++r)
      models.push_back(testing::make_model({150'000}, DType::float32, 40));
    EngineOptions options = testing::small_options();
    options.chunk_elements = 16384;
    options.threads = 1;
    auto engines = testing::start_engines(models, options);
    for (int r = 0; r < world; ++r)
      train(models[static_cast<std::size_t>(r)], sets, r, world, 0);
    std::vector<WindowReport> reports(static_cast<std::size_t>(world));
    testing::rethrow_first(testing::run_ranks(world, [&](int r) {
      reports[static_cast<std::size_t>(r)] = engines[static_cast<std::size_t>(r)]->run_window();
    }));
    for (const WindowReport& report : reports) {
      ASSERT_GE(report.group_entries, kLatencyBoundEntries) << sets_name(sets);
      EXPECT_EQ(report.exchange, sets == Sets::identical ? "reduction" : "allgather")
          << sets_name(sets) << ", union ratio " << report.union_ratio;
    }
  }
}

using BitsParam = std::tuple<int, DType, Sets>;

class ExchangeBits : public ::testing::TestWithParam<BitsParam> {};

TEST_P(ExchangeBits, EveryKindGivesTheAllgathersDigests) {
  const auto& [world, dtype, sets] = GetParam();
  const int windows = 3;
  const WindowsRun gathered =
      run_windows("inproc", world, dtype, sets, Exchange::allgather, Overlap::blocking, windows);
  const WindowsRun reduced =
      run_windows("inproc", world, dtype, sets, Exchange::reduction, Overlap::blocking, windows);
  const WindowsRun chosen =
      run_windows("inproc", world, dtype, sets, Exchange::automatic, Overlap::blocking, windows);
  EXPECT_EQ(reduced.digests, gathered.digests);
  EXPECT_EQ(chosen.digests, gathered.digests);
  EXPECT_EQ(reduced.union_entries, gathered.union_entries);
  for (int w = 0; w < windows; ++w) {
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(gathered.kinds[w][r], "allgather");
      EXPECT_EQ(reduced.kinds[w][r], "reduction");
      EXPECT_EQ(chosen.kinds[w][r], chosen.kinds[w][0]) << "every rank chooses alike";
    }
  }
  if (sets == Sets::disjoint || world < 3) {
    EXPECT_EQ(chosen.kinds[0][0], "allgather");
  }
}

INSTANTIATE_TEST_SUITE_P(Groups, ExchangeBits,
                         ::testing::Combine(::testing::Values(1, 2, 3, 5, 8),
                                            ::testing::Values(DType::float32, DType::bfloat16),
                                            ::testing::Values(Sets::disjoint, Sets::partial,
                                                              Sets::identical, Sets::empty,
                                                              Sets::one_empty)),
                         [](const ::testing::TestParamInfo<BitsParam>& param) {
                           return "world" + std::to_string(std::get<0>(param.param)) + "_" +
                                  std::string(dtype_name(std::get<1>(param.param))) + "_" +
                                  sets_name(std::get<2>(param.param));
                         });

class ExchangeBitsOverTransports : public ::testing::TestWithParam<std::string> {};

TEST_P(ExchangeBitsOverTransports, ReductionGivesTheAllgathersDigests) {
  const std::string backend = GetParam();
  for (const Overlap overlap : {Overlap::blocking, Overlap::delayed}) {
    const WindowsRun gathered =
        run_windows(backend, 4, DType::bfloat16, Sets::partial, Exchange::allgather, overlap, 3);
    const WindowsRun reduced =
        run_windows(backend, 4, DType::bfloat16, Sets::partial, Exchange::reduction, overlap, 3);
    EXPECT_EQ(reduced.digests, gathered.digests) << overlap_name(overlap);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, ExchangeBitsOverTransports,
                         ::testing::ValuesIn(testing::test_backends()),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param;
                         });

// Rank 2 dies during the all-to-all of an owner reduction (its first piece of payload, phase
// byte 3 of the collectives' tags): every survivor fails within 2x the timeout, naming it, with
// its state unchanged.
TEST(ExchangeKind, ARankKilledMidReductionIsNamedByEverySurvivorInTime) {
  const int world = 4;
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < world; ++r)
    models.push_back(testing::make_model({5000, 1500}, DType::float32, 40));
  EngineOptions options = testing::small_options();
  options.exchange = Exchange::reduction;
  options.timeout = std::chrono::milliseconds(2000);
  auto faults = std::make_shared<transport::inproc::FaultInjector>();
  auto engines = testing::start_engines(models, options, {.faults = faults});
  for (int r = 0; r < world; ++r)
    train(models[static_cast<std::size_t>(r)], Sets::partial, r, world, 0);
  std::vector<Digest> before;
  for (const auto& engine : engines)
    before.push_back(engine->state_digest());
  faults->set_hook([](const transport::inproc::MessageEvent& m) {
    return m.from == 2 && (m.tag & 0xFF) == 3 ? transport::inproc::FaultAction::kill_sender
                                              : transport::inproc::FaultAction::deliver;
  });
  std::vector<transport::Clock::time_point> finished(world);
  const auto errors = testing::run_ranks(world, [&](int r) {
    try {
      (void)engines[static_cast<std::size_t>(r)]->run_window();
    } catch (...) {
      finished[static_cast<std::size_t>(r)] = transport::Clock::now();
      throw;
    }
  });
  const auto injected = faults->injected();
  ASSERT_FALSE(injected.empty()) << "the fault was never injected";
  for (int r = 0; r < world; ++r) {
    if (r == 2) continue;
    const auto i = static_cast<std::size_t>(r);
    ASSERT_TRUE(errors[i]) << "rank " << r;
    try {
      std::rethrow_exception(errors[i]);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::peer_lost) << "rank " << r << ": " << e.what();
      EXPECT_EQ(e.context().peer, 2) << "rank " << r << ": " << e.what();
    }
    EXPECT_LE(finished[i] - injected.front().when, 2 * options.timeout) << "rank " << r;
    EXPECT_EQ(engines[i]->state_digest(), before[i]) << "rank " << r;
  }
}

// The owner's sum of the ranks' entries overflows fp32 (each rank's pseudo-gradient is finite):
// the window fails on every rank naming the owner, with every state unchanged, where the
// all-gather would have stepped to an infinite θ_g.
TEST(ExchangeKind, AnOverflowingOwnerSumFailsTheWindowEverywhereNamingTheOwner) {
  const int world = 2;
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < world; ++r) {
    models.push_back(testing::make_model({5000}, DType::float32, 40));
    models.back()[0].f32[0] = 1e38f;  // element 0 lies in rank 0's range
  }
  EngineOptions options = testing::small_options();
  options.exchange = Exchange::reduction;
  options.threads = 1;
  auto engines = testing::start_engines(models, options);
  std::vector<Digest> before;
  for (int r = 0; r < world; ++r) {
    models[static_cast<std::size_t>(r)][0].f32[0] = -1e38f;  // s = 2e38 on each rank
    before.push_back(engines[static_cast<std::size_t>(r)]->state_digest());
  }
  const auto errors = testing::run_ranks(
      world, [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); });
  for (int r = 0; r < world; ++r) {
    const auto i = static_cast<std::size_t>(r);
    ASSERT_TRUE(errors[i]) << "rank " << r;
    try {
      std::rethrow_exception(errors[i]);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::non_finite) << "rank " << r << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 0's range"), std::string::npos) << e.what();
    }
    EXPECT_EQ(engines[i]->state_digest(), before[i]) << "rank " << r;
    EXPECT_EQ(engines[i]->committed_windows(), 0u) << "rank " << r;
  }
}

TEST(ExchangeKind, ReductionOverAnOrderMatchingTransportIsRefusedNamingWhy) {
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < 3; ++r)
    models.push_back(testing::make_model({2000}, DType::float32, 40));
  EngineOptions options = testing::small_options();
  options.exchange = Exchange::reduction;
  auto transports = testing::make_test_group("ordered", 3);
  std::vector<std::unique_ptr<Engine>> engines(3);
  testing::rethrow_first(testing::run_ranks(3, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    engines[i] =
        std::make_unique<Engine>(testing::views_of(models[i]), options, std::move(transports[i]));
  }));
  for (int r = 0; r < 3; ++r)
    train(models[static_cast<std::size_t>(r)], Sets::partial, r, 3, 0);
  const auto errors = testing::run_ranks(
      3, [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); });
  for (const auto& error : errors) {
    ASSERT_TRUE(error);
    try {
      std::rethrow_exception(error);
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("exchange=reduction"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace pulseloco
