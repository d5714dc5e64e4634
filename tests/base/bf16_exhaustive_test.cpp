// Every one of the 2^32 fp32 bit patterns, converted by pulseloco and by libtorch.
//
// - Against c10::BFloat16 (libtorch's scalar conversion): identical bits for all 2^32 inputs,
//   NaN included (both give the canonical 0x7FC0).
// - Against libtorch's tensor cast (Tensor::to(kBFloat16), vectorised in libtorch): identical
//   bits for every non-NaN input; for NaN inputs both sides must produce a NaN (libtorch's
//   vectorised cast gives 0xFFFF there, see base/bf16.h).
// Both of pulseloco's implementations (portable and, when the CPU has it, AVX2) are checked.
#include <c10/util/BFloat16.h>
#include <gtest/gtest.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/cpu_features.h>

namespace pulseloco {
namespace {

constexpr std::uint64_t kAll = std::uint64_t{1} << 32;
constexpr std::uint64_t kChunk = std::uint64_t{1} << 22;

bool is_bf16_nan(std::uint16_t bits) {
  return (bits & 0x7FFF) > 0x7F80;
}

struct Mismatches {
  std::atomic<std::uint64_t> scalar{0}, portable{0}, avx2{0}, tensor{0};
  std::atomic<std::uint32_t> first_bad_input{0};
};

void check_range(std::uint64_t begin, std::uint64_t end, Mismatches& bad) {
  std::vector<float> src(kChunk);
  std::vector<std::uint16_t> ours(kChunk), portable(kChunk), avx2(kChunk);
  const bool have_avx2 = cpu_has_avx2();
  auto note = [&](std::atomic<std::uint64_t>& counter, std::uint32_t input) {
    if (counter.fetch_add(1) == 0) bad.first_bad_input.store(input);
  };
  for (std::uint64_t base = begin; base < end; base += kChunk) {
    for (std::uint64_t i = 0; i < kChunk; ++i) {
      src[i] = bits_to_float(static_cast<std::uint32_t>(base + i));
    }
    for (std::uint64_t i = 0; i < kChunk; ++i) {
      ours[i] = float_to_bf16_bits(src[i]);
      if (ours[i] != c10::BFloat16(src[i]).x)
        note(bad.scalar, static_cast<std::uint32_t>(base + i));
    }
    bf16_impl::float_to_bf16_portable(src.data(), portable.data(), kChunk);
    if (have_avx2) bf16_impl::float_to_bf16_avx2(src.data(), avx2.data(), kChunk);

    const torch::Tensor cast =
        torch::from_blob(src.data(), {static_cast<std::int64_t>(kChunk)}, torch::kFloat32)
            .to(torch::kBFloat16);
    const auto* theirs = reinterpret_cast<const std::uint16_t*>(cast.data_ptr());
    for (std::uint64_t i = 0; i < kChunk; ++i) {
      const auto input = static_cast<std::uint32_t>(base + i);
      if (portable[i] != ours[i]) note(bad.portable, input);
      if (have_avx2 && avx2[i] != ours[i]) note(bad.avx2, input);
      const bool nan_input = std::isnan(src[i]);
      const bool agree =
          nan_input ? (is_bf16_nan(theirs[i]) && is_bf16_nan(ours[i])) : theirs[i] == ours[i];
      if (!agree) note(bad.tensor, input);
    }
  }
}

TEST(Bf16Exhaustive, AllFp32BitPatternsMatchLibtorch) {
  at::set_num_threads(1);  // we parallelise across ranges ourselves
  // A power of two, so every thread's range is a whole number of chunks.
  const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
  const unsigned threads = hardware >= 4 ? 4 : (hardware >= 2 ? 2 : 1);
  Mismatches bad;
  std::vector<std::thread> pool;
  const std::uint64_t per_thread = kAll / threads;
  for (unsigned t = 0; t < threads; ++t) {
    const std::uint64_t begin = t * per_thread;
    const std::uint64_t end = (t + 1 == threads) ? kAll : begin + per_thread;
    pool.emplace_back([&, begin, end] { check_range(begin, end, bad); });
  }
  for (auto& thread : pool)
    thread.join();

  EXPECT_EQ(bad.scalar.load(), 0u)
      << "vs c10::BFloat16; first input 0x" << std::hex << bad.first_bad_input.load();
  EXPECT_EQ(bad.portable.load(), 0u)
      << "portable vector path; first input 0x" << std::hex << bad.first_bad_input.load();
  EXPECT_EQ(bad.avx2.load(), 0u) << "AVX2 path; first input 0x" << std::hex
                                 << bad.first_bad_input.load();
  EXPECT_EQ(bad.tensor.load(), 0u)
      << "vs Tensor::to(kBFloat16); first input 0x" << std::hex << bad.first_bad_input.load();
  if (!cpu_has_avx2()) GTEST_LOG_(INFO) << "CPU lacks AVX2: only the portable path was checked";
}

}  // namespace
}  // namespace pulseloco
