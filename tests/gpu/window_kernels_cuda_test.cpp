// The CUDA window kernels against the CPU kernels (which window_kernels_reference_test.cpp
// holds to the libtorch reference bit for bit): identical bits for every kernel, for fp32 and
// bf16 local weights with both definitions of Δ (kernels::Bf16Delta), over the size,
// rank and edge-case matrix, several windows, a whole window chained on a device stream without
// host round trips, non-finite reports, aggregate validation and digests. Skips without a GPU.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/kernels/cuda/window_kernels_cuda.h>
#include <pulseloco/kernels/window_kernels.h>
#include "gpu/cuda_backend.h"
#include "gpu/gpu_test_util.h"
#include "kernels/backend_comparison.h"
#include "kernels/window_test_inputs.h"

namespace pulseloco::testing {
namespace {

class CpuVsCuda : public ::testing::TestWithParam<LocalKind> {
 protected:
  void SetUp() override { PULSELOCO_SKIP_WITHOUT_GPU(); }
};

TEST_P(CpuVsCuda, SizesAndRanks) {
  CpuBackend cpu(active_cpu_isa());
  CudaBackend cuda;
  for (int ranks = 1; ranks <= 8; ++ranks) {
    for (std::size_t count :
         {0u, 1u, 7u, 8u, 9u, 31u, 33u, 255u, 256u, 257u, 1000u, 4099u, 65537u}) {
      const BackendScenario s{.count = count,
                              .local_dtype = GetParam().dtype,
                              .bf16_delta = GetParam().bf16_delta,
                              .ranks = ranks,
                              .chunk = 1000,
                              .seed = 5u * count + static_cast<std::uint64_t>(ranks)};
      ASSERT_NO_FATAL_FAILURE(compare_backends(cpu, cuda, s));
    }
  }
}

TEST_P(CpuVsCuda, ChunkSizesAndManyWindows) {
  CpuBackend cpu(active_cpu_isa());
  CudaBackend cuda;
  // The smallest chunks over fewer elements: the device runs a few launches per chunk.
  for (std::uint64_t chunk : {1u, 31u, 4096u, 65537u, 300000u}) {
    const BackendScenario s{.count = chunk < 4096 ? 2003u : 200003u,
                            .local_dtype = GetParam().dtype,
                            .bf16_delta = GetParam().bf16_delta,
                            .ranks = 3,
                            .windows = 2,
                            .chunk = chunk,
                            .seed = chunk};
    ASSERT_NO_FATAL_FAILURE(compare_backends(cpu, cuda, s));
  }
  const BackendScenario long_run{.count = 50001,
                                 .local_dtype = GetParam().dtype,
                                 .bf16_delta = GetParam().bf16_delta,
                                 .ranks = 4,
                                 .windows = 8,
                                 .chunk = 4099,
                                 .edge_cases = false,
                                 .seed = 9};
  ASSERT_NO_FATAL_FAILURE(compare_backends(cpu, cuda, long_run));
}

TEST_P(CpuVsCuda, TenMillionElements) {
  CpuBackend cpu(active_cpu_isa());
  CudaBackend cuda;
  const BackendScenario s{.count = 10'000'000,
                          .local_dtype = GetParam().dtype,
                          .bf16_delta = GetParam().bf16_delta,
                          .ranks = 2,
                          .windows = 2,
                          .chunk = (1u << 22) + 5,
                          .seed = 10};
  ASSERT_NO_FATAL_FAILURE(compare_backends(cpu, cuda, s));
}

// Arbitrary bit patterns, NaN and infinities included: the same gate result (the lowest
// non-finite offset when there is one) and the same committed residual.
TEST_P(CpuVsCuda, ArbitraryBitPatterns) {
  CpuBackend cpu(active_cpu_isa());
  CudaBackend cuda;
  const auto [dtype, bf16_delta] = GetParam();
  for (std::size_t n : {1u, 8u, 100u, 5000u, 70001u}) {
    for (bool finite : {true, false}) {
      const std::uint64_t seed = n * 13 + (finite ? 1 : 0);
      std::vector<float> global = arbitrary_values(n, seed, finite);
      std::vector<float> residual = arbitrary_values(n, seed + 1, finite);
      const std::vector<float> noise = arbitrary_values(n, seed + 2, finite);
      LocalWeights local(dtype, n);
      for (std::size_t i = 0; i < n; ++i) {
        local.set(i, i % 3 == 0 ? noise[i] : global[i] + 1e-4f * noise[i]);
        if (i % 2 == 0) residual[i] *= 1e-3f;
      }
      const kernels::GateChunk chunk{.global = global.data(),
                                     .local = local.data(),
                                     .local_dtype = dtype,
                                     .residual = residual.data(),
                                     .count = n,
                                     .bf16_delta = bf16_delta};
      std::vector<std::uint32_t> off_cpu, off_cuda;
      std::vector<float> val_cpu, val_cuda;
      const kernels::GateResult r_cpu = cpu.gate(chunk, off_cpu, val_cpu);
      const kernels::GateResult r_cuda = cuda.gate(chunk, off_cuda, val_cuda);
      ASSERT_EQ(r_cpu.non_finite_offset, r_cuda.non_finite_offset) << n;
      ASSERT_EQ(r_cpu.fired, r_cuda.fired) << n;
      ASSERT_EQ(off_cpu, off_cuda) << n;
      ASSERT_TRUE(same_floats(val_cpu, val_cuda, "values"));
      std::vector<float> e_cpu(n), e_cuda(n);
      cpu.commit_residual(chunk, e_cpu.data());
      cuda.commit_residual(chunk, e_cuda.data());
      ASSERT_TRUE(same_floats(e_cpu, e_cuda, "committed residual"));
      std::vector<float> d_cpu(n), d_cuda(n);
      cpu.pseudo_gradient(global.data(), local.data(), dtype, bf16_delta, d_cpu.data(), n);
      cuda.pseudo_gradient(global.data(), local.data(), dtype, bf16_delta, d_cuda.data(), n);
      // NaN payloads are not specified (x86 propagates an input's payload, NVIDIA GPUs return
      // the canonical NaN, and a valid window never computes one): every NaN equals every NaN,
      // every other value must have the same bits.
      for (std::size_t i = 0; i < n; ++i) {
        if (std::isnan(d_cpu[i]) && std::isnan(d_cuda[i])) continue;
        ASSERT_EQ(float_to_bits(d_cpu[i]), float_to_bits(d_cuda[i])) << "pseudo_gradient " << i;
      }
      if (!finite) {
        // A poisoned element early on: both report it.
        residual[n / 2] = std::numeric_limits<float>::quiet_NaN();
        ASSERT_EQ(cpu.gate(chunk, off_cpu, val_cpu).non_finite_offset,
                  cuda.gate(chunk, off_cuda, val_cuda).non_finite_offset);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(LocalKinds, CpuVsCuda, ::testing::ValuesIn(local_kinds()),
                         [](const auto& param_info) { return local_kind_name(param_info.param); });

// A whole window chained on one non-default stream, entirely on the device: the gate's device
// outputs feed the aggregate directly, then the fused commit + outer step; only the end result
// comes back. Chunks start at odd element offsets.
TEST(CudaWindow, ChainedOnAStreamMatchesTheCpu) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  constexpr std::size_t n = 300007;
  constexpr std::uint64_t kChunk = 65537;
  constexpr int kRanks = 3;
  for (const LocalKind& kind : local_kinds()) {
    SCOPED_TRACE(local_kind_name(kind));
    const auto [dtype, bf16_delta] = kind;
    CudaBackend cuda;  // for its stream and workspace
    const cudaStream_t stream = cuda.stream();
    std::vector<float> global = make_global_weights(n, 1);
    std::vector<LocalWeights> locals(kRanks, LocalWeights(dtype, n));
    std::vector<std::vector<float>> residuals(kRanks, std::vector<float>(n, 0.0f));
    for (int r = 0; r < kRanks; ++r) {
      cast_global_into(global, locals[r]);
      apply_inner_steps(locals[r], dtype == DType::float32 ? 3e-6f : 3e-4f, 8, 20 + r);
    }
    inject_edge_cases(global, locals, residuals);
    std::vector<float> momentum(n, 0.0f);
    const std::size_t local_size = dtype_size(dtype);

    // Device state of replica 0 and every rank's θ_l and e (to gate all ranks on the device).
    const DeviceBytes d_global = DeviceBytes::from_host(global.data(), n * 4, stream);
    const DeviceBytes d_momentum = DeviceBytes::from_host(momentum.data(), n * 4, stream);
    std::vector<DeviceBytes> d_local, d_residual, d_offsets, d_values;
    for (int r = 0; r < kRanks; ++r) {
      d_local.push_back(DeviceBytes::from_host(locals[r].data(), n * local_size, stream));
      d_residual.push_back(DeviceBytes::from_host(residuals[r].data(), n * 4, stream));
      d_offsets.emplace_back(n * 4);
      d_values.emplace_back(n * 4);
    }
    const DeviceBytes d_g(n * 4);

    // CPU: the same window, replica 0.
    std::vector<float> cpu_global = global, cpu_momentum = momentum;
    LocalWeights cpu_local = locals[0];
    std::vector<float> cpu_residual = residuals[0];
    const kernels::OuterStepParams params{.lr = 0.7f, .momentum = 0.9f, .first_step = true};

    for (std::uint64_t begin = 0; begin < n; begin += kChunk) {
      const std::uint64_t count = std::min<std::uint64_t>(kChunk, n - begin);
      std::vector<kernels::SparseEntries> device_entries;
      std::vector<std::vector<std::uint32_t>> cpu_offsets(kRanks);
      std::vector<std::vector<float>> cpu_values(kRanks);
      for (int r = 0; r < kRanks; ++r) {
        const kernels::GateChunk device_chunk{.global = d_global.get<float>() + begin,
                                              .local = d_local[r].get<char>() + begin * local_size,
                                              .local_dtype = dtype,
                                              .residual = d_residual[r].get<float>() + begin,
                                              .count = count,
                                              .bf16_delta = bf16_delta};
        const kernels::GateResult result =
            kernels::cuda::gate(device_chunk, d_offsets[r].get<std::uint32_t>() + begin,
                                d_values[r].get<float>() + begin, cuda.workspace(), stream);
        ASSERT_FALSE(result.non_finite_offset);
        device_entries.push_back({{d_offsets[r].get<std::uint32_t>() + begin, result.fired},
                                  {d_values[r].get<float>() + begin, result.fired}});

        cpu_offsets[r].resize(count);
        cpu_values[r].resize(count);
        const kernels::GateChunk cpu_chunk{
            .global = cpu_global.data() + begin,
            .local = static_cast<const char*>(locals[r].data()) + begin * local_size,
            .local_dtype = dtype,
            .residual = residuals[r].data() + begin,
            .count = count,
            .bf16_delta = bf16_delta};
        const kernels::GateResult cpu_result =
            kernels::gate(cpu_chunk, cpu_offsets[r].data(), cpu_values[r].data());
        ASSERT_EQ(cpu_result.fired, result.fired) << "rank " << r << ", chunk at " << begin;
        cpu_offsets[r].resize(cpu_result.fired);
        cpu_values[r].resize(cpu_result.fired);
      }
      kernels::cuda::aggregate(device_entries, d_g.get<float>() + begin, count, cuda.workspace(),
                               stream);
      kernels::cuda::commit_and_outer_step(
          kernels::WindowChunk{.global = d_global.get<float>() + begin,
                               .momentum = d_momentum.get<float>() + begin,
                               .residual = d_residual[0].get<float>() + begin,
                               .local = d_local[0].get<char>() + begin * local_size,
                               .local_dtype = dtype,
                               .count = count,
                               .bf16_delta = bf16_delta},
          d_g.get<float>() + begin, params, stream);

      std::vector<kernels::SparseEntries> cpu_entries;
      for (int r = 0; r < kRanks; ++r)
        cpu_entries.push_back({cpu_offsets[r], cpu_values[r]});
      std::vector<float> g(count);
      kernels::aggregate(cpu_entries, g.data(), count);
      kernels::commit_and_outer_step(
          kernels::WindowChunk{.global = cpu_global.data() + begin,
                               .momentum = cpu_momentum.data() + begin,
                               .residual = cpu_residual.data() + begin,
                               .local = static_cast<char*>(cpu_local.data()) + begin * local_size,
                               .local_dtype = dtype,
                               .count = count,
                               .bf16_delta = bf16_delta},
          g.data(), params);
    }
    std::vector<float> out_global(n), out_momentum(n), out_residual(n);
    LocalWeights out_local(dtype, n);
    d_global.to_host(out_global.data(), n * 4, stream);
    d_momentum.to_host(out_momentum.data(), n * 4, stream);
    d_residual[0].to_host(out_residual.data(), n * 4, stream);
    d_local[0].to_host(out_local.data(), n * local_size, stream);
    ASSERT_TRUE(same_floats(out_global, cpu_global, "global"));
    ASSERT_TRUE(same_floats(out_momentum, cpu_momentum, "momentum"));
    ASSERT_TRUE(same_floats(out_residual, cpu_residual, "residual"));
    ASSERT_TRUE(out_local == cpu_local);
    EXPECT_EQ(kernels::cuda::state_digest({d_global.get<float>(), n}, {d_momentum.get<float>(), n},
                                          cuda.workspace(), stream),
              kernels::state_digest(cpu_global, cpu_momentum));
  }
}

// A window's chunks gated into one packed output (one synchronisation) give each chunk the same
// entries as the chunk's own gate; an output too small is told apart by its total, and an
// output in mapped pinned host memory works as one on the device.
TEST(CudaPackedGate, MatchesTheChunkGate) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  constexpr std::size_t n = 300007;
  constexpr std::uint64_t kChunk = 65537;
  const std::size_t chunks = (n + kChunk - 1) / kChunk;
  for (const LocalKind& kind : local_kinds()) {
    SCOPED_TRACE(local_kind_name(kind));
    const auto [dtype, bf16_delta] = kind;
    CudaBackend cuda;
    const cudaStream_t stream = cuda.stream();
    std::vector<float> global = make_global_weights(n, 3);
    std::vector<LocalWeights> locals(1, LocalWeights(dtype, n));
    std::vector<std::vector<float>> residuals(1, std::vector<float>(n, 0.0f));
    cast_global_into(global, locals[0]);
    apply_inner_steps(locals[0], dtype == DType::float32 ? 3e-6f : 3e-4f, 8, 41);
    inject_edge_cases(global, locals, residuals);
    residuals[0][2 * kChunk + 17] = std::numeric_limits<float>::quiet_NaN();  // chunk 2 diverged
    const std::size_t local_size = dtype_size(dtype);
    const DeviceBytes d_global = DeviceBytes::from_host(global.data(), n * 4, stream);
    const DeviceBytes d_local = DeviceBytes::from_host(locals[0].data(), n * local_size, stream);
    const DeviceBytes d_residual = DeviceBytes::from_host(residuals[0].data(), n * 4, stream);
    const auto chunk_at = [&](std::size_t c) {
      const std::uint64_t begin = c * kChunk;
      return kernels::GateChunk{.global = d_global.get<float>() + begin,
                                .local = d_local.get<char>() + begin * local_size,
                                .local_dtype = dtype,
                                .residual = d_residual.get<float>() + begin,
                                .count = std::min<std::uint64_t>(kChunk, n - begin),
                                .bf16_delta = bf16_delta};
    };
    // Each chunk's own gate.
    const DeviceBytes d_offsets(kChunk * 4), d_values(kChunk * 4);
    std::vector<kernels::GateResult> expected(chunks);
    std::vector<std::vector<std::uint32_t>> expected_offsets(chunks);
    std::vector<std::vector<float>> expected_values(chunks);
    std::uint64_t expected_total = 0;
    for (std::size_t c = 0; c < chunks; ++c) {
      expected[c] = kernels::cuda::gate(chunk_at(c), d_offsets.get<std::uint32_t>(),
                                        d_values.get<float>(), cuda.workspace(), stream);
      expected_offsets[c].resize(expected[c].fired);
      expected_values[c].resize(expected[c].fired);
      d_offsets.to_host(expected_offsets[c].data(), expected[c].fired * 4, stream);
      d_values.to_host(expected_values[c].data(), expected[c].fired * 4, stream);
      expected_total += expected[c].fired;
    }
    ASSERT_TRUE(expected[2].non_finite_offset);
    ASSERT_GT(expected_total, 10u);

    const DeviceBytes d_cursor(sizeof(unsigned long long));
    const DeviceBytes d_slots(chunks * sizeof(kernels::cuda::GateSlot));
    std::uint32_t* mapped_offsets = nullptr;
    float* mapped_values = nullptr;
    const std::uint64_t room = expected_total + kChunk;
    PULSELOCO_CUDA_ASSERT(
        cudaHostAlloc(reinterpret_cast<void**>(&mapped_offsets), room * 4, cudaHostAllocMapped));
    PULSELOCO_CUDA_ASSERT(
        cudaHostAlloc(reinterpret_cast<void**>(&mapped_values), room * 4, cudaHostAllocMapped));
    // Too small (10 entries), then large enough (the diverged chunk's entries take room too).
    for (const std::uint64_t capacity : {std::uint64_t{10}, room}) {
      SCOPED_TRACE(capacity);
      kernels::cuda::PackedGateOutput out{.capacity = capacity,
                                          .cursor = d_cursor.get<unsigned long long>(),
                                          .slots = d_slots.get<kernels::cuda::GateSlot>()};
      PULSELOCO_CUDA_ASSERT(
          cudaHostGetDevicePointer(reinterpret_cast<void**>(&out.offsets), mapped_offsets, 0));
      PULSELOCO_CUDA_ASSERT(
          cudaHostGetDevicePointer(reinterpret_cast<void**>(&out.values), mapped_values, 0));
      kernels::cuda::begin_packed_gate(out, chunks, stream);
      for (std::size_t c = 0; c < chunks; ++c)
        kernels::cuda::enqueue_gate(chunk_at(c), c, out, cuda.workspace(), stream);
      std::vector<kernels::cuda::GateSlot> slots(chunks);
      d_slots.to_host(slots.data(), chunks * sizeof(kernels::cuda::GateSlot), stream);
      std::uint64_t total = 0;
      for (std::size_t c = 0; c < chunks; ++c) {
        SCOPED_TRACE(c);
        EXPECT_EQ(slots[c].first, total);
        if (expected[c].non_finite_offset) {
          // The chunk's finite elements may still fire; the caller discards them.
          EXPECT_EQ(slots[c].non_finite_min, *expected[c].non_finite_offset);
          total += static_cast<std::uint64_t>(slots[c].fired);
          continue;
        }
        EXPECT_EQ(slots[c].non_finite_min, ~0ull);
        ASSERT_EQ(static_cast<std::uint64_t>(slots[c].fired), expected[c].fired);
        for (std::uint64_t k = 0; k < expected[c].fired && total + k < capacity; ++k) {
          ASSERT_EQ(mapped_offsets[total + k], expected_offsets[c][k]) << "entry " << k;
          ASSERT_EQ(std::bit_cast<std::uint32_t>(mapped_values[total + k]),
                    std::bit_cast<std::uint32_t>(expected_values[c][k]))
              << "entry " << k;
        }
        total += static_cast<std::uint64_t>(slots[c].fired);
      }
      EXPECT_GE(total, expected_total);
    }
    cudaFreeHost(mapped_offsets);
    cudaFreeHost(mapped_values);
  }
}

// The aggregate enqueued without waiting gives the validating aggregate's bits; a bad entry
// writes nothing outside g and is recorded for the caller to read after synchronising.
TEST(CudaAggregate, EnqueuedMatchesTheValidatingOne) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  CudaBackend cuda;
  const cudaStream_t stream = cuda.stream();
  constexpr std::uint64_t count = 5000;
  std::vector<DeviceBytes> d_offsets, d_values;
  std::vector<kernels::SparseEntries> ranks;
  FastRandom random(9);
  for (int r = 0; r < 4; ++r) {
    std::vector<std::uint32_t> offsets;
    std::vector<float> values;
    for (std::uint32_t i = 0; i < count; ++i) {
      if (random.next() % 5 != 0) continue;
      offsets.push_back(i);
      values.push_back(static_cast<float>(static_cast<int>(random.next() % 2001) - 1000) * 1e-3f);
    }
    d_offsets.push_back(DeviceBytes::from_host(offsets.data(), offsets.size() * 4, stream));
    d_values.push_back(DeviceBytes::from_host(values.data(), values.size() * 4, stream));
    ranks.push_back({{d_offsets.back().get<std::uint32_t>(), offsets.size()},
                     {d_values.back().get<float>(), values.size()}});
  }
  const DeviceBytes d_expected(count * 4), d_g(count * 4);
  kernels::cuda::aggregate(ranks, d_expected.get<float>(), count, cuda.workspace(), stream);
  const unsigned long long none = ~0ull;
  const DeviceBytes d_bad = DeviceBytes::from_host(&none, sizeof none, stream);
  kernels::cuda::enqueue_aggregate(ranks, d_g.get<float>(), count, d_bad.get<unsigned long long>(),
                                   stream);
  std::vector<float> expected(count), g(count);
  d_expected.to_host(expected.data(), count * 4, stream);
  d_g.to_host(g.data(), count * 4, stream);
  EXPECT_TRUE(same_floats(g, expected, "aggregate"));
  unsigned long long bad = 0;
  d_bad.to_host(&bad, sizeof bad, stream);
  EXPECT_EQ(bad, ~0ull);

  // Rank 1's second entry is beyond the chunk: recorded, and g's neighbour stays as it was.
  const std::vector<std::uint32_t> good{1, 3}, beyond{2, 4};
  const std::vector<float> two{1.0f, 2.0f};
  const std::vector<float> sentinel(5, 7.0f);
  const DeviceBytes d_small = DeviceBytes::from_host(sentinel.data(), 20, stream);
  const DeviceBytes d_good = DeviceBytes::from_host(good.data(), 8, stream);
  const DeviceBytes d_beyond = DeviceBytes::from_host(beyond.data(), 8, stream);
  const DeviceBytes d_two = DeviceBytes::from_host(two.data(), 8, stream);
  const std::vector<kernels::SparseEntries> bad_ranks{
      {{d_good.get<std::uint32_t>(), 2}, {d_two.get<float>(), 2}},
      {{d_beyond.get<std::uint32_t>(), 2}, {d_two.get<float>(), 2}}};
  kernels::cuda::enqueue_aggregate(bad_ranks, d_small.get<float>(), 4,
                                   d_bad.get<unsigned long long>(), stream);
  d_bad.to_host(&bad, sizeof bad, stream);
  EXPECT_EQ(bad, (1ull << 32) | 1ull);
  std::vector<float> after(5);
  d_small.to_host(after.data(), 20, stream);
  EXPECT_EQ(after[4], 7.0f);
}

TEST(CudaAggregate, RejectsBadEntriesBeforeWriting) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  CudaBackend cuda;
  const std::vector<std::uint32_t> good{1, 3}, unsorted{3, 1}, repeated{2, 2}, beyond{1, 4};
  const std::vector<float> two{1.0f, 2.0f};
  struct Case {
    const std::vector<std::uint32_t>* second;
    std::uint64_t bad_index;
  };
  for (const Case& c : {Case{&unsorted, 1}, Case{&repeated, 1}, Case{&beyond, 1}}) {
    std::vector<float> g(4, 7.0f);
    const std::vector<kernels::SparseEntries> ranks{{good, two}, {good, two}, {*c.second, two}};
    try {
      cuda.aggregate(ranks, g.data(), 4);
      ADD_FAILURE() << "no exception";
    } catch (const InvalidArgument& error) {
      EXPECT_EQ(error.context().peer, 2);
      EXPECT_EQ(error.context().index, c.bad_index);
    }
  }
  // The device buffer was not touched: check on the device itself.
  const DeviceBytes d_g =
      DeviceBytes::from_host(std::vector<float>(4, 7.0f).data(), 16, cuda.stream());
  const DeviceBytes d_off = DeviceBytes::from_host(beyond.data(), 8, cuda.stream());
  const DeviceBytes d_val = DeviceBytes::from_host(two.data(), 8, cuda.stream());
  const std::vector<kernels::SparseEntries> device_ranks{
      {{d_off.get<std::uint32_t>(), 2}, {d_val.get<float>(), 2}}};
  EXPECT_THROW(
      kernels::cuda::aggregate(device_ranks, d_g.get<float>(), 4, cuda.workspace(), cuda.stream()),
      InvalidArgument);
  std::vector<float> after(4);
  d_g.to_host(after.data(), 16, cuda.stream());
  EXPECT_EQ(after, std::vector<float>(4, 7.0f));
  const std::vector<kernels::SparseEntries> none;
  EXPECT_THROW(kernels::cuda::aggregate(none, d_g.get<float>(), 4, cuda.workspace(), cuda.stream()),
               InvalidArgument);
}

// Every length class of xxh3 for the single piece and for the last piece of a longer buffer
// (short paths, within and across 1 KiB blocks), pieces in more than one device batch, and a
// buffer that does not start on an 8-byte boundary.
TEST(CudaDigest, MatchesTheHostDigestOfTheSameBytes) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  CudaBackend cuda;
  constexpr std::size_t kPiece = kBufferDigestPieceBytes;
  const std::size_t batch = 256 * kPiece;  // kernels/cuda/cuda_internal.h kDigestBatchPieces
  const std::size_t sizes[] = {0,
                               1,
                               3,
                               13,
                               16,
                               17,
                               128,
                               129,
                               240,
                               241,
                               1023,
                               1024,
                               1025,
                               1 << 20,
                               kPiece - 1,
                               kPiece,
                               kPiece + 7,
                               kPiece + 240,
                               kPiece + 241,
                               kPiece + 1025,
                               5 * kPiece + 4093,
                               batch + kPiece + 77};
  for (const std::size_t bytes : sizes) {
    std::vector<std::byte> host(bytes + 3);
    FastRandom random(bytes);
    for (std::byte& b : host)
      b = static_cast<std::byte>(random.next());
    const DeviceBytes device = DeviceBytes::from_host(host.data(), host.size(), cuda.stream());
    for (const std::size_t offset : {std::size_t{0}, std::size_t{3}}) {
      const std::span<const std::byte> expected(host.data() + offset, bytes);
      EXPECT_EQ(kernels::cuda::buffer_digest(device.get<std::byte>() + offset, bytes,
                                             cuda.workspace(), cuda.stream()),
                buffer_digest(expected))
          << bytes << " bytes at offset " << offset;
    }
  }
}

// Several buffers hashed before one synchronisation give each buffer's own digest, empty ones
// included.
TEST(CudaDigest, BuffersTogetherMatchOneByOne) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  CudaBackend cuda;
  const std::size_t sizes[] = {0,    13, kBufferDigestPieceBytes + 5,
                               1025, 0,  300 * kBufferDigestPieceBytes + 3};
  std::vector<DeviceBytes> device;
  std::vector<kernels::cuda::DeviceRange> ranges;
  std::vector<Digest> expected;
  for (const std::size_t bytes : sizes) {
    std::vector<std::byte> host(bytes);
    FastRandom random(bytes + 1);
    for (std::byte& b : host)
      b = static_cast<std::byte>(random.next());
    device.push_back(DeviceBytes::from_host(host.data(), bytes, cuda.stream()));
    ranges.push_back({device.back().get<std::byte>(), bytes});
    expected.push_back(buffer_digest(host));
  }
  EXPECT_EQ(kernels::cuda::buffer_digests(ranges, cuda.workspace(), cuda.stream()), expected);
}

TEST(CudaDigest, StateDigestMatchesTheCpu) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  CudaBackend cuda;
  for (const std::size_t count : {std::size_t{1}, std::size_t{1000}, (std::size_t{3} << 20) + 5}) {
    std::vector<float> global(count);
    std::vector<float> momentum(count);
    FastRandom random(count);
    for (std::size_t i = 0; i < count; ++i) {
      global[i] = static_cast<float>(random.next() % 1000) * 0.001f;
      momentum[i] = static_cast<float>(random.next() % 1000) * -0.002f;
    }
    const DeviceBytes d_global =
        DeviceBytes::from_host(global.data(), count * sizeof(float), cuda.stream());
    const DeviceBytes d_momentum =
        DeviceBytes::from_host(momentum.data(), count * sizeof(float), cuda.stream());
    EXPECT_EQ(kernels::cuda::state_digest(std::span(d_global.get<const float>(), count),
                                          std::span(d_momentum.get<const float>(), count),
                                          cuda.workspace(), cuda.stream()),
              kernels::state_digest(global, momentum))
        << count;
  }
}

TEST(CudaFirstNonFinite, FindsTheLowestNonFiniteIndex) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  CudaBackend cuda;
  const std::size_t n = (std::size_t{1} << 20) + 3;  // more than one grid-stride pass per lane
  std::vector<float> host(n, 1.0f);
  const auto lowest = [&] {
    const DeviceBytes device =
        DeviceBytes::from_host(host.data(), n * sizeof(float), cuda.stream());
    return kernels::cuda::first_non_finite(device.get<float>(), n, cuda.workspace(), cuda.stream());
  };
  EXPECT_EQ(lowest(), std::nullopt);
  host[n - 1] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(lowest(), n - 1);
  host[700'001] = std::numeric_limits<float>::quiet_NaN();
  host[12] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(lowest(), 12u);
  EXPECT_EQ(kernels::cuda::first_non_finite(nullptr, 0, cuda.workspace(), cuda.stream()),
            std::nullopt);
}

TEST(CudaArguments, AreChecked) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  kernels::cuda::DeviceWorkspace workspace;
  const kernels::GateChunk too_big{.count = kernels::kMaxChunkElements + 1};
  EXPECT_THROW((void)kernels::cuda::gate(too_big, nullptr, nullptr, workspace, nullptr),
               InvalidArgument);
  const kernels::GateChunk empty{};
  EXPECT_EQ(kernels::cuda::gate(empty, nullptr, nullptr, workspace, nullptr).fired, 0u);
  EXPECT_THROW(kernels::cuda::divide(nullptr, 5, 2.0f, nullptr), InvalidArgument);
  EXPECT_THROW(kernels::cuda::DeviceWorkspace(kernels::kMaxChunkElements + 1), InvalidArgument);
}

}  // namespace
}  // namespace pulseloco::testing
