// The backend comparison harness on the CPU: portable vs AVX2 over whole windows. (The same
// harness compares the CPU with CUDA in tests/gpu/window_kernels_cuda_test.cpp.)
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "kernels/backend_comparison.h"
#include "kernels/kernel_backend.h"

namespace pulseloco::testing {
namespace {

class PortableVsAvx2 : public ::testing::TestWithParam<LocalKind> {
 protected:
  void SetUp() override {
    if (!cpu_has_avx2()) GTEST_SKIP() << "this CPU has no AVX2: only the portable path exists";
  }
  CpuBackend portable_{CpuIsa::portable};
  CpuBackend avx2_{CpuIsa::avx2};
};

TEST_P(PortableVsAvx2, SizesAndRanks) {
  for (int ranks = 1; ranks <= 8; ++ranks) {
    for (std::size_t count : {0u, 1u, 7u, 8u, 9u, 33u, 1000u, 4099u}) {
      const BackendScenario s{.count = count,
                              .local_dtype = GetParam().dtype,
                              .bf16_delta = GetParam().bf16_delta,
                              .ranks = ranks,
                              .seed = 3u * count + static_cast<std::uint64_t>(ranks)};
      ASSERT_NO_FATAL_FAILURE(compare_backends(portable_, avx2_, s));
    }
  }
}

TEST_P(PortableVsAvx2, LargeChunks) {
  const BackendScenario s{.count = (1u << 20) + 3,
                          .local_dtype = GetParam().dtype,
                          .bf16_delta = GetParam().bf16_delta,
                          .ranks = 2,
                          .windows = 2,
                          .chunk = 65537,
                          .seed = 42};
  ASSERT_NO_FATAL_FAILURE(compare_backends(portable_, avx2_, s));
}

// The harness must notice a difference: a backend that rounds the outer step differently.
class OffByOneUlpOuterStep final : public KernelBackend {
 public:
  explicit OffByOneUlpOuterStep(KernelBackend& inner) : inner_(inner) {}
  std::string name() const override { return "broken"; }
  kernels::GateResult gate(const kernels::GateChunk& c, std::vector<std::uint32_t>& o,
                           std::vector<float>& v) override {
    return inner_.gate(c, o, v);
  }
  void commit_residual(const kernels::GateChunk& c, float* e) override {
    inner_.commit_residual(c, e);
  }
  void aggregate(std::span<const kernels::SparseEntries> r, float* g, std::uint64_t n) override {
    inner_.aggregate(r, g, n);
  }
  void outer_step(float* global, float* m, const float* g, void* l, DType d, std::uint64_t n,
                  const kernels::OuterStepParams& p) override {
    inner_.outer_step(global, m, g, l, d, n, p);
    if (n > 0) global[n - 1] = std::nextafter(global[n - 1], 1e30f);
  }
  void commit_and_outer_step(const kernels::WindowChunk& c, const float* g,
                             const kernels::OuterStepParams& p) override {
    inner_.commit_and_outer_step(c, g, p);
    if (c.count > 0) c.global[c.count - 1] = std::nextafter(c.global[c.count - 1], 1e30f);
  }
  void reset_local(const float* g, void* l, DType d, std::uint64_t n) override {
    inner_.reset_local(g, l, d, n);
  }
  void pseudo_gradient(const float* g, const void* l, DType d, kernels::Bf16Delta b, float* o,
                       std::uint64_t n) override {
    inner_.pseudo_gradient(g, l, d, b, o, n);
  }
  void divide(float* v, std::uint64_t n, float d) override { inner_.divide(v, n, d); }
  Digest state_digest(std::span<const float> g, std::span<const float> m) override {
    return inner_.state_digest(g, m);
  }

 private:
  KernelBackend& inner_;
};

TEST(BackendComparison, DetectsASingleUlp) {
  CpuBackend cpu(CpuIsa::portable);
  OffByOneUlpOuterStep broken(cpu);
  const BackendScenario s{.count = 100, .ranks = 2, .windows = 2};
  ::testing::TestPartResultArray failures;
  {
    const ::testing::ScopedFakeTestPartResultReporter intercept(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &failures);
    compare_backends(cpu, broken, s);
  }
  ASSERT_EQ(failures.size(), 1);
  EXPECT_TRUE(failures.GetTestPartResult(0).fatally_failed());
  EXPECT_NE(std::string(failures.GetTestPartResult(0).message()).find("global, replica 0"),
            std::string::npos)
      << failures.GetTestPartResult(0).message();
}

INSTANTIATE_TEST_SUITE_P(LocalKinds, PortableVsAvx2, ::testing::ValuesIn(local_kinds()),
                         [](const auto& param_info) { return local_kind_name(param_info.param); });

}  // namespace
}  // namespace pulseloco::testing
