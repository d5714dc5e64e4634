// The CPU window kernels against the libtorch reference (torch_reference.h), bit for bit:
// the fired set, the sent values, the residual, the aggregate, m, θ_g and the reset θ_l, over
// several consecutive windows, R = 1..8 replicas, fp32 and bf16 local weights (bf16 with both
// definitions of Δ: the project's exact one and the authors' θ_g − float(θ_l)), sizes that are
// and are not multiples of the vector width and of the chunk size, edge-case values, and both
// CPU ISAs.
//
// Each rank holds its own replica of θ_g and m (as a real worker does); every replica must end
// each window identical to the reference. The reference keeps its own state throughout: after
// the first window's inputs are built, nothing flows from our kernels into the reference.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/kernels/window_kernels.h>
#include "kernels/torch_reference.h"
#include "kernels/window_test_inputs.h"

namespace pulseloco::testing {
namespace {

using kernels::GateChunk;
using kernels::GateResult;
using kernels::OuterStepParams;
using kernels::SparseEntries;

constexpr float kOuterLr = 0.7f;
constexpr float kOuterMomentum = 0.9f;

torch::Tensor to_tensor(const std::vector<float>& values) {
  return torch::from_blob(const_cast<float*>(values.data()),
                          {static_cast<std::int64_t>(values.size())}, torch::kFloat32)
      .clone();
}

torch::Tensor to_tensor(const LocalWeights& local) {
  const auto count = static_cast<std::int64_t>(local.size());
  return torch::from_blob(const_cast<void*>(local.data()), {count},
                          local.dtype() == DType::float32 ? torch::kFloat32 : torch::kBFloat16)
      .clone();
}

LocalWeights from_tensor(const torch::Tensor& tensor) {
  const torch::Tensor contiguous = tensor.contiguous();
  const DType dtype =
      contiguous.scalar_type() == torch::kFloat32 ? DType::float32 : DType::bfloat16;
  LocalWeights local(dtype, static_cast<std::size_t>(contiguous.numel()));
  if (local.bytes() > 0) std::memcpy(local.data(), contiguous.data_ptr(), local.bytes());
  return local;
}

std::string hex_bits(const void* element, std::size_t size) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, element, size);
  char text[16];
  std::snprintf(text, sizeof(text), size == 4 ? "0x%08x" : "0x%04x", bits);
  return text;
}

// Bitwise equality of `count` elements of `element_size` bytes, naming the first difference.
::testing::AssertionResult same_bits(const void* ours, const torch::Tensor& reference,
                                     std::size_t count, std::size_t element_size,
                                     const std::string& what) {
  const torch::Tensor ref = reference.contiguous();
  if (static_cast<std::size_t>(ref.numel()) != count ||
      static_cast<std::size_t>(ref.element_size()) != element_size) {
    return ::testing::AssertionFailure()
           << what << ": reference has " << ref.numel() << " elements of " << ref.element_size()
           << " bytes, ours " << count << " of " << element_size;
  }
  const auto* a = static_cast<const unsigned char*>(ours);
  const auto* b = static_cast<const unsigned char*>(ref.data_ptr());
  if (count == 0 || std::memcmp(a, b, count * element_size) == 0)
    return ::testing::AssertionSuccess();
  std::size_t mismatches = 0;
  std::size_t first = count;
  for (std::size_t i = 0; i < count; ++i) {
    if (std::memcmp(a + i * element_size, b + i * element_size, element_size) != 0) {
      if (first == count) first = i;
      ++mismatches;
    }
  }
  return ::testing::AssertionFailure()
         << what << ": " << mismatches << " of " << count << " elements differ; first at index "
         << first << ": ours " << hex_bits(a + first * element_size, element_size) << ", reference "
         << hex_bits(b + first * element_size, element_size);
}

::testing::AssertionResult same_bits(const std::vector<float>& ours, const torch::Tensor& ref,
                                     const std::string& what) {
  return same_bits(ours.data(), ref, ours.size(), sizeof(float), what);
}

::testing::AssertionResult same_bits(const LocalWeights& ours, const torch::Tensor& ref,
                                     const std::string& what) {
  return same_bits(ours.data(), ref, ours.size(), dtype_size(ours.dtype()), what);
}

struct Scenario {
  std::size_t count = 0;
  DType local_dtype = DType::float32;
  kernels::Bf16Delta bf16_delta = kernels::Bf16Delta::exact;
  int ranks = 1;
  int windows = 3;
  std::uint64_t chunk = 1000;  // elements per kernel call
  CpuIsa isa = CpuIsa::portable;
  float inner_lr = 3e-6f;
  bool edge_cases = true;
  std::uint64_t seed = 1;
};

std::string describe(const Scenario& s) {
  return "count " + std::to_string(s.count) + ", " +
         local_kind_name({s.local_dtype, s.bf16_delta}) + " local, R " + std::to_string(s.ranks) +
         ", chunk " + std::to_string(s.chunk) + ", " + std::string(cpu_isa_name(s.isa));
}

// One worker replica: its copy of θ_g and m, its θ_l and e.
struct Replica {
  std::vector<float> global;
  std::vector<float> momentum;
  LocalWeights local;
  std::vector<float> residual;
};

struct ChunkRange {
  std::uint64_t begin;
  std::uint64_t count;
};

std::vector<ChunkRange> chunks_of(std::uint64_t count, std::uint64_t chunk) {
  std::vector<ChunkRange> out;
  for (std::uint64_t begin = 0; begin < count; begin += chunk)
    out.push_back({begin, std::min(chunk, count - begin)});
  return out;
}

// Runs `s.windows` windows with our kernels and with the reference, comparing every step.
void run_scenario(const Scenario& s) {
  SCOPED_TRACE(describe(s));
  const std::size_t n = s.count;
  const auto ranks = static_cast<std::size_t>(s.ranks);
  const float lr = s.local_dtype == DType::bfloat16 ? 100.0f * s.inner_lr : s.inner_lr;

  // The first window's inputs.
  std::vector<float> global = make_global_weights(n, s.seed);
  std::vector<LocalWeights> locals(ranks, LocalWeights(s.local_dtype, n));
  std::vector<std::vector<float>> residuals(ranks, std::vector<float>(n, 0.0f));
  for (std::size_t r = 0; r < ranks; ++r) {
    cast_global_into(global, locals[r]);
    apply_inner_steps(locals[r], lr, 8, s.seed * 1000 + r);
  }
  if (s.edge_cases) inject_edge_cases(global, locals, residuals);

  std::vector<Replica> replicas;
  for (std::size_t r = 0; r < ranks; ++r)
    replicas.push_back(Replica{global, std::vector<float>(n), locals[r], residuals[r]});

  ReferenceOuterOptimizer reference_outer(to_tensor(global), kOuterLr, kOuterMomentum);
  std::vector<torch::Tensor> reference_local, reference_residual;
  for (std::size_t r = 0; r < ranks; ++r) {
    reference_local.push_back(to_tensor(locals[r]));
    reference_residual.push_back(to_tensor(residuals[r]));
  }

  const std::vector<ChunkRange> chunks = chunks_of(n, s.chunk);
  std::uint64_t total_fired = 0;
  for (int window = 0; window < s.windows; ++window) {
    SCOPED_TRACE("window " + std::to_string(window));
    if (window > 0) {
      // Inner phase: the same AdamW-like steps on our θ_l and on the reference's.
      for (std::size_t r = 0; r < ranks; ++r) {
        const std::uint64_t seed = s.seed * 1000 + 100 * static_cast<std::uint64_t>(window) + r;
        apply_inner_steps(replicas[r].local, lr, 8, seed);
        LocalWeights reference = from_tensor(reference_local[r]);
        apply_inner_steps(reference, lr, 8, seed);
        reference_local[r] = to_tensor(reference);
      }
    }

    // Gate, every rank: (index, value) lists per chunk.
    std::vector<std::vector<std::vector<std::uint32_t>>> offsets(ranks);
    std::vector<std::vector<std::vector<float>>> values(ranks);
    std::vector<ReferenceMessage> reference_messages;
    for (std::size_t r = 0; r < ranks; ++r) {
      const Replica& replica = replicas[r];
      const ReferenceGate reference = reference_gate(reference_outer.global(), reference_local[r],
                                                     reference_residual[r], s.bf16_delta);
      ASSERT_FALSE(reference.non_finite_index.has_value());
      std::vector<float> sent_values;
      std::vector<std::int64_t> sent_indices;
      for (const ChunkRange& chunk : chunks) {
        std::vector<std::uint32_t> chunk_offsets(chunk.count);
        std::vector<float> chunk_values(chunk.count);
        const GateChunk gate_chunk{.global = replica.global.data() + chunk.begin,
                                   .local = static_cast<const char*>(replica.local.data()) +
                                            chunk.begin * dtype_size(s.local_dtype),
                                   .local_dtype = s.local_dtype,
                                   .residual = replica.residual.data() + chunk.begin,
                                   .count = chunk.count,
                                   .bf16_delta = s.bf16_delta};
        const GateResult result =
            kernels::gate(gate_chunk, chunk_offsets.data(), chunk_values.data(), s.isa);
        ASSERT_FALSE(result.non_finite_offset.has_value());
        // Shrink to the fired entries (erase, not resize: GCC 12 warns about resize's growth).
        chunk_offsets.erase(chunk_offsets.begin() + static_cast<std::ptrdiff_t>(result.fired),
                            chunk_offsets.end());
        chunk_values.erase(chunk_values.begin() + static_cast<std::ptrdiff_t>(result.fired),
                           chunk_values.end());
        for (std::size_t k = 0; k < result.fired; ++k) {
          sent_indices.push_back(static_cast<std::int64_t>(chunk.begin + chunk_offsets[k]));
          sent_values.push_back(chunk_values[k]);
        }
        offsets[r].push_back(std::move(chunk_offsets));
        values[r].push_back(std::move(chunk_values));
      }
      ASSERT_EQ(static_cast<std::int64_t>(sent_indices.size()), reference.indices.numel())
          << "fired count, rank " << r;
      const torch::Tensor our_indices = torch::from_blob(
          sent_indices.data(), {static_cast<std::int64_t>(sent_indices.size())}, torch::kInt64);
      ASSERT_TRUE(torch::equal(our_indices, reference.indices)) << "fired set, rank " << r;
      ASSERT_TRUE(
          same_bits(sent_values, reference.values, "sent values, rank " + std::to_string(r)));
      total_fired += sent_indices.size();
      reference_messages.push_back({reference.indices, reference.values});
      reference_residual[r] = reference.residual;
    }

    // Aggregate, commit, outer step and reset on every replica.
    const torch::Tensor reference_g =
        reference_aggregate(reference_messages, static_cast<std::int64_t>(n));
    reference_outer.step(reference_g);
    const OuterStepParams params{
        .lr = kOuterLr, .momentum = kOuterMomentum, .first_step = window == 0};
    for (std::size_t r = 0; r < ranks; ++r) {
      Replica& replica = replicas[r];
      std::vector<float> g(n);
      // Alternate between the separate and the fused end-of-window kernels.
      const bool fused = (window + static_cast<int>(r)) % 2 == 1;
      for (std::size_t c = 0; c < chunks.size(); ++c) {
        const ChunkRange& chunk = chunks[c];
        std::vector<SparseEntries> entries;
        for (std::size_t from = 0; from < ranks; ++from)
          entries.push_back(SparseEntries{offsets[from][c], values[from][c]});
        float* chunk_g = g.data() + chunk.begin;
        kernels::aggregate(entries, chunk_g, chunk.count, s.isa);
        void* chunk_local =
            static_cast<char*>(replica.local.data()) + chunk.begin * dtype_size(s.local_dtype);
        if (fused) {
          const kernels::WindowChunk window_chunk{.global = replica.global.data() + chunk.begin,
                                                  .momentum = replica.momentum.data() + chunk.begin,
                                                  .residual = replica.residual.data() + chunk.begin,
                                                  .local = chunk_local,
                                                  .local_dtype = s.local_dtype,
                                                  .count = chunk.count,
                                                  .bf16_delta = s.bf16_delta};
          kernels::commit_and_outer_step(window_chunk, chunk_g, params, s.isa);
        } else {
          const GateChunk gate_chunk{.global = replica.global.data() + chunk.begin,
                                     .local = chunk_local,
                                     .local_dtype = s.local_dtype,
                                     .residual = replica.residual.data() + chunk.begin,
                                     .count = chunk.count,
                                     .bf16_delta = s.bf16_delta};
          kernels::commit_residual(gate_chunk, replica.residual.data() + chunk.begin, s.isa);
          kernels::outer_step(replica.global.data() + chunk.begin,
                              replica.momentum.data() + chunk.begin, chunk_g, chunk_local,
                              s.local_dtype, chunk.count, params, s.isa);
        }
      }
      const std::string rank = ", replica " + std::to_string(r);
      ASSERT_TRUE(same_bits(g, reference_g, "aggregate" + rank));
      ASSERT_TRUE(same_bits(replica.residual, reference_residual[r], "residual" + rank));
      ASSERT_TRUE(same_bits(replica.momentum, reference_outer.momentum(), "momentum" + rank));
      ASSERT_TRUE(same_bits(replica.global, reference_outer.global().detach(), "global" + rank));
      reference_local[r] = s.local_dtype == DType::float32
                               ? reference_outer.global().detach().clone()
                               : reference_outer.global().detach().to(torch::kBFloat16);
      ASSERT_TRUE(same_bits(replica.local, reference_local[r], "reset local" + rank));
    }
  }
  if (n >= 1000) {
    // The scenario must exercise both outcomes of the gate.
    EXPECT_GT(total_fired, 0u);
    EXPECT_LT(total_fired,
              static_cast<std::uint64_t>(n) * ranks * static_cast<std::uint64_t>(s.windows));
  }
}

std::vector<CpuIsa> isas() {
  std::vector<CpuIsa> out{CpuIsa::portable};
  if (cpu_has_avx2()) out.push_back(CpuIsa::avx2);
  return out;
}

// The premise of step 8: PyTorch's add-with-alpha (a + alpha * b) rounds once, on vectorised
// bodies and scalar tails alike, whatever the thread count. If this fails (for instance with
// ATEN_CPU_CAPABILITY=default, whose kernels do not fuse), θ_g cannot match the reference.
TEST(TorchPremise, AddWithAlphaIsOneFusedMultiplyAdd) {
  FastRandom random(7);
  const int threads_before = at::get_num_threads();
  for (int threads : {1, 2}) {
    at::set_num_threads(threads);
    for (std::int64_t count : {1, 3, 7, 8, 9, 15, 17, 31, 33, 100, 32768 + 5, 100003}) {
      std::vector<float> a(static_cast<std::size_t>(count)), b(a.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        a[i] = random.normal();
        b[i] = random.normal();
      }
      const float alpha = 0.9f;
      const torch::Tensor sum = to_tensor(a).add(to_tensor(b), alpha);
      const float* result = sum.data_ptr<float>();
      for (std::size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(result[i]),
                  std::bit_cast<std::uint32_t>(std::fma(b[i], alpha, a[i])))
            << "element " << i << " of " << count << " with " << threads
            << " threads is not fused; libtorch: " << at::get_parallel_info();
      }
    }
  }
  at::set_num_threads(threads_before);
}

class KernelsVsTorch : public ::testing::TestWithParam<std::tuple<LocalKind, CpuIsa>> {};

TEST_P(KernelsVsTorch, SizesAndRanks) {
  const auto [kind, isa] = GetParam();
  for (int ranks = 1; ranks <= 8; ++ranks) {
    for (std::size_t count :
         {0u, 1u, 2u, 7u, 8u, 9u, 15u, 16u, 17u, 31u, 33u, 127u, 1000u, 4099u}) {
      Scenario s{.count = count,
                 .local_dtype = kind.dtype,
                 .bf16_delta = kind.bf16_delta,
                 .ranks = ranks,
                 .chunk = 1000,
                 .isa = isa,
                 .seed = 11u * count + static_cast<std::uint64_t>(ranks)};
      ASSERT_NO_FATAL_FAILURE(run_scenario(s));
    }
  }
}

TEST_P(KernelsVsTorch, ChunkSizes) {
  const auto [kind, isa] = GetParam();
  for (std::uint64_t chunk : {1u, 7u, 8u, 64u, 1021u, 8192u, 70000u}) {
    Scenario s{.count = 65537,
               .local_dtype = kind.dtype,
               .bf16_delta = kind.bf16_delta,
               .ranks = 3,
               .windows = 2,
               .chunk = chunk,
               .isa = isa,
               .seed = chunk};
    ASSERT_NO_FATAL_FAILURE(run_scenario(s));
  }
}

TEST_P(KernelsVsTorch, ManyWindowsWithoutEdgeCases) {
  const auto [kind, isa] = GetParam();
  Scenario s{.count = 50001,
             .local_dtype = kind.dtype,
             .bf16_delta = kind.bf16_delta,
             .ranks = 4,
             .windows = 6,
             .chunk = 4099,
             .isa = isa,
             .edge_cases = false,
             .seed = 99};
  ASSERT_NO_FATAL_FAILURE(run_scenario(s));
}

INSTANTIATE_TEST_SUITE_P(LocalKindsAndIsas, KernelsVsTorch,
                         ::testing::Combine(::testing::ValuesIn(local_kinds()),
                                            ::testing::ValuesIn(isas())),
                         [](const auto& param_info) {
                           return local_kind_name(std::get<0>(param_info.param)) + "_" +
                                  std::string(cpu_isa_name(std::get<1>(param_info.param)));
                         });

// Once per local kind, with the ISA the kernels use by default.
class KernelsVsTorchLarge : public ::testing::TestWithParam<LocalKind> {};

TEST_P(KernelsVsTorchLarge, TenMillionElements) {
  Scenario s{.count = 10'000'000,
             .local_dtype = GetParam().dtype,
             .bf16_delta = GetParam().bf16_delta,
             .ranks = 2,
             .windows = 2,
             .chunk = (1u << 20) + 3,
             .isa = active_cpu_isa(),
             .seed = 5};
  ASSERT_NO_FATAL_FAILURE(run_scenario(s));
}

INSTANTIATE_TEST_SUITE_P(LocalKinds, KernelsVsTorchLarge, ::testing::ValuesIn(local_kinds()),
                         [](const auto& param_info) { return local_kind_name(param_info.param); });

// A non-finite s: the gate reports the lowest offset (as the reference finds it), sends
// nothing and changes nothing; check_finite names the tensor, the index and the rank.
class NonFiniteVsTorch : public ::testing::TestWithParam<std::tuple<DType, CpuIsa>> {};

TEST_P(NonFiniteVsTorch, LowestOffsetIsReportedAndNothingChanges) {
  const auto [dtype, isa] = GetParam();
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Poison {
    const char* what;
    std::size_t index;
    int kind;  // 0: e = NaN, 1: e = inf, 2: θ_g = NaN, 3: θ_l = -inf, 4: overflow of e + Δ
  };
  for (const Poison& poison : {Poison{"NaN residual", 37, 0}, Poison{"infinite residual", 8, 1},
                               Poison{"NaN global", 1002, 2}, Poison{"infinite local", 5, 3},
                               Poison{"overflowing e + Δ", 4097, 4}}) {
    SCOPED_TRACE(poison.what);
    const std::size_t n = 5003;
    std::vector<float> global = make_global_weights(n, 3);
    LocalWeights local(dtype, n);
    cast_global_into(global, local);
    apply_inner_steps(local, dtype == DType::float32 ? 3e-6f : 3e-4f, 8, 4);
    std::vector<float> residual(n, 0.0f);
    // A second, later poisoned element: the lowest one must be reported.
    residual[poison.index + 600] = nan;
    switch (poison.kind) {
      case 0:
        residual[poison.index] = nan;
        break;
      case 1:
        residual[poison.index] = inf;
        break;
      case 2:
        global[poison.index] = nan;
        break;
      case 3:
        local.set(poison.index, -inf);
        break;
      case 4:
        global[poison.index] = 3.0e38f;
        local.set(poison.index, 0.0f);
        residual[poison.index] = 3.0e38f;
        break;
      default:
        break;
    }
    const ReferenceGate reference = reference_gate(to_tensor(global), to_tensor(local),
                                                   to_tensor(residual), kernels::Bf16Delta::exact);
    ASSERT_TRUE(reference.non_finite_index.has_value());
    ASSERT_EQ(*reference.non_finite_index, static_cast<std::int64_t>(poison.index));

    const std::vector<float> global_before = global, residual_before = residual;
    const LocalWeights local_before = local;
    for (std::uint64_t chunk_size : {std::uint64_t{n}, std::uint64_t{1000}}) {
      bool reported = false;
      for (const ChunkRange& chunk : chunks_of(n, chunk_size)) {
        std::vector<std::uint32_t> offsets(chunk.count);
        std::vector<float> values(chunk.count);
        const GateChunk gate_chunk{
            .global = global.data() + chunk.begin,
            .local = static_cast<const char*>(local.data()) + chunk.begin * dtype_size(dtype),
            .local_dtype = dtype,
            .residual = residual.data() + chunk.begin,
            .count = chunk.count};
        const GateResult result = kernels::gate(gate_chunk, offsets.data(), values.data(), isa);
        if (!result.non_finite_offset) continue;
        EXPECT_EQ(result.fired, 0u);
        EXPECT_EQ(chunk.begin + *result.non_finite_offset, poison.index);
        try {
          kernels::check_finite(result, "layers.3.mlp.weight", chunk.begin, 2);
          ADD_FAILURE() << "check_finite did not throw";
        } catch (const NonFiniteError& error) {
          EXPECT_EQ(error.context().tensor, "layers.3.mlp.weight");
          EXPECT_EQ(error.context().index, poison.index);
          EXPECT_EQ(error.context().rank, 2);
        }
        reported = true;
        break;  // the engine stops the window here
      }
      EXPECT_TRUE(reported);
    }
    EXPECT_EQ(std::memcmp(global.data(), global_before.data(), n * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(residual.data(), residual_before.data(), n * sizeof(float)), 0);
    EXPECT_TRUE(local == local_before);
  }
}

INSTANTIATE_TEST_SUITE_P(DtypesAndIsas, NonFiniteVsTorch,
                         ::testing::Combine(::testing::Values(DType::float32, DType::bfloat16),
                                            ::testing::ValuesIn(isas())),
                         [](const auto& param_info) {
                           return std::string(dtype_name(std::get<0>(param_info.param))) + "_" +
                                  std::string(cpu_isa_name(std::get<1>(param_info.param)));
                         });

}  // namespace
}  // namespace pulseloco::testing
