// Publishing θ_g from training (EngineOptions::publish_dir): rank 0 publishes every due window
// as version = the window counter, a patch::Receiver reconstructs each version byte-identical
// to bf16(θ_g) of that window, a failed publication is the report's and not the window's, and a
// resumed run continues the directory's version sequence, and a new run does not append onto
// another run's versions unasked.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <optional>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/patch/manifest.h>
#include <pulseloco/patch/receiver.h>
#include "engine/training_run.h"

namespace pulseloco {
namespace {

namespace fs = std::filesystem;
using testing::kWorld;
using testing::TrainingRun;

EngineOptions publishing_options(const fs::path& dir, std::uint64_t anchor_every = 3) {
  EngineOptions options = testing::options_for_test();
  options.publish_dir = dir.string();
  options.anchor_every = anchor_every;
  return options;
}

// Local training and a window on every rank; every rank's report. The steps are small enough
// that a few percent of the bf16 weights change per window, as in post-training, so deltas are
// well below an anchor and anchors fall due by count alone.
std::vector<WindowReport> run_window(TrainingRun& run, int index) {
  constexpr float kInnerLr = 2e-6f;
  for (int r = 0; r < kWorld; ++r) {
    testing::local_training(run.models[static_cast<std::size_t>(r)], kInnerLr, 2,
                            static_cast<std::uint32_t>(1000 * index + r));
  }
  std::vector<WindowReport> reports(kWorld);
  testing::rethrow_first(testing::run_ranks(kWorld, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    reports[i] = run.engines[i]->run_window();
  }));
  return reports;
}

// The receiver's state is bf16 of rank 0's θ_g, tensor by tensor, bit for bit.
void expect_holds_bf16_of_global(const patch::Receiver& receiver, const Engine& engine) {
  const auto& tensors = receiver.state().tensors();
  ASSERT_EQ(tensors.size(), testing::kCheckpointSizes.size());
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const std::vector<float> global =
        engine.copy_state(Engine::StateTensor::global_weights, t);  // "tensor<t>", name order
    ASSERT_EQ(tensors[t].name, "tensor" + std::to_string(t));
    ASSERT_EQ(tensors[t].bits.size(), global.size());
    for (std::size_t i = 0; i < global.size(); ++i) {
      ASSERT_EQ(tensors[t].bits[i], float_to_bf16_bits(global[i]))
          << "tensor " << t << " element " << i << " at version " << *receiver.version();
    }
  }
}

std::vector<std::uint64_t> listed_versions(const fs::path& dir) {
  std::vector<std::uint64_t> versions;
  for (const auto& entry : patch::read_manifest(dir).versions)
    versions.push_back(entry.version);
  return versions;
}

TEST(Publishing, EveryVersionReconstructsBf16OfThatWindowsGlobalWeights) {
  const fs::path dir = testing::fresh_test_dir("publish_every_window");
  TrainingRun run(publishing_options(dir), 31);
  patch::Receiver following;  // brought up to date after every window (deltas)
  for (int w = 0; w < 6; ++w) {
    const std::vector<WindowReport> reports = run_window(run, w);
    const WindowReport& report = reports[0];
    const auto version = static_cast<std::uint64_t>(w + 1);
    ASSERT_EQ(report.published_version, version) << report.publish_error;
    EXPECT_TRUE(report.publish_error.empty());
    for (int r = 1; r < kWorld; ++r)
      EXPECT_FALSE(reports[static_cast<std::size_t>(r)].published_version) << "rank " << r;
    // Anchors at versions 1, 4 (anchor_every 3); deltas from version 2 on.
    EXPECT_EQ(report.patch_anchor_bytes > 0, version % 3 == 1) << "version " << version;
    EXPECT_EQ(report.patch_delta_bytes > 0, version > 1);
    EXPECT_EQ(report.patch_compact_bytes > 0, version > 1);
    if (version > 1) {
      EXPECT_GT(report.patch_changed, 0U);
      EXPECT_LT(report.patch_changed, report.parameters);
      EXPECT_DOUBLE_EQ(report.patch_density, static_cast<double>(report.patch_changed) /
                                                 static_cast<double>(report.parameters));
    }
    const nlohmann::json json = to_json(report);
    EXPECT_EQ(json.at("published_version"), version);
    EXPECT_EQ(json.at("patch_anchor"), report.patch_anchor_bytes > 0);
    EXPECT_EQ(json.at("patch_compact_bytes"), report.patch_compact_bytes);
    EXPECT_TRUE(to_json(reports[1]).at("published_version").is_null());
    EXPECT_NE(summary_line(report).find(fmt::format("published v{}", version)), std::string::npos);
    const patch::UpdateReport update = following.update(dir);
    EXPECT_EQ(update.to, version);
    expect_holds_bf16_of_global(following, *run.engines[0]);
    patch::Receiver fresh;  // from nothing: an anchor and the deltas after it
    (void)fresh.update(dir);
    EXPECT_EQ(fresh.state().digest(), following.state().digest());
  }
  EXPECT_EQ(listed_versions(dir), (std::vector<std::uint64_t>{1, 2, 3, 4, 5, 6}));
  fs::remove_all(dir);
}

TEST(Publishing, PublishEveryKPublishesOnlyEveryKthWindow) {
  const fs::path dir = testing::fresh_test_dir("publish_every_k");
  EngineOptions options = publishing_options(dir);
  options.publish_every = 2;
  TrainingRun run(options, 41);
  for (int w = 0; w < 5; ++w) {
    const WindowReport report = run_window(run, w)[0];
    const bool due = (w + 1) % 2 == 0;
    EXPECT_EQ(report.published_version.has_value(), due) << "window " << w;
    if (!due) continue;
    patch::Receiver receiver;
    (void)receiver.update(dir);
    expect_holds_bf16_of_global(receiver, *run.engines[0]);
  }
  EXPECT_EQ(listed_versions(dir), (std::vector<std::uint64_t>{2, 4}));
  fs::remove_all(dir);
}

// A publication that cannot write its files (here: `deltas` is a file, so no delta can be
// created) leaves the window committed and identical on every rank; the report says why, and
// the next publication, once the directory is usable again, is a delta from the last published
// version.
TEST(Publishing, AFailedPublicationIsReportedAndTheNextOneCatchesUp) {
  const fs::path dir = testing::fresh_test_dir("publish_failure");
  TrainingRun run(publishing_options(dir, 10), 51);
  ASSERT_EQ(run_window(run, 0)[0].published_version, 1U);
  patch::Receiver receiver;
  (void)receiver.update(dir);

  fs::remove_all(dir / "deltas");
  { std::ofstream(dir / "deltas") << "not a directory"; }
  const std::vector<WindowReport> failed = run_window(run, 1);
  EXPECT_FALSE(failed[0].published_version);
  EXPECT_FALSE(failed[0].publish_error.empty());
  EXPECT_NE(summary_line(failed[0]).find("NOT PUBLISHED"), std::string::npos);
  for (const WindowReport& report : failed) {
    EXPECT_TRUE(report.replicas_identical);
    EXPECT_EQ(report.digest, failed[0].digest);
  }
  EXPECT_EQ(run.engines[0]->committed_windows(), 2U);
  EXPECT_EQ(listed_versions(dir), (std::vector<std::uint64_t>{1}));

  fs::remove(dir / "deltas");
  fs::create_directory(dir / "deltas");
  const WindowReport report = run_window(run, 2)[0];
  ASSERT_EQ(report.published_version, 3U) << report.publish_error;
  const patch::UpdateReport update = receiver.update(dir);
  ASSERT_EQ(update.steps.size(), 1U);
  EXPECT_NE(update.steps[0].kind, patch::StepKind::anchor);  // 1 -> 3 by one delta
  expect_holds_bf16_of_global(receiver, *run.engines[0]);
  EXPECT_EQ(listed_versions(dir), (std::vector<std::uint64_t>{1, 3}));
  fs::remove_all(dir);
}

TEST(Publishing, AResumedRunContinuesTheDirectorysVersionSequence) {
  const fs::path dir = testing::fresh_test_dir("publish_resume");
  const fs::path checkpoints = testing::fresh_dir("publish_resume_checkpoints");
  const EngineOptions options = publishing_options(dir);
  patch::Receiver receiver;
  fs::path checkpoint;
  {
    TrainingRun first(options, 61);
    for (int w = 0; w < 3; ++w)
      (void)run_window(first, w);
    checkpoint = first.save(checkpoints);
    (void)receiver.update(dir);
    expect_holds_bf16_of_global(receiver, *first.engines[0]);
  }
  {
    // Resumed at window 3, the directory's newest version: versions 4 and 5 follow as deltas
    // from 3, and the anchor falls due at 4 as if one publisher had written all of them.
    TrainingRun resumed(options, 71);
    resumed.on_all([&](Engine& e) { (void)e.load_checkpoint(checkpoint); });
    for (int w = 3; w < 5; ++w) {
      const WindowReport report = run_window(resumed, w)[0];
      ASSERT_EQ(report.published_version, static_cast<std::uint64_t>(w + 1))
          << report.publish_error;
      EXPECT_EQ(report.patch_anchor_bytes > 0, w + 1 == 4);
      EXPECT_GT(report.patch_delta_bytes, 0U);
      (void)receiver.update(dir);
      expect_holds_bf16_of_global(receiver, *resumed.engines[0]);
    }
  }
  {
    // Resumed again at window 3, now older than the directory's newest (5): windows 4 and 5 are
    // not published (their versions exist), window 6 is, as a delta from version 5.
    TrainingRun again(options, 81);
    again.on_all([&](Engine& e) { (void)e.load_checkpoint(checkpoint); });
    for (int w = 3; w < 5; ++w) {
      const WindowReport report = run_window(again, w)[0];
      EXPECT_FALSE(report.published_version);
      EXPECT_FALSE(report.publish_error.empty());
    }
    const WindowReport report = run_window(again, 5)[0];
    ASSERT_EQ(report.published_version, 6U) << report.publish_error;
    const patch::UpdateReport update = receiver.update(dir);
    ASSERT_EQ(update.from, 5U);
    expect_holds_bf16_of_global(receiver, *again.engines[0]);
  }
  EXPECT_EQ(listed_versions(dir), (std::vector<std::uint64_t>{1, 2, 3, 4, 5, 6}));
  fs::remove_all(dir);
  fs::remove_all(checkpoints);
}

// A new run (not resumed from a checkpoint) into a directory of another run's versions: every
// due window is refused, saying why and what to do, and nothing is appended even once the
// run's versions pass the directory's; with publish_continue it publishes after them.
TEST(Publishing, ANewRunRefusesAnotherRunsDirectoryUnlessAskedToContinue) {
  const fs::path dir = testing::fresh_test_dir("publish_other_run");
  {
    TrainingRun first(publishing_options(dir), 91);
    for (int w = 0; w < 2; ++w)
      (void)run_window(first, w);
  }
  {
    TrainingRun second(publishing_options(dir), 92);
    for (int w = 0; w < 4; ++w) {
      const WindowReport report = run_window(second, w)[0];
      EXPECT_FALSE(report.published_version) << "window " << w;
      EXPECT_NE(report.publish_error.find("already holds versions 1 to 2"), std::string::npos)
          << report.publish_error;
      EXPECT_NE(report.publish_error.find("publish_continue"), std::string::npos)
          << report.publish_error;
    }
  }
  EXPECT_EQ(listed_versions(dir), (std::vector<std::uint64_t>{1, 2}));
  {
    EngineOptions options = publishing_options(dir);
    options.publish_continue = true;
    TrainingRun third(options, 93);
    for (int w = 0; w < 3; ++w)
      (void)run_window(third, w);
  }
  EXPECT_EQ(listed_versions(dir), (std::vector<std::uint64_t>{1, 2, 3}));
  fs::remove_all(dir);
}

TEST(Publishing, OptionsAreRankLocalAndDoNotChangeTheState) {
  const EngineOptions base;
  EngineOptions publishing = base;
  publishing.publish_dir = "/tmp/versions";
  publishing.publish_every = 3;
  publishing.anchor_every = 7;
  EXPECT_EQ(shared_options_digest(publishing), shared_options_digest(base));
  EXPECT_TRUE(options_that_change_the_state(base, publishing).empty());
  const EngineOptions back = options_from_json(to_json(publishing));
  EXPECT_EQ(back.publish_dir, "/tmp/versions");
  EXPECT_EQ(back.publish_every, 3U);
  EXPECT_EQ(back.anchor_every, 7U);

  EngineOptions bad = base;
  bad.publish_every = 0;
  EXPECT_THROW(bad.validate(), InvalidArgument);
  bad = base;
  bad.anchor_every = 0;
  EXPECT_THROW(bad.validate(), InvalidArgument);
  bad = publishing;
  bad.mode = Mode::ddp;
  EXPECT_THROW(bad.validate(), InvalidArgument);
}

}  // namespace
}  // namespace pulseloco
