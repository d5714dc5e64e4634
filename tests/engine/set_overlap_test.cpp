// The report's overlap of the ranks' sets (union_entries, group_entries, union_ratio) against the
// sets counted from the messages the ranks traced, in blocking and overlapped windows, and the
// dense modes' fixed values.
#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <utility>

#include <pulseloco/codec/message.h>
#include <pulseloco/engine/report.h>
#include <pulseloco/engine/state_files.h>
#include "engine/engine_test_util.h"
#include "io/test_files.h"

namespace pulseloco {
namespace {

std::vector<std::byte> read_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  const std::vector<char> chars{std::istreambuf_iterator<char>(in), {}};
  std::vector<std::byte> bytes(chars.size());
  std::memcpy(bytes.data(), chars.data(), chars.size());
  return bytes;
}

// Counted from the traced messages of one window: the union of the ranks' (frame, offset)
// sets and the sum of their sizes.
std::pair<std::uint64_t, std::uint64_t> count_sets(const std::filesystem::path& trace_dir,
                                                   std::uint64_t window, int world) {
  std::set<std::pair<std::size_t, std::uint32_t>> all;
  std::uint64_t group = 0;
  for (int r = 0; r < world; ++r) {
    const std::vector<std::byte> bytes =
        read_bytes(state_files::trace_message_file(trace_dir, window, r));
    const codec::MessageView view = codec::MessageView::parse(bytes);
    codec::DecodeScratch scratch;
    for (std::size_t c = 0; c < view.frame_count(); ++c) {
      std::vector<std::uint32_t> offsets(view.frame(c).entries);
      std::vector<float> values(offsets.size());
      (void)view.decode_frame(c, offsets, values, scratch);
      for (const std::uint32_t offset : offsets)
        all.insert({c, offset});
      group += offsets.size();
    }
  }
  return {all.size(), group};
}

class SetOverlap : public ::testing::TestWithParam<Overlap> {};

TEST_P(SetOverlap, ReportCountsTheUnionOfTheRanksSets) {
  const Overlap overlap = GetParam();
  const int world = 3;
  io::test::TempDir trace;
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < world; ++r) {
    // Ranks 0 and 1 start alike and train alike (identical sets); rank 2 differs.
    models.push_back(testing::make_model({20000, 513}, DType::float32, r == 2 ? 401 : 400));
  }
  EngineOptions options;
  options.steps_per_window = 2;
  options.chunk_elements = 4096;
  options.threads = 1;
  options.overlap = overlap;
  options.trace_dir = trace.path().string();
  auto engines = testing::start_engines(models, options);
  bool checked = false;
  for (int window = 0; window < 3; ++window) {
    for (int r = 0; r < world; ++r) {
      testing::local_training(models[static_cast<std::size_t>(r)], 5e-5f, 2,
                              900 + 10 * window + (r == 2 ? 1 : 0));
    }
    std::vector<WindowReport> reports(world);
    testing::rethrow_first(testing::run_ranks(world, [&](int r) {
      reports[static_cast<std::size_t>(r)] = engines[static_cast<std::size_t>(r)]->run_window();
    }));
    for (const WindowReport& report : reports) {
      if (!report.applied_window) {
        EXPECT_EQ(report.union_entries, 0u);
        EXPECT_EQ(report.group_entries, 0u);
        EXPECT_EQ(report.union_ratio, 0.0);
        EXPECT_EQ(summary_line(report).find("union"), std::string::npos);
        continue;
      }
      const auto [union_entries, group_entries] =
          count_sets(trace.path(), *report.applied_window, world);
      EXPECT_EQ(report.union_entries, union_entries) << "rank " << report.rank;
      EXPECT_EQ(report.group_entries, group_entries) << "rank " << report.rank;
      EXPECT_DOUBLE_EQ(report.union_ratio,
                       static_cast<double>(union_entries) / static_cast<double>(group_entries));
      // Two identical sets and a third that differs: strictly between 1/3 and 2/3.
      EXPECT_GT(report.union_ratio, 1.0 / 3.0);
      EXPECT_LT(report.union_ratio, 2.0 / 3.0);
      EXPECT_NE(summary_line(report).find("union"), std::string::npos);
      checked = true;
    }
  }
  EXPECT_TRUE(checked);
}

INSTANTIATE_TEST_SUITE_P(Overlaps, SetOverlap,
                         ::testing::Values(Overlap::blocking, Overlap::delayed),
                         [](const ::testing::TestParamInfo<Overlap>& param) {
                           return std::string(overlap_name(param.param));
                         });

TEST(SetOverlapDense, DilocoSendsEveryElementFromEveryRank) {
  const int world = 2;
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < world; ++r) {
    models.push_back(testing::make_model({3000}, DType::float32, 7 + r));
  }
  EngineOptions options;
  options.mode = Mode::diloco;
  options.steps_per_window = 1;
  options.threads = 1;
  auto engines = testing::start_engines(models, options);
  std::vector<WindowReport> reports(world);
  testing::rethrow_first(testing::run_ranks(world, [&](int r) {
    reports[static_cast<std::size_t>(r)] = engines[static_cast<std::size_t>(r)]->run_window();
  }));
  for (const WindowReport& report : reports) {
    EXPECT_EQ(report.union_entries, 3000u);
    EXPECT_EQ(report.group_entries, 6000u);
    EXPECT_DOUBLE_EQ(report.union_ratio, 0.5);
  }
}

}  // namespace
}  // namespace pulseloco
