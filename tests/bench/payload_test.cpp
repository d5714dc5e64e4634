// The payload benchmark: Qwen2.5 shapes against the published sizes, the streaming generator's
// exactness claims (chunking and threading do not change any message), and the benchmark
// binary's byte formulas on a tiny model.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "payload_generator.h"
#include "qwen_shapes.h"

namespace pulseloco::bench {
namespace {

TEST(QwenShapes, TotalsMatchThePublishedSizes) {
  // Exact totals of Qwen2ForCausalLM at these configs (embeddings counted once when tied).
  const std::array<std::uint64_t, 4> expected = {494'032'768, 1'543'714'304, 3'085'938'688,
                                                 7'615'616'512};
  const auto& configs = qwen25_configs();
  ASSERT_EQ(configs.size(), expected.size());
  for (std::size_t i = 0; i < configs.size(); ++i) {
    const std::uint64_t total = total_parameters(qwen2_tensors(configs[i]));
    EXPECT_EQ(total, expected[i]) << configs[i].name;
    // The model cards round to 0.01e9.
    EXPECT_NEAR(static_cast<double>(total), static_cast<double>(configs[i].published_parameters),
                0.006e9)
        << configs[i].name;
  }
}

TEST(QwenShapes, LayerTensorsHaveQwen2Shapes) {
  const auto tensors = qwen2_tensors(qwen25_config("7B"));
  // embed + 28 layers x 12 + norm + untied lm_head.
  ASSERT_EQ(tensors.size(), 1u + 28u * 12u + 1u + 1u);
  EXPECT_EQ(tensors[0].shape, (std::vector<std::uint64_t>{152064, 3584}));
  EXPECT_EQ(tensors[3].name, "model.layers.0.self_attn.k_proj.weight");
  EXPECT_EQ(tensors[3].shape, (std::vector<std::uint64_t>{512, 3584}));  // 4 kv heads x 128
  EXPECT_EQ(tensors[4].shape, (std::vector<std::uint64_t>{512}));
  EXPECT_EQ(tensors.back().name, "lm_head.weight");
  EXPECT_EQ(qwen2_tensors(qwen25_config("0.5B")).back().name, "model.norm.weight");  // tied
  EXPECT_THROW((void)qwen25_config("13B"), std::invalid_argument);
}

GeneratorConfig tiny_config() {
  GeneratorConfig config;
  config.tensors = {{"embed", {500, 64}, TensorKind::embedding},
                    {"q", {64, 64}, TensorKind::matrix},
                    {"q.bias", {64}, TensorKind::bias},
                    {"up", {160, 64}, TensorKind::matrix},
                    {"norm", {64}, TensorKind::norm}};
  config.workers = 2;
  config.windows = 3;
  config.inner_steps = 4;
  config.lr = 2e-5f;  // dense enough that every window has many entries
  config.chunk_elements = 4096;
  config.threads = 1;
  return config;
}

void expect_same_entries(const GeneratorResult& a, const GeneratorResult& b, bool same_bytes) {
  ASSERT_EQ(a.messages.size(), b.messages.size());
  for (std::size_t w = 0; w < a.messages.size(); ++w) {
    ASSERT_EQ(a.messages[w].size(), b.messages[w].size());
    for (std::size_t r = 0; r < a.messages[w].size(); ++r) {
      EXPECT_EQ(a.messages[w][r].entries, b.messages[w][r].entries) << "window " << w;
      if (same_bytes) {
        EXPECT_EQ(a.messages[w][r].ours_bytes, b.messages[w][r].ours_bytes);
      }
    }
  }
}

TEST(PayloadGenerator, MessagesDoNotDependOnThreadsOrChunking) {
  const GeneratorConfig config = tiny_config();
  const GeneratorResult one = run_generator(config);
  EXPECT_TRUE(one.decode_verified);
  std::uint64_t parameters = 0;
  for (const auto& t : config.tensors)
    parameters += t.numel();
  EXPECT_EQ(one.parameters, parameters);
  for (const auto& window : one.messages) {
    for (const WorkerMessage& m : window) {
      EXPECT_GT(m.entries, 0u);
      EXPECT_LT(m.entries, parameters);
      // Every chunk has a frame (32 B prefix + 8 B checksum at least) after the header.
      EXPECT_GE(m.ours_bytes, one.header_bytes + 40 * m.frames);
    }
  }
  // The two workers see different gradient noise, so their messages differ.
  EXPECT_NE(one.messages[0][0].entries, one.messages[0][1].entries);

  GeneratorConfig threaded = config;
  threaded.threads = 2;
  expect_same_entries(one, run_generator(threaded), true);

  // Everything is element-wise: other chunk boundaries change the frames, not the entries.
  GeneratorConfig rechunked = config;
  rechunked.chunk_elements = 1024;
  const GeneratorResult small_chunks = run_generator(rechunked);
  expect_same_entries(one, small_chunks, false);
  EXPECT_GT(small_chunks.messages[0][0].frames, one.messages[0][0].frames);
}

TEST(PayloadGenerator, ResidualCarriesMassIntoLaterWindows) {
  GeneratorConfig config = tiny_config();
  config.lr = 1e-6f;
  const GeneratorResult result = run_generator(config);
  // Error feedback: elements held back in window 0 fire later, so density does not fall.
  EXPECT_GE(result.messages[2][0].entries, result.messages[0][0].entries);
}

TEST(PayloadGenerator, RejectsBadConfigurations) {
  GeneratorConfig config = tiny_config();
  config.workers = 0;
  EXPECT_THROW((void)run_generator(config), std::invalid_argument);
  config = tiny_config();
  config.chunk_elements = 10;
  EXPECT_THROW((void)run_generator(config), std::invalid_argument);
  config = tiny_config();
  config.tensors.clear();
  EXPECT_THROW((void)run_generator(config), std::invalid_argument);
}

std::vector<nlohmann::json> run_benchmark(const std::string& arguments) {
  const std::string command = std::string(PULSELOCO_BENCH_PAYLOAD) + " " + arguments;
  const std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(command.c_str(), "r"), pclose);
  if (!pipe) throw std::runtime_error("cannot run " + command);
  std::vector<nlohmann::json> records;
  std::string line;
  std::array<char, 65536> buffer{};
  while (std::fgets(buffer.data(), buffer.size(), pipe.get()) != nullptr) {
    line += buffer.data();
    if (!line.empty() && line.back() == '\n') {
      records.push_back(nlohmann::json::parse(line));
      line.clear();
    }
  }
  return records;
}

TEST(PayloadBenchmark, ReportsTheFiveFormatsWithTheirFormulas) {
  const auto records = run_benchmark(
      "--qwen tiny --workers 2 --windows 2 -H 4 --lr 2e-5 --threads 1 --json "
      "--min-ratio 0");
  ASSERT_EQ(records.size(), 3u);  // two windows and the summary
  for (std::size_t i = 0; i < 2; ++i) {
    const auto& r = records[i];
    ASSERT_EQ(r["benchmark"], "payload");
    EXPECT_EQ(r["window"], i);
    const double p = r["parameters"].get<double>();
    const auto& bytes = r["bytes"];
    EXPECT_EQ(bytes["ddp"].get<double>(), 4 * 4.0 * p);
    EXPECT_EQ(bytes["diloco"].get<double>(), 4.0 * p);
    const auto& ranks = r["ranks"];
    ASSERT_EQ(ranks.size(), 2u);
    const double n0 = ranks[0]["entries"].get<double>();
    const double n1 = ranks[1]["entries"].get<double>();
    EXPECT_GT(n0, 0);
    EXPECT_EQ(r["entries"].get<double>(), (n0 + n1) / 2);
    EXPECT_EQ(bytes["authors_12B"].get<double>(), 12 * (n0 + n1) / 2);
    EXPECT_EQ(bytes["authors_12B_padded"].get<double>(), 12 * std::max(n0, n1));
    EXPECT_EQ(bytes["int32_fp32"].get<double>(), 8 * (n0 + n1) / 2);
    const double ours =
        (ranks[0]["ours_bytes"].get<double>() + ranks[1]["ours_bytes"].get<double>()) / 2;
    EXPECT_EQ(bytes["ours"].get<double>(), ours);
    EXPECT_NEAR(r["bytes_per_entry"]["ours"].get<double>(), ours / ((n0 + n1) / 2), 1e-9);
    EXPECT_TRUE(r["decode_verified"].get<bool>());
  }
  EXPECT_EQ(records[2]["benchmark"], "payload-summary");
}

TEST(PayloadBenchmark, FailsWhenTheRatioTargetIsMissed) {
  // No codec is 1000x smaller than 12 bytes per entry: the benchmark must say so and fail.
  const int status =
      std::system((std::string(PULSELOCO_BENCH_PAYLOAD) +
                   " --qwen tiny -H 2 --threads 1 --json --min-ratio 1000 > /dev/null 2>&1")
                      .c_str());
  EXPECT_NE(status, 0);
}

}  // namespace
}  // namespace pulseloco::bench
