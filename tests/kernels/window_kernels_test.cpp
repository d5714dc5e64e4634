// The CPU window kernels without libtorch: the semantics of each step on hand-built inputs,
// identical bits from the portable and the AVX2 paths on arbitrary bit patterns, and argument
// checks. (window_kernels_reference_test.cpp compares against the libtorch reference.)
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/kernels/window_kernels.h>
#include "kernels/window_test_inputs.h"

namespace pulseloco::kernels {
namespace {

using testing::FastRandom;
using testing::LocalWeights;

std::uint32_t bits(float value) {
  return std::bit_cast<std::uint32_t>(value);
}

struct GateOutput {
  GateResult result;
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
};

GateOutput run_gate(const std::vector<float>& global, const LocalWeights& local,
                    const std::vector<float>& residual, CpuIsa isa = active_cpu_isa()) {
  std::vector<std::uint32_t> offsets(global.size());
  std::vector<float> values(global.size());
  const GateResult result = gate(GateChunk{.global = global.data(),
                                           .local = local.data(),
                                           .local_dtype = local.dtype(),
                                           .residual = residual.data(),
                                           .count = global.size()},
                                 offsets.data(), values.data(), isa);
  const auto fired = static_cast<std::ptrdiff_t>(result.fired);
  return GateOutput{result, std::vector<std::uint32_t>(offsets.begin(), offsets.begin() + fired),
                    std::vector<float>(values.begin(), values.begin() + fired)};
}

// --- Semantics on hand-built inputs ------------------------------------------------------------

TEST(Gate, FiresExactlyWhenTheBf16ValueWouldChange) {
  // θ_g = 1.0: bf16 neighbours are 1 - 2^-8 below and 1 + 2^-7 above.
  const float one = 1.0f;
  const std::vector<float> global{one, one, one, one, one, one};
  LocalWeights local(DType::float32, 6);
  // s = θ_g - θ_l; w̃ = θ_l. Fires iff bf16(θ_l) != bf16(1).
  const float locals[6] = {
      one,                       // no move: s = 0
      one + 0x1p-8f,             // half way up (tie between 1 and 1 + 2^-7): ties to even 1.0
      one + 0x1p-8f + 0x1p-23f,  // just past the tie: rounds up, fires
      one - 0x1p-9f,             // exact tie below (1 - 2^-9): ties to even 1.0
      one - 0x1p-9f - 0x1p-23f,  // just past: rounds down to 1 - 2^-8, fires
      one + 0x1p-20f,            // tiny move: invisible in bf16
  };
  for (int i = 0; i < 6; ++i)
    local.set(static_cast<std::size_t>(i), locals[i]);
  const GateOutput out = run_gate(global, local, std::vector<float>(6, 0.0f));
  ASSERT_FALSE(out.result.non_finite_offset);
  ASSERT_EQ(out.offsets, (std::vector<std::uint32_t>{2, 4}));
  EXPECT_EQ(bits(out.values[0]), bits(one - locals[2]));
  EXPECT_EQ(bits(out.values[1]), bits(one - locals[4]));
}

TEST(Gate, ResidualAccumulatesAndZeroNeverFires) {
  // e carries earlier invisible changes: s = e + Δ may cross the gap although Δ alone does not.
  const std::vector<float> global{0.5f, 0.5f, 0.0f, -0.0f, 0.0f};
  LocalWeights local(DType::float32, 5);
  local.set(0, 0.5f - 0x1p-12f);  // Δ = 2^-12, half gap at 0.5 is 2^-10
  local.set(1, 0.5f - 0x1p-12f);
  local.set(2, 0.0f);
  local.set(3, 0.0f);
  local.set(4, -0.0f);
  const std::vector<float> residual{0.0f, 0x1p-9f, -0.0f, -0.0f, 0.0f};
  const GateOutput out = run_gate(global, local, residual);
  ASSERT_EQ(out.offsets, (std::vector<std::uint32_t>{1}));
  EXPECT_EQ(out.values[0], 0x1p-9f + 0x1p-12f);
}

TEST(Gate, Bf16LocalWeightsIgnoreTheCastResidue) {
  // θ_g off the bf16 grid; θ_l = bf16(θ_g): Δ must be 0, not θ_g - bf16(θ_g).
  const std::vector<float> global{0.0123456f, -1.2345678f, 3.0e-39f};
  LocalWeights local(DType::bfloat16, 3);
  testing::cast_global_into(global, local);
  const GateOutput out = run_gate(global, local, std::vector<float>(3, 0.0f));
  EXPECT_EQ(out.result.fired, 0u);
  std::vector<float> delta(3, 1.0f);
  pseudo_gradient(global.data(), local.data(), DType::bfloat16, Bf16Delta::exact, delta.data(), 3);
  for (float d : delta)
    EXPECT_EQ(bits(d), 0u);
}

TEST(Gate, ReportsTheLowestNonFiniteOffsetAndSendsNothing) {
  std::vector<float> global(40, 0.25f);
  LocalWeights local(DType::float32, 40);
  for (std::size_t i = 0; i < 40; ++i)
    local.set(i, 0.2f);  // every element fires
  std::vector<float> residual(40, 0.0f);
  residual[33] = std::numeric_limits<float>::infinity();
  residual[21] = std::numeric_limits<float>::quiet_NaN();
  for (CpuIsa isa : {CpuIsa::portable, active_cpu_isa()}) {
    const GateOutput out = run_gate(global, local, residual, isa);
    ASSERT_TRUE(out.result.non_finite_offset);
    EXPECT_EQ(*out.result.non_finite_offset, 21u);
    EXPECT_EQ(out.result.fired, 0u);
  }
  residual[21] = 0.0f;
  EXPECT_EQ(*run_gate(global, local, residual).result.non_finite_offset, 33u);
  EXPECT_NO_THROW(check_finite(GateResult{.fired = 3}, "w", 100));
}

TEST(Gate, CheckFiniteNamesTensorIndexAndRank) {
  try {
    check_finite(GateResult{.fired = 0, .non_finite_offset = 7}, "embed.weight", 4096, 3);
    FAIL() << "no exception";
  } catch (const NonFiniteError& error) {
    EXPECT_EQ(error.context().tensor, "embed.weight");
    EXPECT_EQ(error.context().index, 4103u);
    EXPECT_EQ(error.context().rank, 3);
    EXPECT_NE(std::string(error.what()).find("index 4103"), std::string::npos);
  }
}

TEST(CommitResidual, ZeroWhereFiredSElsewhereInPlaceOrNot) {
  const std::size_t n = 1000;
  std::vector<float> global = testing::make_global_weights(n, 21);
  LocalWeights local(DType::float32, n);
  testing::cast_global_into(global, local);
  testing::apply_inner_steps(local, 1e-4f, 8, 22);
  std::vector<float> residual(n);
  FastRandom random(23);
  for (float& e : residual)
    e = 1e-5f * random.normal();
  const GateOutput out = run_gate(global, local, residual);
  ASSERT_GT(out.result.fired, 0u);
  ASSERT_LT(out.result.fired, n);

  std::vector<float> committed(n, -1.0f);
  const GateChunk chunk{.global = global.data(),
                        .local = local.data(),
                        .local_dtype = DType::float32,
                        .residual = residual.data(),
                        .count = n};
  commit_residual(chunk, committed.data());
  std::size_t next_fired = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const float s = residual[i] + (global[i] - local.get(i));
    if (next_fired < out.offsets.size() && out.offsets[next_fired] == i) {
      EXPECT_EQ(bits(committed[i]), 0u) << i;  // +0
      ++next_fired;
    } else {
      EXPECT_EQ(bits(committed[i]), bits(s)) << i;
    }
  }
  commit_residual(chunk, residual.data());  // in place
  EXPECT_EQ(std::memcmp(residual.data(), committed.data(), n * sizeof(float)), 0);
}

TEST(Aggregate, AddsInRankOrderThenTrulyDivides) {
  // Rank order matters in fp32: ((0 + 1e8) + 1) + -1e8 = 0, whereas 1 + (1e8 + -1e8) = 1.
  const std::vector<std::uint32_t> o0{0, 2}, o1{0, 1}, o2{0, 2};
  const std::vector<float> v0{1e8f, 1.0f}, v1{1.0f, -0.0f}, v2{-1e8f, 4.0f};
  const std::vector<SparseEntries> ranks{{o0, v0}, {o1, v1}, {o2, v2}};
  std::vector<float> g(4, 123.0f);
  for (CpuIsa isa : {CpuIsa::portable, active_cpu_isa()}) {
    aggregate(ranks, g.data(), 4, isa);
    EXPECT_EQ(bits(g[0]), bits(0.0f));
    EXPECT_EQ(bits(g[1]), bits(0.0f));      // +0 + -0 = +0
    EXPECT_EQ(g[2], 5.0f / 3.0f);           // a true division ...
    EXPECT_NE(g[2], 5.0f * (1.0f / 3.0f));  // ... not a multiplication by 1/R
    EXPECT_EQ(bits(g[3]), bits(0.0f));
  }
}

TEST(Aggregate, RejectsBadEntriesBeforeWriting) {
  const std::vector<std::uint32_t> good{1, 3}, unsorted{3, 1}, repeated{2, 2}, beyond{1, 4};
  const std::vector<float> two{1.0f, 2.0f}, one{1.0f};
  std::vector<float> g(4, 7.0f);
  const auto rejects = [&](std::vector<SparseEntries> ranks, std::uint64_t count) {
    EXPECT_THROW(aggregate(ranks, g.data(), count), InvalidArgument);
    for (float value : g)
      EXPECT_EQ(value, 7.0f);
  };
  rejects({{good, two}, {unsorted, two}}, 4);
  rejects({{good, two}, {repeated, two}}, 4);
  rejects({{good, two}, {beyond, two}}, 4);
  rejects({{good, one}}, 4);
  rejects({}, 4);
  try {
    const std::vector<SparseEntries> ranks{{good, two}, {beyond, two}};
    aggregate(ranks, g.data(), 4);
  } catch (const InvalidArgument& error) {
    EXPECT_EQ(error.context().peer, 1);
    EXPECT_EQ(error.context().index, 1u);
  }
}

// Inputs where a fused multiply-add and a separate multiply and add differ: the kernel must
// round m's product separately and fuse d and θ_g, whichever way the compiler is tempted.
TEST(OuterStep, RoundsExactlyAsPyTorchSgdNesterov) {
  const float lr = 0.7f, mu = 0.9f;
  FastRandom random(5);
  std::vector<float> global, momentum, g;
  while (global.size() < 64) {
    const float m = random.normal(), gv = random.normal(), theta = random.normal();
    const float m_new = (mu * m) + gv;
    const bool m_sensitive = m_new != std::fma(mu, m, gv);
    const float d = std::fma(mu, m_new, gv);
    const bool d_sensitive = d != (mu * m_new) + gv;
    const bool theta_sensitive = std::fma(-lr, d, theta) != theta + (-lr * d);
    if (m_sensitive && d_sensitive && theta_sensitive) {
      global.push_back(theta);
      momentum.push_back(m);
      g.push_back(gv);
    }
  }
  const std::size_t n = global.size();
  for (CpuIsa isa : {CpuIsa::portable, active_cpu_isa()}) {
    for (bool first : {true, false}) {
      std::vector<float> theta = global, m = momentum;
      LocalWeights local(DType::bfloat16, n);
      outer_step(theta.data(), m.data(), g.data(), local.data(), DType::bfloat16, n,
                 OuterStepParams{.lr = lr, .momentum = mu, .first_step = first}, isa);
      for (std::size_t i = 0; i < n; ++i) {
        const float m_expected = first ? g[i] : (mu * momentum[i]) + g[i];
        const float d = std::fma(mu, m_expected, g[i]);
        const float theta_expected = std::fma(-lr, d, global[i]);
        ASSERT_EQ(bits(m[i]), bits(m_expected)) << i;
        ASSERT_EQ(bits(theta[i]), bits(theta_expected)) << i;
        ASSERT_EQ(local.get(i), round_to_bf16(theta_expected)) << i;
      }
    }
  }
}

TEST(OuterStep, MomentumMovesElementsWithoutGradient) {
  std::vector<float> theta{1.0f}, m{0.5f};
  const std::vector<float> g{0.0f};
  LocalWeights local(DType::float32, 1);
  outer_step(theta.data(), m.data(), g.data(), local.data(), DType::float32, 1, OuterStepParams{});
  EXPECT_EQ(m[0], 0.9f * 0.5f);
  EXPECT_EQ(theta[0], std::fma(-0.7f, std::fma(0.9f, 0.9f * 0.5f, 0.0f), 1.0f));
  EXPECT_EQ(local.get(0), theta[0]);
}

TEST(ResetLocal, CastsWithRoundToNearestEven) {
  const std::vector<float> global{1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -0.0f, 1e-40f, 0.0123f};
  LocalWeights bf16(DType::bfloat16, global.size()), f32(DType::float32, global.size());
  for (CpuIsa isa : {CpuIsa::portable, active_cpu_isa()}) {
    reset_local(global.data(), bf16.data(), DType::bfloat16, global.size(), isa);
    reset_local(global.data(), f32.data(), DType::float32, global.size(), isa);
    EXPECT_EQ(bf16.get(0), 1.0f);                // tie to even (down)
    EXPECT_EQ(bf16.get(1), 1.0f + 4 * 0x1p-8f);  // tie to even (up)
    EXPECT_EQ(bits(bf16.get(2)), bits(-0.0f));
    for (std::size_t i = 0; i < global.size(); ++i) {
      EXPECT_EQ(bits(bf16.get(i)), bits(round_to_bf16(global[i])));
      EXPECT_EQ(bits(f32.get(i)), bits(global[i]));
    }
  }
}

TEST(DenseHelpers, PseudoGradientAndDivide) {
  const std::vector<float> global{1.0f, 0.3f, -2.0f};
  LocalWeights local(DType::float32, 3);
  local.set(0, 0.5f);
  local.set(1, 0.1f);
  local.set(2, -2.0f);
  std::vector<float> delta(3);
  pseudo_gradient(global.data(), local.data(), DType::float32, Bf16Delta::exact, delta.data(), 3);
  EXPECT_EQ(delta[0], 0.5f);
  EXPECT_EQ(delta[1], 0.3f - 0.1f);
  EXPECT_EQ(bits(delta[2]), 0u);
  std::vector<float> values{11.0f, 1.0f, -0.0f};
  divide(values.data(), 3, 3.0f);
  EXPECT_EQ(values[0], 11.0f / 3.0f);
  EXPECT_EQ(values[1], 1.0f / 3.0f);
  EXPECT_EQ(bits(values[2]), bits(-0.0f));
}

TEST(StateDigest, CoversBothTensorsAndEveryBit) {
  std::vector<float> global = testing::make_global_weights(1000, 1);
  std::vector<float> momentum = testing::make_global_weights(1000, 2);
  const Digest base = state_digest(global, momentum);
  const Digest parts[2] = {buffer_digest(std::as_bytes(std::span<const float>(global))),
                           buffer_digest(std::as_bytes(std::span<const float>(momentum)))};
  EXPECT_EQ(base, combine_digests(parts));
  EXPECT_NE(base, state_digest(global, {}));
  EXPECT_NE(base, state_digest(momentum, global));  // order matters
  global[999] = std::bit_cast<float>(bits(global[999]) ^ 1u);
  EXPECT_NE(base, state_digest(global, momentum));
  global[999] = std::bit_cast<float>(bits(global[999]) ^ 1u);
  momentum[0] = -momentum[0];
  EXPECT_NE(base, state_digest(global, momentum));
}

TEST(Arguments, AreCheckedBeforeAnyWork) {
  std::vector<float> buffer(16);
  const GateChunk too_big{.global = buffer.data(),
                          .local = buffer.data(),
                          .residual = buffer.data(),
                          .count = kMaxChunkElements + 1};
  std::vector<std::uint32_t> offsets(16);
  EXPECT_THROW((void)gate(too_big, offsets.data(), buffer.data()), InvalidArgument);
  const GateChunk null_local{
      .global = buffer.data(), .local = nullptr, .residual = buffer.data(), .count = 4};
  EXPECT_THROW((void)gate(null_local, offsets.data(), buffer.data()), InvalidArgument);
  const GateChunk bad_dtype{.global = buffer.data(),
                            .local = buffer.data(),
                            .local_dtype = static_cast<DType>(7),
                            .residual = buffer.data(),
                            .count = 4};
  EXPECT_THROW(commit_residual(bad_dtype, buffer.data()), InvalidArgument);
  EXPECT_THROW(
      outer_step(buffer.data(), buffer.data(), buffer.data(), buffer.data(), DType::float32, 4,
                 OuterStepParams{.lr = std::numeric_limits<float>::quiet_NaN()}),
      InvalidArgument);
  // Empty chunks need no buffers.
  const GateChunk empty{};
  EXPECT_EQ(gate(empty, nullptr, nullptr).fired, 0u);
  if (!cpu_has_avx2()) {
    EXPECT_THROW(divide(buffer.data(), 16, 2.0f, CpuIsa::avx2), InvalidArgument);
  }
}

#if defined(__x86_64__)
// A caller that flushes subnormals (MXCSR FTZ + DAZ, as torch.set_flush_denormal(True) sets) or
// rounds differently must not change the kernels' bits; its mode is restored afterwards.
TEST(FloatingPointMode, CallerModeDoesNotChangeResultsAndIsRestored) {
  const std::size_t n = 1000;
  std::vector<float> global(n), residual(n), g(n);
  LocalWeights local(DType::float32, n);
  FastRandom random(8);
  for (std::size_t i = 0; i < n; ++i) {
    global[i] = 1e-39f * random.normal();  // subnormal
    local.set(i, global[i] * 0.5f);
    residual[i] = 1e-40f * random.normal();
    g[i] = 1e-39f * random.normal();
  }
  const auto run_all = [&](CpuIsa isa) {
    std::vector<float> out = run_gate(global, local, residual, isa).values;
    std::vector<float> theta = global, m = residual, e(n), delta(n);
    LocalWeights reset(DType::float32, n);
    commit_residual(GateChunk{.global = global.data(),
                              .local = local.data(),
                              .residual = residual.data(),
                              .count = n},
                    e.data(), isa);
    outer_step(theta.data(), m.data(), g.data(), reset.data(), DType::float32, n, OuterStepParams{},
               isa);
    pseudo_gradient(global.data(), local.data(), DType::float32, Bf16Delta::exact, delta.data(), n,
                    isa);
    for (const auto* part : {&e, &theta, &m, &delta})
      out.insert(out.end(), part->begin(), part->end());
    return out;
  };
  for (CpuIsa isa : {CpuIsa::portable, active_cpu_isa()}) {
    const std::vector<float> ieee = run_all(isa);
    const unsigned before = _mm_getcsr();
    const unsigned flushing =
        (before | (1u << 15) | (1u << 6) | (3u << 13)) & ~0x3Fu;  // FTZ, DAZ, toward zero
    _mm_setcsr(flushing);
    const std::vector<float> under_caller_mode = run_all(isa);
    const unsigned after = _mm_getcsr();
    _mm_setcsr(before);
    EXPECT_EQ(after & ~0x3Fu, flushing);  // restored (exception flags aside)
    ASSERT_EQ(ieee.size(), under_caller_mode.size());
    EXPECT_EQ(std::memcmp(ieee.data(), under_caller_mode.data(), ieee.size() * 4), 0);
  }
}
#endif

// --- Both definitions of Δ against a scalar statement of steps 1-5 ----------------------------

struct ReferenceLane {
  float s = 0.0f;
  bool fire = false;
};

// Steps 1-5 for one element, written from docs/algorithm.md with base/bf16.h's rounding and
// nothing of the kernels: Δ = float(bf16(θ_g)) − θ_l for bf16 local weights with `exact`,
// Δ = θ_g − float(θ_l) otherwise; the comparison is numeric (+0 equals −0).
ReferenceLane reference_lane(float global, float local, float residual, DType dtype,
                             Bf16Delta bf16_delta) {
  const bool through_cast = dtype == DType::bfloat16 && bf16_delta == Bf16Delta::exact;
  const float delta = (through_cast ? round_to_bf16(global) : global) - local;
  const float s = residual + delta;
  const float corrected = global - s;
  return {s, !(round_to_bf16(global) == round_to_bf16(corrected))};
}

class Bf16DeltaVsScalarReference : public ::testing::TestWithParam<testing::LocalKind> {};

TEST_P(Bf16DeltaVsScalarReference, GateCommitAndPseudoGradientOnEveryIsa) {
  const auto [dtype, bf16_delta] = GetParam();
  const std::size_t n = 4099;
  const std::vector<float> global = testing::make_global_weights(n, 21);
  std::vector<LocalWeights> locals(1, LocalWeights(dtype, n));
  std::vector<std::vector<float>> residuals(1, std::vector<float>(n, 0.0f));
  testing::cast_global_into(global, locals[0]);
  testing::apply_inner_steps(locals[0], dtype == DType::bfloat16 ? 3e-4f : 3e-6f, 8, 22);
  std::vector<float> global_with_edges = global;
  testing::inject_edge_cases(global_with_edges, locals, residuals);
  const LocalWeights& local = locals[0];
  // A residual carried from earlier windows on every other element.
  std::vector<float> residual = residuals[0];
  const std::vector<float> carried = testing::arbitrary_values(n, 23, true);
  for (std::size_t i = 0; i < n; i += 2)
    residual[i] += 1e-6f * carried[i];

  std::vector<std::uint32_t> expected_offsets;
  std::vector<float> expected_values, expected_residual(n), expected_delta(n);
  for (std::size_t i = 0; i < n; ++i) {
    const ReferenceLane lane =
        reference_lane(global_with_edges[i], local.get(i), residual[i], dtype, bf16_delta);
    if (lane.fire) {
      expected_offsets.push_back(static_cast<std::uint32_t>(i));
      expected_values.push_back(lane.s);
    }
    expected_residual[i] = lane.fire ? 0.0f : lane.s;
    expected_delta[i] =
        reference_lane(global_with_edges[i], local.get(i), 0.0f, dtype, bf16_delta).s;
  }
  ASSERT_GT(expected_offsets.size(), 0u);
  ASSERT_LT(expected_offsets.size(), n);

  std::vector<CpuIsa> isas{CpuIsa::portable};
  if (cpu_has_avx2()) isas.push_back(CpuIsa::avx2);
  for (CpuIsa isa : isas) {
    SCOPED_TRACE(std::string(cpu_isa_name(isa)));
    const GateChunk chunk{.global = global_with_edges.data(),
                          .local = local.data(),
                          .local_dtype = dtype,
                          .residual = residual.data(),
                          .count = n,
                          .bf16_delta = bf16_delta};
    std::vector<std::uint32_t> offsets(n);
    std::vector<float> values(n);
    const GateResult result = gate(chunk, offsets.data(), values.data(), isa);
    ASSERT_FALSE(result.non_finite_offset.has_value());
    offsets.resize(result.fired);
    values.resize(result.fired);
    EXPECT_EQ(offsets, expected_offsets);
    ASSERT_EQ(values.size(), expected_values.size());
    for (std::size_t k = 0; k < values.size(); ++k)
      ASSERT_EQ(bits(values[k]), bits(expected_values[k])) << "sent value " << k;

    std::vector<float> committed(n);
    commit_residual(chunk, committed.data(), isa);
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(bits(committed[i]), bits(expected_residual[i])) << "residual " << i;

    std::vector<float> theta = global_with_edges, momentum(n, 0.0f), fused_residual = residual;
    LocalWeights fused_local = local;
    const std::vector<float> g(n, 0.0f);
    commit_and_outer_step(WindowChunk{.global = theta.data(),
                                      .momentum = momentum.data(),
                                      .residual = fused_residual.data(),
                                      .local = fused_local.data(),
                                      .local_dtype = dtype,
                                      .count = n,
                                      .bf16_delta = bf16_delta},
                          g.data(), OuterStepParams{.first_step = true}, isa);
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(bits(fused_residual[i]), bits(expected_residual[i])) << "fused residual " << i;

    std::vector<float> delta(n);
    pseudo_gradient(global_with_edges.data(), local.data(), dtype, bf16_delta, delta.data(), n,
                    isa);
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(bits(delta[i]), bits(expected_delta[i])) << "pseudo-gradient " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(LocalKinds, Bf16DeltaVsScalarReference,
                         ::testing::ValuesIn(testing::local_kinds()), [](const auto& param_info) {
                           return testing::local_kind_name(param_info.param);
                         });

// An untouched bf16 element (θ_l = bf16(θ_g), θ_g off the bf16 grid): `exact` carries nothing,
// `authors` carries the cast residue θ_g − bf16(θ_g) into e. With fp32 local weights the two
// choices give the same bits.
TEST(Bf16Delta, ChoicesDifferOnBf16LocalWeightsAndCoincideOnFp32) {
  const std::size_t n = 1000;
  const std::vector<float> global = testing::make_global_weights(n, 31);
  for (CpuIsa isa : {CpuIsa::portable, active_cpu_isa()}) {
    LocalWeights bf16_local(DType::bfloat16, n);
    testing::cast_global_into(global, bf16_local);
    std::vector<float> e_exact(n, 0.0f), e_authors(n, 0.0f);
    const auto bf16_chunk = [&](std::vector<float>& e, Bf16Delta choice) {
      return GateChunk{.global = global.data(),
                       .local = bf16_local.data(),
                       .local_dtype = DType::bfloat16,
                       .residual = e.data(),
                       .count = n,
                       .bf16_delta = choice};
    };
    commit_residual(bf16_chunk(e_exact, Bf16Delta::exact), e_exact.data(), isa);
    commit_residual(bf16_chunk(e_authors, Bf16Delta::authors), e_authors.data(), isa);
    std::size_t carrying = 0;
    for (std::size_t i = 0; i < n; ++i) {
      EXPECT_EQ(bits(e_exact[i]), 0u) << i;
      const float residue = global[i] - round_to_bf16(global[i]);
      EXPECT_EQ(bits(e_authors[i]), bits(residue)) << i;
      carrying += residue != 0.0f ? 1 : 0;
    }
    EXPECT_GT(carrying, n / 2);  // nearly every fp32 value is off the bf16 grid

    LocalWeights f32_local(DType::float32, n);
    testing::cast_global_into(global, f32_local);
    testing::apply_inner_steps(f32_local, 3e-6f, 8, 32);
    std::vector<float> e[2], delta[2];
    std::vector<std::uint32_t> offsets[2];
    std::vector<float> values[2];
    for (int c = 0; c < 2; ++c) {
      const Bf16Delta choice = c == 0 ? Bf16Delta::exact : Bf16Delta::authors;
      e[c].assign(n, 0.0f);
      const GateChunk chunk{.global = global.data(),
                            .local = f32_local.data(),
                            .local_dtype = DType::float32,
                            .residual = e[c].data(),
                            .count = n,
                            .bf16_delta = choice};
      offsets[c].resize(n);
      values[c].resize(n);
      const GateResult result = gate(chunk, offsets[c].data(), values[c].data(), isa);
      offsets[c].resize(result.fired);
      values[c].resize(result.fired);
      commit_residual(chunk, e[c].data(), isa);
      delta[c].resize(n);
      pseudo_gradient(global.data(), f32_local.data(), DType::float32, choice, delta[c].data(), n,
                      isa);
    }
    EXPECT_EQ(offsets[0], offsets[1]);
    EXPECT_EQ(std::memcmp(values[0].data(), values[1].data(), values[0].size() * 4), 0);
    EXPECT_EQ(std::memcmp(e[0].data(), e[1].data(), n * 4), 0);
    EXPECT_EQ(std::memcmp(delta[0].data(), delta[1].data(), n * 4), 0);
  }
}

TEST(Bf16Delta, NamesRoundTripAndUnknownOnesAreRefused) {
  for (Bf16Delta choice : {Bf16Delta::exact, Bf16Delta::authors})
    EXPECT_EQ(parse_bf16_delta(bf16_delta_name(choice)), choice);
  EXPECT_THROW((void)parse_bf16_delta("author"), InvalidArgument);
  std::vector<float> buffer(8, 0.0f);
  const GateChunk bad{.global = buffer.data(),
                      .local = buffer.data(),
                      .local_dtype = DType::float32,
                      .residual = buffer.data(),
                      .count = 8,
                      .bf16_delta = static_cast<Bf16Delta>(7)};
  EXPECT_THROW(commit_residual(bad, buffer.data()), InvalidArgument);
}

// --- Portable and AVX2 give identical bits ----------------------------------------------------

class IsaIdentity : public ::testing::TestWithParam<testing::LocalKind> {
 protected:
  void SetUp() override {
    if (!cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2: only the portable path exists";
  }
};

TEST_P(IsaIdentity, EveryKernel) {
  const DType dtype = GetParam().dtype;
  const Bf16Delta bf16_delta = GetParam().bf16_delta;
  std::vector<std::size_t> sizes;
  for (std::size_t n = 0; n <= 40; ++n)
    sizes.push_back(n);
  for (std::size_t n : {63u, 64u, 65u, 1000u, 4099u, 65536u})
    sizes.push_back(n);
  for (std::size_t n : sizes) {
    for (std::size_t misalign : {0u, 1u, 3u}) {
      SCOPED_TRACE("count " + std::to_string(n) + ", misaligned by " + std::to_string(misalign));
      for (bool finite : {true, false}) {
        const std::uint64_t seed = n * 31 + misalign * 7 + (finite ? 1 : 0);
        // Realistic fire rates need θ_l near θ_g: mix both kinds of local values.
        std::vector<float> global = testing::arbitrary_values(n + misalign, seed, finite);
        std::vector<float> residual = testing::arbitrary_values(n + misalign, seed + 1, finite);
        LocalWeights local(dtype, n + misalign);
        const std::vector<float> noise = testing::arbitrary_values(n + misalign, seed + 2, finite);
        for (std::size_t i = 0; i < n + misalign; ++i) {
          local.set(i, i % 3 == 0 ? noise[i] : global[i] + 1e-4f * noise[i]);
          if (i % 2 == 0) residual[i] *= 1e-3f;
        }
        const char* local_base =
            static_cast<const char*>(local.data()) + misalign * dtype_size(dtype);
        const GateChunk chunk{.global = global.data() + misalign,
                              .local = local_base,
                              .local_dtype = dtype,
                              .residual = residual.data() + misalign,
                              .count = n,
                              .bf16_delta = bf16_delta};
        std::vector<std::uint32_t> off_p(n + 1), off_a(n + 1);
        std::vector<float> val_p(n + 1), val_a(n + 1);
        const GateResult rp = gate(chunk, off_p.data(), val_p.data(), CpuIsa::portable);
        const GateResult ra = gate(chunk, off_a.data(), val_a.data(), CpuIsa::avx2);
        ASSERT_EQ(rp.fired, ra.fired);
        ASSERT_EQ(rp.non_finite_offset, ra.non_finite_offset);
        ASSERT_EQ(std::memcmp(off_p.data(), off_a.data(), rp.fired * 4), 0);
        ASSERT_EQ(std::memcmp(val_p.data(), val_a.data(), rp.fired * 4), 0);

        std::vector<float> e_p(n), e_a(n);
        commit_residual(chunk, e_p.data(), CpuIsa::portable);
        commit_residual(chunk, e_a.data(), CpuIsa::avx2);
        ASSERT_EQ(std::memcmp(e_p.data(), e_a.data(), n * 4), 0);

        std::vector<float> d_p(n), d_a(n);
        pseudo_gradient(chunk.global, chunk.local, dtype, bf16_delta, d_p.data(), n,
                        CpuIsa::portable);
        pseudo_gradient(chunk.global, chunk.local, dtype, bf16_delta, d_a.data(), n, CpuIsa::avx2);
        ASSERT_EQ(std::memcmp(d_p.data(), d_a.data(), n * 4), 0);

        std::vector<float> q_p = residual, q_a = residual;
        divide(q_p.data() + misalign, n, 3.0f, CpuIsa::portable);
        divide(q_a.data() + misalign, n, 3.0f, CpuIsa::avx2);
        ASSERT_EQ(std::memcmp(q_p.data(), q_a.data(), (n + misalign) * 4), 0);

        // The outer step sees finite state in a valid window; NaN payloads are not specified.
        if (!finite) continue;
        for (bool first : {true, false}) {
          const OuterStepParams params{.lr = 0.7f, .momentum = 0.9f, .first_step = first};
          std::vector<float> theta_p = global, theta_a = global;
          std::vector<float> m_p = testing::arbitrary_values(n + misalign, seed + 3, true),
                             m_a = m_p;
          LocalWeights l_p(dtype, n + misalign), l_a(dtype, n + misalign);
          const std::vector<float> g = testing::arbitrary_values(n + misalign, seed + 4, true);
          outer_step(theta_p.data() + misalign, m_p.data() + misalign, g.data() + misalign,
                     static_cast<char*>(l_p.data()) + misalign * dtype_size(dtype), dtype, n,
                     params, CpuIsa::portable);
          outer_step(theta_a.data() + misalign, m_a.data() + misalign, g.data() + misalign,
                     static_cast<char*>(l_a.data()) + misalign * dtype_size(dtype), dtype, n,
                     params, CpuIsa::avx2);
          ASSERT_EQ(std::memcmp(theta_p.data(), theta_a.data(), (n + misalign) * 4), 0);
          ASSERT_EQ(std::memcmp(m_p.data(), m_a.data(), (n + misalign) * 4), 0);
          ASSERT_TRUE(l_p == l_a);

          // The fused end of window equals commit_residual followed by outer_step.
          for (CpuIsa isa : {CpuIsa::portable, CpuIsa::avx2}) {
            std::vector<float> theta_f = global,
                               m_f = testing::arbitrary_values(n + misalign, seed + 3, true);
            std::vector<float> e_f = residual;
            LocalWeights l_f = local;
            commit_and_outer_step(
                WindowChunk{.global = theta_f.data() + misalign,
                            .momentum = m_f.data() + misalign,
                            .residual = e_f.data() + misalign,
                            .local = static_cast<char*>(l_f.data()) + misalign * dtype_size(dtype),
                            .local_dtype = dtype,
                            .count = n,
                            .bf16_delta = bf16_delta},
                g.data() + misalign, params, isa);
            ASSERT_EQ(std::memcmp(theta_f.data(), theta_p.data(), (n + misalign) * 4), 0);
            ASSERT_EQ(std::memcmp(m_f.data(), m_p.data(), (n + misalign) * 4), 0);
            ASSERT_EQ(std::memcmp(e_f.data() + misalign, e_p.data(), n * 4), 0);
            for (std::size_t i = misalign; i < n + misalign; ++i)
              ASSERT_EQ(bits(l_f.get(i)), bits(l_p.get(i))) << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(LocalKinds, IsaIdentity, ::testing::ValuesIn(testing::local_kinds()),
                         [](const auto& param_info) {
                           return testing::local_kind_name(param_info.param);
                         });

}  // namespace
}  // namespace pulseloco::kernels
