// EngineOptions: validation, the canonical JSON (checkpoints and traces store it), the digest
// of the options every rank must share, and pipeline_chunk_bytes reaching the collectives.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/options.h>
#include "engine/engine_test_util.h"

namespace pulseloco {
namespace {

using testing::LocalModel;

std::string validation_error(const EngineOptions& options) {
  try {
    options.validate();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(EngineOptions, TheDefaultsAreValid) {
  EXPECT_NO_THROW(EngineOptions{}.validate());
}

TEST(EngineOptions, PipelineChunkBytesOutOfRangeIsRefusedByName) {
  for (const std::uint64_t bytes :
       {std::uint64_t{0}, std::uint64_t{4095}, (std::uint64_t{1} << 30) + 1}) {
    EngineOptions options;
    options.pipeline_chunk_bytes = bytes;
    EXPECT_NE(validation_error(options).find("pipeline_chunk_bytes"), std::string::npos) << bytes;
  }
  for (const std::uint64_t bytes : {std::uint64_t{4096}, std::uint64_t{1} << 30}) {
    EngineOptions options;
    options.pipeline_chunk_bytes = bytes;
    EXPECT_EQ(validation_error(options), "") << bytes;
  }
}

TEST(EngineOptions, JsonRoundTripKeepsEveryOption) {
  EngineOptions options;
  options.mode = Mode::diloco;
  options.steps_per_window = 5;
  options.outer_lr = 0.65f;
  options.outer_momentum = 0.85f;
  options.chunk_elements = 4096;
  options.bucket_elements = 8192;
  options.threads = 3;
  options.codec.encoding = codec::Encoding::plain_i32_f32;
  options.codec.zstd_level = 3;
  options.timeout = std::chrono::milliseconds(1234);
  options.allgather = collectives::CollectiveAlgorithm::ring;
  options.pipeline_chunk_bytes = 262144;
  options.verify_digests = false;
  options.trace_dir = "/tmp/traces";
  options.bf16_delta = kernels::Bf16Delta::authors;
  const EngineOptions back = options_from_json(to_json(options));
  EXPECT_EQ(to_json(back), to_json(options));
  EXPECT_EQ(back.pipeline_chunk_bytes, 262144u);
  EXPECT_EQ(back.bf16_delta, kernels::Bf16Delta::authors);
}

TEST(EngineOptions, JsonWithoutBf16DeltaLoadsAsExact) {
  // Checkpoints and traces written before the option existed computed Δ as `exact` does.
  nlohmann::json older = to_json(EngineOptions{});
  EXPECT_EQ(older.at("bf16_delta"), "exact");
  older.erase("bf16_delta");
  EXPECT_EQ(options_from_json(older).bf16_delta, kernels::Bf16Delta::exact);
}

TEST(EngineOptions, Bf16DeltaIsValidatedSharedAndPartOfTheState) {
  nlohmann::json json = to_json(EngineOptions{});
  json["bf16_delta"] = "author";
  EXPECT_THROW((void)options_from_json(json), InvalidArgument);
  EngineOptions invalid;
  invalid.bf16_delta = static_cast<kernels::Bf16Delta>(9);
  EXPECT_NE(validation_error(invalid).find("bf16_delta"), std::string::npos);

  const EngineOptions exact;
  EngineOptions authors;
  authors.bf16_delta = kernels::Bf16Delta::authors;
  EXPECT_NE(shared_options_digest(authors), shared_options_digest(exact));
  EXPECT_EQ(options_that_change_the_state(exact, authors), std::vector<std::string>{"bf16_delta"});
}

TEST(EngineOptions, OverlapIsValidatedSharedAndPartOfTheState) {
  for (const Overlap overlap : {Overlap::blocking, Overlap::delayed, Overlap::eager}) {
    EXPECT_EQ(parse_overlap(overlap_name(overlap)), overlap);
    EngineOptions options;
    options.overlap = overlap;
    EXPECT_EQ(options_from_json(to_json(options)).overlap, overlap);
  }
  try {
    (void)parse_overlap("async");
    ADD_FAILURE() << "accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'async'"), std::string::npos) << e.what();
  }
  // Overlapped windows are PULSELoCo windows.
  for (const Mode mode : {Mode::diloco, Mode::ddp}) {
    EngineOptions dense;
    dense.mode = mode;
    dense.overlap = Overlap::eager;
    const std::string error = validation_error(dense);
    EXPECT_NE(error.find("overlap eager runs mode pulse"), std::string::npos) << error;
  }
  nlohmann::json older = to_json(EngineOptions{});
  older.erase("overlap");  // files written before the option existed: blocking runs
  EXPECT_EQ(options_from_json(older).overlap, Overlap::blocking);
  EngineOptions delayed;
  delayed.overlap = Overlap::delayed;
  EXPECT_NE(shared_options_digest(delayed), shared_options_digest(EngineOptions{}));
}

TEST(EngineOptions, TheContextEncodingParsesAndRunsEveryOverlap) {
  EXPECT_EQ(parse_encoding("context"), codec::Encoding::context);
  EngineOptions options;
  options.codec.encoding = codec::Encoding::context;
  EXPECT_EQ(options_from_json(to_json(options)).codec.encoding, codec::Encoding::context);
  for (const Overlap overlap : {Overlap::blocking, Overlap::delayed, Overlap::eager}) {
    options.overlap = overlap;
    EXPECT_EQ(validation_error(options), "") << overlap_name(overlap);
  }
}

TEST(EngineOptions, JsonWithoutPipelineChunkBytesLoadsWithTheDefault) {
  // Checkpoints and traces written before the option existed.
  nlohmann::json older = to_json(EngineOptions{});
  older.erase("pipeline_chunk_bytes");
  EXPECT_EQ(options_from_json(older).pipeline_chunk_bytes, EngineOptions{}.pipeline_chunk_bytes);
}

TEST(EngineOptions, JsonWithAnInvalidPipelineChunkIsRefused) {
  nlohmann::json json = to_json(EngineOptions{});
  json["pipeline_chunk_bytes"] = 100;
  EXPECT_THROW((void)options_from_json(json), InvalidArgument);
}

// The codec's range, checked before a run starts (a level the encoder refuses would otherwise
// fail the first window).
TEST(EngineOptions, AZstdLevelTheCodecRefusesIsRefusedByName) {
  for (const int level : {-1, codec::kMaxZstdLevel + 1, 22}) {
    EngineOptions options;
    options.codec.zstd_level = level;
    EXPECT_NE(validation_error(options).find("codec level must be in [0, 19]"), std::string::npos)
        << level;
  }
  for (const int level : {0, 1, codec::kMaxZstdLevel}) {
    EngineOptions options;
    options.codec.zstd_level = level;
    EXPECT_EQ(validation_error(options), "") << level;
  }
}

TEST(EngineOptions, PipelineChunkBytesIsSharedByEveryRankThreadsAreNot) {
  const EngineOptions base;
  EngineOptions other_chunk = base;
  other_chunk.pipeline_chunk_bytes = 65536;
  EXPECT_NE(shared_options_digest(other_chunk), shared_options_digest(base));
  EngineOptions other_threads = base;
  other_threads.threads = base.threads + 3;
  EXPECT_EQ(shared_options_digest(other_threads), shared_options_digest(base));
}

// Windows with a 4 KiB pipeline chunk match those with the default bit for bit, and move their
// messages in many more transport messages (the option reaches the collectives).
TEST(EngineOptions, ASmallPipelineChunkGivesTheSameWindowsInMoreMessages) {
  constexpr int kRanks = 3;
  const std::vector<std::uint64_t> sizes{20000, 3001};
  struct Run {
    std::vector<std::vector<float>> global;  // rank 0's θ_g per tensor after the windows
    std::uint64_t messages_sent = 0;         // rank 0's transport
  };
  const auto run = [&](std::uint64_t pipeline_chunk_bytes) {
    std::vector<LocalModel> models;
    for (int r = 0; r < kRanks; ++r)
      models.push_back(
          testing::make_model(sizes, DType::float32, 11 + static_cast<std::uint32_t>(r)));
    EngineOptions options = testing::small_options();
    options.pipeline_chunk_bytes = pipeline_chunk_bytes;
    options.allgather = collectives::CollectiveAlgorithm::ring;
    auto transports = transport::inproc::make_group(kRanks);
    std::vector<std::unique_ptr<Engine>> engines(kRanks);
    testing::rethrow_first(testing::run_ranks(kRanks, [&](int r) {
      engines[static_cast<std::size_t>(r)] =
          std::make_unique<Engine>(testing::views_of(models[static_cast<std::size_t>(r)]), options,
                                   std::move(transports[static_cast<std::size_t>(r)]));
    }));
    const std::uint64_t before = engines[0]->transport().stats().messages_sent;
    for (int window = 0; window < 2; ++window) {
      for (int r = 0; r < kRanks; ++r) {
        testing::local_training(models[static_cast<std::size_t>(r)], 3e-5f, 4,
                                static_cast<std::uint32_t>(10 * window + r));
      }
      testing::rethrow_first(testing::run_ranks(kRanks, [&](int r) {
        const WindowReport report = engines[static_cast<std::size_t>(r)]->run_window();
        EXPECT_TRUE(report.replicas_identical);
        if (pipeline_chunk_bytes == 4096) {
          EXPECT_GT(report.payload_bytes, 3 * pipeline_chunk_bytes)
              << "the messages must span several small chunks for this test to mean anything";
        }
      }));
    }
    Run out;
    out.messages_sent = engines[0]->transport().stats().messages_sent - before;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const auto global = engines[0]->global_weights(t);
      out.global.emplace_back(global.begin(), global.end());
    }
    return out;
  };
  const Run small = run(4096);
  const Run large = run(std::uint64_t{1} << 20);
  EXPECT_EQ(small.global, large.global);
  EXPECT_GT(small.messages_sent, large.messages_sent + 10);
}

}  // namespace
}  // namespace pulseloco
