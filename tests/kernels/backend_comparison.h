// Runs the same windows through two KernelBackends and requires identical bits at every step:
// the gate's result and entries, the aggregate, the committed residual, m, θ_g and θ_l, over
// several windows with R replicas per backend (each holding its own θ_g and m, as workers do),
// plus the dense helpers and the state digest. Used for CPU portable vs AVX2
// (backend_comparison_test.cpp) and for CPU vs CUDA (tests/gpu/window_kernels_cuda_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "kernels/kernel_backend.h"
#include "kernels/window_test_inputs.h"

namespace pulseloco::testing {

struct BackendScenario {
  std::size_t count = 0;
  DType local_dtype = DType::float32;
  kernels::Bf16Delta bf16_delta = kernels::Bf16Delta::exact;
  int ranks = 1;
  int windows = 3;
  std::uint64_t chunk = 1000;
  bool edge_cases = true;
  std::uint64_t seed = 1;
};

inline std::string describe(const BackendScenario& s) {
  return "count " + std::to_string(s.count) + ", " +
         local_kind_name({s.local_dtype, s.bf16_delta}) + " local, R " + std::to_string(s.ranks) +
         ", chunk " + std::to_string(s.chunk);
}

inline ::testing::AssertionResult same_bytes(const void* a, const void* b, std::size_t count,
                                             std::size_t element_size, const std::string& what) {
  if (count == 0 || std::memcmp(a, b, count * element_size) == 0)
    return ::testing::AssertionSuccess();
  for (std::size_t i = 0; i < count; ++i) {
    const auto* x = static_cast<const unsigned char*>(a) + i * element_size;
    const auto* y = static_cast<const unsigned char*>(b) + i * element_size;
    if (std::memcmp(x, y, element_size) != 0) {
      std::uint32_t vx = 0, vy = 0;
      std::memcpy(&vx, x, element_size);
      std::memcpy(&vy, y, element_size);
      return ::testing::AssertionFailure()
             << what << ": first difference at element " << i << " of " << count << ": " << std::hex
             << "0x" << vx << " vs 0x" << vy;
    }
  }
  return ::testing::AssertionFailure() << what << ": unreachable";
}

inline ::testing::AssertionResult same_floats(const std::vector<float>& a,
                                              const std::vector<float>& b,
                                              const std::string& what) {
  if (a.size() != b.size())
    return ::testing::AssertionFailure() << what << ": sizes " << a.size() << " and " << b.size();
  return same_bytes(a.data(), b.data(), a.size(), sizeof(float), what);
}

namespace backend_comparison_detail {

struct Replica {
  std::vector<float> global;
  std::vector<float> momentum;
  LocalWeights local;
  std::vector<float> residual;
};

struct Chunk {
  std::uint64_t begin;
  std::uint64_t count;
};

inline void* local_at(LocalWeights& local, std::uint64_t begin) {
  return static_cast<char*>(local.data()) + begin * dtype_size(local.dtype());
}
inline const void* local_at(const LocalWeights& local, std::uint64_t begin) {
  return static_cast<const char*>(local.data()) + begin * dtype_size(local.dtype());
}

}  // namespace backend_comparison_detail

// Fails the calling test (with ASSERT semantics: use ASSERT_NO_FATAL_FAILURE around it).
inline void compare_backends(KernelBackend& expected, KernelBackend& actual,
                             const BackendScenario& s) {
  using namespace backend_comparison_detail;
  SCOPED_TRACE(describe(s) + ", " + expected.name() + " vs " + actual.name());
  const std::size_t n = s.count;
  const auto ranks = static_cast<std::size_t>(s.ranks);
  const float lr = s.local_dtype == DType::bfloat16 ? 3e-4f : 3e-6f;

  std::vector<float> global = make_global_weights(n, s.seed);
  std::vector<LocalWeights> locals(ranks, LocalWeights(s.local_dtype, n));
  std::vector<std::vector<float>> residuals(ranks, std::vector<float>(n, 0.0f));
  for (std::size_t r = 0; r < ranks; ++r) {
    cast_global_into(global, locals[r]);
    apply_inner_steps(locals[r], lr, 8, s.seed * 1000 + r);
  }
  if (s.edge_cases) inject_edge_cases(global, locals, residuals);
  std::vector<Replica> side[2];
  for (auto& replicas : side) {
    for (std::size_t r = 0; r < ranks; ++r)
      replicas.push_back(Replica{global, std::vector<float>(n, 0.0f), locals[r], residuals[r]});
  }
  KernelBackend* backends[2] = {&expected, &actual};

  std::vector<Chunk> chunks;
  for (std::uint64_t begin = 0; begin < n; begin += s.chunk)
    chunks.push_back({begin, std::min<std::uint64_t>(s.chunk, n - begin)});

  for (int window = 0; window < s.windows; ++window) {
    SCOPED_TRACE("window " + std::to_string(window));
    if (window > 0) {
      for (auto& replicas : side) {
        for (std::size_t r = 0; r < ranks; ++r) {
          apply_inner_steps(replicas[r].local, lr, 8,
                            s.seed * 1000 + 100 * static_cast<std::uint64_t>(window) + r);
        }
      }
    }
    // Gate: entries[side][rank][chunk].
    std::vector<std::vector<std::vector<std::uint32_t>>> offsets[2];
    std::vector<std::vector<std::vector<float>>> values[2];
    for (int b = 0; b < 2; ++b) {
      offsets[b].resize(ranks);
      values[b].resize(ranks);
      for (std::size_t r = 0; r < ranks; ++r) {
        const Replica& replica = side[b][r];
        for (const Chunk& chunk : chunks) {
          std::vector<std::uint32_t> chunk_offsets;
          std::vector<float> chunk_values;
          const kernels::GateResult result = backends[b]->gate(
              kernels::GateChunk{.global = replica.global.data() + chunk.begin,
                                 .local = local_at(replica.local, chunk.begin),
                                 .local_dtype = s.local_dtype,
                                 .residual = replica.residual.data() + chunk.begin,
                                 .count = chunk.count,
                                 .bf16_delta = s.bf16_delta},
              chunk_offsets, chunk_values);
          ASSERT_FALSE(result.non_finite_offset.has_value()) << backends[b]->name();
          ASSERT_EQ(result.fired, chunk_offsets.size());
          offsets[b][r].push_back(std::move(chunk_offsets));
          values[b][r].push_back(std::move(chunk_values));
        }
      }
    }
    for (std::size_t r = 0; r < ranks; ++r) {
      for (std::size_t c = 0; c < chunks.size(); ++c) {
        const std::string where = "rank " + std::to_string(r) + ", chunk " + std::to_string(c);
        ASSERT_EQ(offsets[0][r][c], offsets[1][r][c]) << "fired offsets, " << where;
        ASSERT_TRUE(same_floats(values[0][r][c], values[1][r][c], "sent values, " + where));
      }
    }

    // Aggregate, then the end of the window (fused or separate, alternating) on every replica.
    const kernels::OuterStepParams params{.lr = 0.7f, .momentum = 0.9f, .first_step = window == 0};
    std::vector<float> g[2];
    for (int b = 0; b < 2; ++b) {
      for (std::size_t r = 0; r < ranks; ++r) {
        Replica& replica = side[b][r];
        g[b].assign(n, -1.0f);
        const bool fused = (window + static_cast<int>(r)) % 2 == 1;
        for (std::size_t c = 0; c < chunks.size(); ++c) {
          const Chunk& chunk = chunks[c];
          std::vector<kernels::SparseEntries> entries;
          for (std::size_t from = 0; from < ranks; ++from)
            entries.push_back({offsets[b][from][c], values[b][from][c]});
          float* chunk_g = g[b].data() + chunk.begin;
          backends[b]->aggregate(entries, chunk_g, chunk.count);
          if (fused) {
            backends[b]->commit_and_outer_step(
                kernels::WindowChunk{.global = replica.global.data() + chunk.begin,
                                     .momentum = replica.momentum.data() + chunk.begin,
                                     .residual = replica.residual.data() + chunk.begin,
                                     .local = local_at(replica.local, chunk.begin),
                                     .local_dtype = s.local_dtype,
                                     .count = chunk.count,
                                     .bf16_delta = s.bf16_delta},
                chunk_g, params);
          } else {
            backends[b]->commit_residual(
                kernels::GateChunk{.global = replica.global.data() + chunk.begin,
                                   .local = local_at(replica.local, chunk.begin),
                                   .local_dtype = s.local_dtype,
                                   .residual = replica.residual.data() + chunk.begin,
                                   .count = chunk.count,
                                   .bf16_delta = s.bf16_delta},
                replica.residual.data() + chunk.begin);
            backends[b]->outer_step(
                replica.global.data() + chunk.begin, replica.momentum.data() + chunk.begin, chunk_g,
                local_at(replica.local, chunk.begin), s.local_dtype, chunk.count, params);
          }
        }
      }
      // Every replica of a backend computed the same aggregate; keep the last one's.
    }
    ASSERT_TRUE(same_floats(g[0], g[1], "aggregate"));
    for (std::size_t r = 0; r < ranks; ++r) {
      const std::string rank = ", replica " + std::to_string(r);
      const Replica& a = side[0][r];
      const Replica& b = side[1][r];
      ASSERT_TRUE(same_floats(a.residual, b.residual, "residual" + rank));
      ASSERT_TRUE(same_floats(a.momentum, b.momentum, "momentum" + rank));
      ASSERT_TRUE(same_floats(a.global, b.global, "global" + rank));
      ASSERT_TRUE(same_bytes(a.local.data(), b.local.data(), n, dtype_size(s.local_dtype),
                             "reset local" + rank));
      ASSERT_TRUE(same_floats(a.global, side[0][0].global, "replicas agree" + rank));
      ASSERT_EQ(expected.state_digest(a.global, a.momentum),
                actual.state_digest(b.global, b.momentum))
          << "state digest" << rank;
    }
    ASSERT_EQ(expected.state_digest(side[0][0].global, {}),
              actual.state_digest(side[1][0].global, {}))
        << "state digest without momentum";
  }

  // The dense helpers on the final state.
  const Replica& a = side[0][0];
  std::vector<float> delta[2], scaled[2];
  std::vector<std::uint8_t> reset_bytes[2];
  LocalWeights moved = a.local;  // θ_l after another inner phase
  apply_inner_steps(moved, lr, 8, s.seed + 77);
  for (int b = 0; b < 2; ++b) {
    delta[b].assign(n, 0.0f);
    backends[b]->pseudo_gradient(a.global.data(), moved.data(), s.local_dtype, s.bf16_delta,
                                 delta[b].data(), n);
    scaled[b] = a.residual;
    backends[b]->divide(scaled[b].data(), n, static_cast<float>(s.ranks + 2));
    reset_bytes[b].assign(n * dtype_size(s.local_dtype), 0);
    std::vector<float> shifted = a.global;
    for (float& value : shifted)
      value = value * 1.0009765625f;  // off the bf16 grid, ties included
    backends[b]->reset_local(shifted.data(), reset_bytes[b].data(), s.local_dtype, n);
  }
  ASSERT_TRUE(same_floats(delta[0], delta[1], "pseudo_gradient"));
  ASSERT_TRUE(same_floats(scaled[0], scaled[1], "divide"));
  ASSERT_EQ(reset_bytes[0], reset_bytes[1]) << "reset_local";
}

}  // namespace pulseloco::testing
