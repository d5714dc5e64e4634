// Checkpoint/resume continues bit-identically; damaged checkpoints are refused without changing
// anything; window traces replay bit-identically and a tampered trace is caught.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <span>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/replay.h>
#include <pulseloco/io/safetensors.h>
#include "engine/training_run.h"

namespace pulseloco {
namespace {

namespace fs = std::filesystem;
using testing::LocalModel;

using testing::fresh_dir;
using testing::kCheckpointSizes;
using testing::kWorld;
using testing::options_for_test;
using testing::TrainingRun;

void expect_same_state(const TrainingRun& a, const TrainingRun& b) {
  for (int r = 0; r < kWorld; ++r) {
    const auto i = static_cast<std::size_t>(r);
    EXPECT_EQ(a.engines[i]->committed_windows(), b.engines[i]->committed_windows());
    for (std::size_t t = 0; t < kCheckpointSizes.size(); ++t) {
      const auto ga = a.engines[i]->global_weights(t), gb = b.engines[i]->global_weights(t);
      const auto ma = a.engines[i]->momentum(t), mb = b.engines[i]->momentum(t);
      const auto ea = a.engines[i]->residual(t), eb = b.engines[i]->residual(t);
      ASSERT_EQ(0, std::memcmp(ga.data(), gb.data(), ga.size_bytes())) << r << "/" << t;
      ASSERT_EQ(0, std::memcmp(ma.data(), mb.data(), ma.size_bytes())) << r << "/" << t;
      ASSERT_EQ(0, std::memcmp(ea.data(), eb.data(), ea.size_bytes())) << r << "/" << t;
      ASSERT_EQ(a.models[i][t].f32, b.models[i][t].f32) << r << "/" << t;
    }
  }
}

// Runs `total` windows uninterrupted, and again with a checkpoint after `saved_after` windows
// that a new job with `resumed_options`, started from other weights, loads before running the
// rest: both must end in the same state on every rank.
void expect_resume_continues_bit_identically(const std::string& name, const EngineOptions& options,
                                             const EngineOptions& resumed_options,
                                             std::uint32_t seed, int saved_after, int total) {
  const fs::path dir = fresh_dir(name);
  TrainingRun uninterrupted(options, seed);
  for (int w = 0; w < total; ++w)
    uninterrupted.window(w);

  TrainingRun first(options, seed);
  for (int w = 0; w < saved_after; ++w)
    first.window(w);
  const fs::path saved = first.save(dir);
  // Named by the outer steps applied (one fewer than boundaries with a window in flight).
  EXPECT_EQ(saved, dir / fmt::format("window-{:06}", first.engines[0]->committed_windows()));
  EXPECT_TRUE(fs::exists(saved / "manifest.json"));
  EXPECT_TRUE(fs::exists(saved / "global.safetensors"));
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_TRUE(fs::exists(saved / fmt::format("rank-{:05}.safetensors", r)));
  }

  TrainingRun resumed(resumed_options, seed + 767);
  resumed.on_all([&](Engine& e) { e.load_checkpoint(dir); });
  for (int w = saved_after; w < total; ++w)
    resumed.window(w);
  expect_same_state(uninterrupted, resumed);
  fs::remove_all(dir);
}

TEST(Checkpoint, ResumeContinuesBitIdenticallyToAnUninterruptedRun) {
  const EngineOptions options = options_for_test();
  expect_resume_continues_bit_identically("resume", options, options, 10, 2, 5);
}

// Overlapped windows: the checkpoint holds each rank's message in flight with its residual; the
// resumed job sends it again and applies it at its first boundary, as the uninterrupted run did
// (eager also rebuilds the start point θ_l restarted from). A context-coded message in flight
// is checked against the checkpoint's θ_g, which it was coded against.
TEST(Checkpoint, AWindowInFlightResumesBitIdentically) {
  for (const auto& [overlap, encoding] : {std::pair{Overlap::delayed, codec::Encoding::pulse},
                                          std::pair{Overlap::eager, codec::Encoding::pulse},
                                          std::pair{Overlap::delayed, codec::Encoding::context},
                                          std::pair{Overlap::eager, codec::Encoding::context}}) {
    SCOPED_TRACE(fmt::format("{}, {}", overlap_name(overlap), codec::encoding_name(encoding)));
    EngineOptions options = options_for_test();
    options.overlap = overlap;
    options.codec.encoding = encoding;
    expect_resume_continues_bit_identically(
        fmt::format("resume_in_flight_{}_{}", overlap_name(overlap),
                    codec::encoding_name(encoding)),
        options, options, 60, 3, 6);
  }
}

TEST(Checkpoint, ResumingWithAnotherOverlapIsRefusedNamingIt) {
  EngineOptions blocking = options_for_test();
  EngineOptions delayed = blocking;
  delayed.overlap = Overlap::delayed;
  EXPECT_EQ(options_that_change_the_state(delayed, blocking), std::vector<std::string>{"overlap"});
}

// How the bytes move is not part of the state: a job may resume with every option
// options_that_change_the_state leaves out changed (another all-gather algorithm, pipeline chunk,
// encoding and zstd level, exchange kind, node awareness, thread count, timeout, without digest
// checks, with traces and publishing) and still continues bit-identically.
TEST(Checkpoint, ResumingWithOtherTransportSettingsContinuesBitIdentically) {
  const EngineOptions options = options_for_test();
  EngineOptions other = options;
  other.allgather = collectives::CollectiveAlgorithm::direct;
  other.pipeline_chunk_bytes = 4096;
  other.codec.encoding = codec::Encoding::plain_i32_f32;
  other.codec.zstd_level = 9;
  other.exchange = Exchange::reduction;
  other.node_aware = !options.node_aware;
  other.threads = options.threads + 1;
  other.timeout = options.timeout + std::chrono::milliseconds(10'000);
  other.verify_digests = false;
  other.trace_dir = fresh_dir("resume_other_transport_traces").string();
  other.publish_dir = (fresh_dir("resume_other_transport_published") / "run").string();
  other.publish_every = 2;
  other.anchor_every = 3;
  EXPECT_TRUE(options_that_change_the_state(options, other).empty());
  expect_resume_continues_bit_identically("resume_other_transport", options, other, 40, 2, 4);
  EXPECT_FALSE(fs::is_empty(other.trace_dir));
  EXPECT_TRUE(fs::exists(other.publish_dir));
  fs::remove_all(fs::path(other.trace_dir));
  fs::remove_all(fs::path(other.publish_dir).parent_path());
}

// An option the state depends on must match: the refusal names it with both values, on every
// rank, and leaves the state as it was.
TEST(Checkpoint, ResumingWithAnotherOuterLearningRateIsRefusedNamingIt) {
  const fs::path dir = fresh_dir("resume_other_lr");
  const EngineOptions options = options_for_test();
  TrainingRun first(options, 50);
  first.window(0);
  (void)first.save(dir);

  EngineOptions other = options;
  other.outer_lr = 0.5f;
  other.pipeline_chunk_bytes = 8192;  // not part of the state: not named
  EXPECT_EQ(options_that_change_the_state(options, other), std::vector<std::string>{"outer_lr"});
  TrainingRun resumed(other, 51);
  std::vector<Digest> before;
  for (const auto& e : resumed.engines)
    before.push_back(e->state_digest());
  const auto errors = testing::run_ranks(
      kWorld, [&](int r) { resumed.engines[static_cast<std::size_t>(r)]->load_checkpoint(dir); });
  for (int r = 0; r < kWorld; ++r) {
    const auto i = static_cast<std::size_t>(r);
    ASSERT_TRUE(errors[i]) << "rank " << r << " loaded";
    EXPECT_EQ(resumed.engines[i]->state_digest(), before[i]);
    EXPECT_EQ(resumed.engines[i]->committed_windows(), 0u);
  }
  try {
    std::rethrow_exception(errors[0]);
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("outer_lr 0.69999"), std::string::npos) << what;
    EXPECT_NE(what.find("(this run: 0.5)"), std::string::npos) << what;
    EXPECT_EQ(what.find("pipeline_chunk_bytes"), std::string::npos) << what;
  }
  fs::remove_all(dir);
}

TEST(Checkpoint, DamagedCheckpointIsRefusedOnEveryRankAndNothingChanges) {
  const fs::path dir = fresh_dir("damaged");
  const EngineOptions options = options_for_test();
  TrainingRun run(options, 20);
  run.window(0);
  const fs::path saved = run.save(dir);
  run.window(1);
  std::vector<Digest> before;
  for (const auto& e : run.engines)
    before.push_back(e->state_digest());

  // Flip one byte of rank 1's residual data: only rank 1 reads it, but every rank refuses.
  const fs::path victim = saved / "rank-00001.safetensors";
  {
    const io::SafetensorsReader reader(victim);
    const auto& info = reader.tensor("residual.tensor0");
    std::fstream file(victim, std::ios::in | std::ios::out | std::ios::binary);
    const auto offset =
        static_cast<std::streamoff>(reader.data_section_offset() + info.data_begin + 5);
    file.seekg(offset);
    char byte = 0;
    file.read(&byte, 1);
    byte = static_cast<char>(byte ^ 0x10);
    file.seekp(offset);
    file.write(&byte, 1);
  }
  const auto errors = testing::run_ranks(
      kWorld, [&](int r) { run.engines[static_cast<std::size_t>(r)]->load_checkpoint(dir); });
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " loaded";
    EXPECT_EQ(run.engines[static_cast<std::size_t>(r)]->state_digest(),
              before[static_cast<std::size_t>(r)]);
    EXPECT_EQ(run.engines[static_cast<std::size_t>(r)]->committed_windows(), 2u);
  }
  for (const auto& error : errors) {
    try {
      std::rethrow_exception(error);
    } catch (const ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find("rank-00001.safetensors: the file is damaged"),
                std::string::npos)
          << e.what();
      EXPECT_EQ(e.context().ranks, std::vector<int>{1});
    }
  }
  fs::remove_all(dir);
}

// Rewrites a checkpoint file as builds before the piece digest wrote it: no "digest" key, and
// `digest_key` = the digests over each tensor's whole bytes, combined in file order (returned);
// `state_hex`, when given, replaces the recorded state digest; `digest_name`, when given, is
// recorded as the definition instead of leaving the key out.
std::string rewrite_with_whole_buffer_digests(const fs::path& file, const std::string& digest_key,
                                              const std::string& state_hex = {},
                                              const std::optional<std::string>& digest_name = {}) {
  std::string combined;
  testing::rewrite_metadata(file, [&](io::Metadata& metadata, const auto& data) {
    std::vector<Digest> parts;
    for (const auto& bytes : data)
      parts.push_back(digest_bytes(bytes));
    EXPECT_EQ(metadata.at("digest"), kBufferDigestName);
    metadata.erase("digest");
    if (digest_name) metadata["digest"] = *digest_name;
    combined = digest_hex(combine_digests(parts));
    metadata[digest_key] = combined;
    if (!state_hex.empty()) metadata["state_digest"] = state_hex;
  });
  testing::record_in_manifest(file);
  return combined;
}

// Checkpoints written before the piece digest record whole-buffer digests and no "digest" key:
// they still verify and load, and the job continues bit-identically.
TEST(Checkpoint, FilesWithWholeBufferDigestsStillLoad) {
  const fs::path dir = fresh_dir("whole_buffer_digests");
  const EngineOptions options = options_for_test();
  TrainingRun uninterrupted(options, 30);
  for (int w = 0; w < 3; ++w)
    uninterrupted.window(w);

  TrainingRun first(options, 30);
  first.window(0);
  const fs::path saved = first.save(dir);
  const std::string state_hex =
      rewrite_with_whole_buffer_digests(saved / "global.safetensors", "state_digest");
  for (int r = 0; r < kWorld; ++r) {
    (void)rewrite_with_whole_buffer_digests(saved / fmt::format("rank-{:05}.safetensors", r),
                                            "residual_digest", state_hex);
  }

  TrainingRun resumed(options, 30 + 767);
  resumed.on_all([&](Engine& e) { e.load_checkpoint(dir); });
  for (int w = 1; w < 3; ++w)
    resumed.window(w);
  expect_same_state(uninterrupted, resumed);
  fs::remove_all(dir);
}

// The "digest" key, not the digests' values, decides how a file verifies: whole-buffer digests
// under the piece definition's name are a mismatch, and an unknown definition is refused by
// name, on every rank and without changing the state.
TEST(Checkpoint, TheRecordedDigestDefinitionDecidesHowFilesVerify) {
  const fs::path dir = fresh_dir("digest_definition");
  const EngineOptions options = options_for_test();
  TrainingRun run(options, 40);
  run.window(0);
  const std::vector<Digest> before = run.digests();
  for (const std::string& name :
       {std::string(kBufferDigestName), std::string("xxh3-64-pieces-1MiB")}) {
    const fs::path saved = run.save(dir);
    (void)rewrite_with_whole_buffer_digests(saved / "global.safetensors", "state_digest", {}, name);
    const auto errors = testing::run_ranks(
        kWorld, [&](int r) { run.engines[static_cast<std::size_t>(r)]->load_checkpoint(dir); });
    for (int r = 0; r < kWorld; ++r) {
      const auto i = static_cast<std::size_t>(r);
      ASSERT_TRUE(errors[i]) << "rank " << r << " loaded with digest " << name;
      EXPECT_EQ(run.engines[i]->state_digest(), before[i]);
    }
    try {
      std::rethrow_exception(errors[0]);
    } catch (const ProtocolError& e) {
      EXPECT_NE(std::string(e.what()).find(name == kBufferDigestName ? "does not match" : name),
                std::string::npos)
          << e.what();
    }
  }
  fs::remove_all(dir);
}

TEST(Checkpoint, MissingDirectoryIsAClearError) {
  const EngineOptions options = options_for_test();
  TrainingRun run(options, 30);
  const auto errors = testing::run_ranks(kWorld, [&](int r) {
    run.engines[static_cast<std::size_t>(r)]->load_checkpoint("/nonexistent/pulseloco/ckpt");
  });
  for (const auto& error : errors) {
    ASSERT_TRUE(error);
    EXPECT_THROW(std::rethrow_exception(error), Error);
  }
}

TEST(Trace, EveryTracedWindowReplaysBitIdenticallyAndTamperingIsCaught) {
  const fs::path dir = fresh_dir("trace");
  EngineOptions options = options_for_test();
  options.trace_dir = dir.string();
  TrainingRun run(options, 40);
  for (int w = 0; w < 3; ++w)
    run.window(w);

  EXPECT_EQ(traced_windows(dir), (std::vector<std::uint64_t>{0, 1, 2}));
  // Every rank's message of every window, whole, as it went on the wire.
  for (std::uint64_t w : traced_windows(dir)) {
    for (int r = 0; r < kWorld; ++r) {
      const fs::path file =
          dir / fmt::format("window-{:06}", w) / fmt::format("rank-{:05}.message", r);
      std::ifstream in(file, std::ios::binary);
      ASSERT_TRUE(in) << file;
      const std::vector<char> chars((std::istreambuf_iterator<char>(in)),
                                    std::istreambuf_iterator<char>());
      const auto bytes = std::as_bytes(std::span(chars));
      const codec::MessageView message = codec::MessageView::parse(bytes);
      EXPECT_EQ(message.header().window, w);
      EXPECT_EQ(message.header().sender_rank, static_cast<std::uint32_t>(r));
      EXPECT_FALSE(fs::exists(file.string() + ".partial"));
    }
  }
  for (std::uint64_t w : traced_windows(dir)) {
    const ReplayResult result = replay_window(dir, w);
    EXPECT_TRUE(result.identical()) << "window " << w;
    EXPECT_EQ(result.world_size, kWorld);
    EXPECT_EQ(result.tensors_compared, kWorld * kCheckpointSizes.size() * 4);
  }

  // Change one recorded output value: the replay must point at it.
  const fs::path out = dir / "window-000001" / "rank-00002.out.safetensors";
  {
    const io::SafetensorsReader reader(out);
    const auto& info = reader.tensor("global.tensor2");
    std::fstream file(out, std::ios::in | std::ios::out | std::ios::binary);
    const auto offset =
        static_cast<std::streamoff>(reader.data_section_offset() + info.data_begin + 4 * 123);
    file.seekp(offset);
    const float changed = 1.0f;
    file.write(reinterpret_cast<const char*>(&changed), sizeof changed);
  }
  const ReplayResult tampered = replay_window(dir, 1);
  ASSERT_FALSE(tampered.identical());
  ASSERT_EQ(tampered.differences.size(), 1u);
  EXPECT_EQ(tampered.differences[0].rank, 2);
  EXPECT_EQ(tampered.differences[0].tensor, "global.tensor2");
  EXPECT_EQ(tampered.differences[0].first_index, 123u);
  fs::remove_all(dir);
}

// Errors about what a trace records name the file they come from: the options it recorded (not
// JSON, not valid options), and a rank's input file, which every rank loads before any runs the
// window (a bad one is the error at once, not the other ranks' wait for that rank).
TEST(Trace, ReplayErrorsAboutATracesContentNameItsFile) {
  const fs::path dir = fresh_dir("trace_errors");
  EngineOptions options = options_for_test();
  options.trace_dir = dir.string();
  TrainingRun run(options, 50);
  run.window(0);
  const fs::path out = dir / "window-000000" / "rank-00000.out.safetensors";
  const fs::path in = dir / "window-000000" / "rank-00001.in.safetensors";
  nlohmann::json invalid = to_json(options);
  invalid["steps_per_window"] = 0;
  nlohmann::json incomplete = to_json(options);
  incomplete.erase("mode");
  struct Case {
    fs::path file;
    std::string key;
    std::string value;
    ErrorKind kind;
    std::string says;  // after "FILE: "
  };
  const std::vector<Case> cases{
      {out, "options", "{\"mode\": ", ErrorKind::protocol, "metadata 'options' is not JSON: "},
      {out, "options", invalid.dump(), ErrorKind::invalid_argument,
       "metadata 'options' are not valid options: steps_per_window (H) must be at least 1"},
      {out, "options", incomplete.dump(), ErrorKind::invalid_argument,
       "metadata 'options' are not valid options: options JSON: "},
      {in, "rank", "7", ErrorKind::protocol, "'rank' is '7', expected '1'"},
      {in, "momentum_initialised", "True", ErrorKind::protocol,
       "metadata 'momentum_initialised' = 'True' is not true/false"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.says);
    const std::string original = testing::file_bytes(c.file);
    testing::rewrite_metadata(
        c.file, [&](io::Metadata& metadata, const auto&) { metadata[c.key] = c.value; });
    try {
      (void)replay_window(dir, 0);
      ADD_FAILURE() << "replayed";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), c.kind) << e.what();
      EXPECT_NE(std::string(e.what()).find(c.file.string() + ": " + c.says), std::string::npos)
          << e.what();
    }
    std::ofstream(c.file, std::ios::binary | std::ios::trunc) << original;
  }
  EXPECT_TRUE(replay_window(dir, 0).identical());
  fs::remove_all(dir);
}

// A replay runs the recorded options but writes nothing: a run that published θ_g for inference
// servers replays without publishing into that directory.
TEST(Trace, ReplayPublishesNothing) {
  const fs::path dir = fresh_dir("trace_published");
  const fs::path published = testing::fresh_test_dir("trace_published_weights");
  EngineOptions options = options_for_test();
  options.trace_dir = dir.string();
  options.publish_dir = published.string();
  TrainingRun run(options, 55);
  for (int w = 0; w < 2; ++w)
    run.window(w);
  ASSERT_TRUE(fs::exists(published / "manifest.json"));
  fs::remove_all(published);
  for (std::uint64_t w : traced_windows(dir))
    EXPECT_TRUE(replay_window(dir, w).identical()) << "window " << w;
  EXPECT_FALSE(fs::exists(published));
  fs::remove_all(dir);
}

// Overlapped boundaries: the inputs hold the message in flight, and replay reruns the whole
// boundary (finish, gate, apply, restart) bit for bit.
TEST(Trace, OverlappedBoundariesReplayBitIdentically) {
  for (const auto& [overlap, encoding] : {std::pair{Overlap::delayed, codec::Encoding::pulse},
                                          std::pair{Overlap::eager, codec::Encoding::pulse},
                                          std::pair{Overlap::eager, codec::Encoding::context}}) {
    SCOPED_TRACE(fmt::format("{}, {}", overlap_name(overlap), codec::encoding_name(encoding)));
    const fs::path dir = fresh_dir(
        fmt::format("trace_{}_{}", overlap_name(overlap), codec::encoding_name(encoding)));
    EngineOptions options = options_for_test();
    options.overlap = overlap;
    options.codec.encoding = encoding;
    options.trace_dir = dir.string();
    TrainingRun run(options, 70);
    for (int w = 0; w < 3; ++w)
      run.window(w);
    EXPECT_EQ(traced_windows(dir), (std::vector<std::uint64_t>{0, 1, 2}));
    for (std::uint64_t w : traced_windows(dir)) {
      const io::SafetensorsReader inputs(dir / fmt::format("window-{:06}", w) /
                                         "rank-00001.in.safetensors");
      EXPECT_EQ(inputs.contains("in_flight_message"), w > 0) << "window " << w;
      const ReplayResult result = replay_window(dir, w);
      EXPECT_TRUE(result.identical()) << "window " << w;
      EXPECT_EQ(result.tensors_compared, kWorld * kCheckpointSizes.size() * 4);
    }
    fs::remove_all(dir);
  }
}

// bf16 local weights with the authors' Δ: the trace records the choice with the options, and
// replay reruns each window with it, bit for bit (with `exact` the windows would differ, see
// Engine.Bf16DeltaChoicesDifferOnBf16WeightsAndCoincideOnFp32).
TEST(Trace, Bf16WindowsWithTheAuthorsDeltaReplayBitIdentically) {
  const fs::path dir = fresh_dir("trace_bf16_authors");
  EngineOptions options = options_for_test();
  options.trace_dir = dir.string();
  options.bf16_delta = kernels::Bf16Delta::authors;
  TrainingRun run(options, 60, DType::bfloat16);
  for (int w = 0; w < 3; ++w)
    run.window(w);
  ASSERT_EQ(traced_windows(dir), (std::vector<std::uint64_t>{0, 1, 2}));
  const io::SafetensorsReader inputs(dir / "window-000001" / "rank-00000.in.safetensors");
  const auto recorded = nlohmann::json::parse(inputs.metadata().at("options"));
  EXPECT_EQ(recorded.at("bf16_delta"), "authors");
  for (std::uint64_t w : traced_windows(dir)) {
    const ReplayResult result = replay_window(dir, w);
    EXPECT_TRUE(result.identical()) << "window " << w;
    EXPECT_EQ(result.tensors_compared, kWorld * kCheckpointSizes.size() * 4);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace pulseloco
