// patch::Publisher: anchors when due, a NaN refused with nothing published, a publisher
// SIGKILLed after writing a version's files but before its manifest: readers never see that
// version, and manifest writes that report an error after landing (a lost S3 answer).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/patch/publisher.h>
#include <pulseloco/patch/receiver.h>
#include "io/test_files.h"
#include "patch/killed_publisher.h"
#include "patch/patch_run.h"
#include "patch/publish_faults.h"

namespace pulseloco::testing {
namespace {

using io::test::TempDir;

TEST(Publisher, AnchorsEveryNVersionsAndTheFirst) {
  TempDir dir;
  (void)publish_run(dir.path(), 7, 3, {.anchor_every = 3});
  const patch::Manifest manifest = patch::read_manifest(dir.path());
  ASSERT_EQ(manifest.versions.size(), 7u);
  for (const patch::ManifestVersion& entry : manifest.versions) {
    EXPECT_EQ(entry.anchor.has_value(), entry.version % 3 == 1) << entry.version;
    EXPECT_EQ(entry.delta.has_value(), entry.version > 1) << entry.version;
  }
}

// Anchors fall due by the versions and delta bytes since the last anchor, which a publisher that
// continues a directory counts from its manifest as the one that wrote it did.
TEST(Publisher, AContinuingPublisherPlacesAnchorsAsOnePublisherWould) {
  const auto anchored_versions = [](const std::filesystem::path& directory) {
    std::vector<std::uint64_t> anchored;
    for (const patch::ManifestVersion& entry : patch::read_manifest(directory).versions) {
      if (entry.anchor) anchored.push_back(entry.version);
    }
    return anchored;
  };
  TempDir one;
  TempDir two;
  (void)publish_run(one.path(), 8, 5, {.anchor_every = 3});
  {
    PatchRun run(5);
    std::optional<patch::Publisher> publisher;
    publisher.emplace(two.path(), patch::PublisherOptions{.anchor_every = 3});
    for (std::uint64_t v = 1; v <= 8; ++v) {
      if (v == 6) {  // a new publisher continues the directory, one version after an anchor
        publisher.reset();
        publisher.emplace(two.path(),
                          patch::PublisherOptions{.anchor_every = 3, .continue_existing = true});
      }
      if (v > 1) run.step();
      (void)publisher->publish(run.views(), v);
    }
  }
  EXPECT_EQ(anchored_versions(one.path()), (std::vector<std::uint64_t>{1, 4, 7}));
  EXPECT_EQ(anchored_versions(two.path()), anchored_versions(one.path()));
}

TEST(Publisher, CompactPatchesAreAtLeast2_5TimesSmallerThanGapDeltaFiles) {
  TempDir dir;
  (void)publish_run(dir.path(), 6, 3, {.anchor_every = 100});
  for (const patch::ManifestVersion& entry : patch::read_manifest(dir.path()).versions) {
    if (!entry.delta) continue;
    ASSERT_TRUE(entry.compact);
    EXPECT_GE(static_cast<double>(entry.delta->bytes) / static_cast<double>(entry.compact->bytes),
              2.5)
        << "version " << entry.version;
  }
}

TEST(Publisher, AnchorsWhenTheChainWouldOutgrowAnAnchor) {
  TempDir dir;
  PatchRun run(4);
  patch::Publisher publisher(dir.path(), {.anchor_every = 1000});
  (void)publisher.publish(run.views(), 1);
  // Every weight moves by far more than a bf16 ulp: each delta is larger than half an anchor.
  std::uint64_t anchors = 0;
  for (std::uint64_t v = 2; v <= 4; ++v) {
    for (RunTensor& tensor : run.tensors()) {
      for (float& w : tensor.master)
        w = -w * 1.5f + 0.001f;
      if (tensor.dtype == DType::bfloat16) float_to_bf16(tensor.master, tensor.bf16);
    }
    const patch::PublishedVersion published = publisher.publish(run.views(), v);
    EXPECT_GT(published.delta_bytes, 0u);
    anchors += published.anchor_bytes > 0 ? 1 : 0;
  }
  EXPECT_GE(anchors, 1u);
  patch::Receiver receiver;
  (void)receiver.update(dir.path());
  EXPECT_EQ(receiver.state().digest(), run.expected().digest());
}

TEST(Publisher, NanIsRefusedAndNothingIsPublished) {
  TempDir dir;
  PatchRun run(5);
  patch::Publisher publisher(dir.path(), {.chunk_elements = 1000, .threads = 2});
  (void)publisher.publish(run.views(), 1);
  run.step();
  const Digest before = publisher.snapshot().digest();
  RunTensor& tensor = run.tensors()[1];
  tensor.master[4321] = std::numeric_limits<float>::quiet_NaN();
  try {
    (void)publisher.publish(run.views(), 2);
    FAIL() << "a NaN was published";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::non_finite);
    EXPECT_EQ(error.context().tensor, tensor.name);
    EXPECT_EQ(error.context().index, 4321u);
  }
  EXPECT_EQ(publisher.snapshot().digest(), before);
  EXPECT_EQ(patch::read_manifest(dir.path()).versions.size(), 1u);
  tensor.master[4321] = 0.5f;
  (void)publisher.publish(run.views(), 2);
  patch::Receiver receiver;
  (void)receiver.update(dir.path());
  EXPECT_EQ(receiver.version(), 2u);
  EXPECT_EQ(receiver.state().digest(), run.expected().digest());
}

TEST(Publisher, VersionsMustAscendAndTensorsStayTheSame) {
  TempDir dir;
  PatchRun run(6);
  patch::Publisher publisher(dir.path(), {});
  (void)publisher.publish(run.views(), 5);
  EXPECT_THROW((void)publisher.publish(run.views(), 5), InvalidArgument);
  std::vector<patch::WeightsView> fewer = run.views();
  fewer.pop_back();
  EXPECT_THROW((void)publisher.publish(fewer, 6), InvalidArgument);
  EXPECT_THROW(patch::Publisher(dir.path(), {}), InvalidArgument);  // the directory is in use
}

TEST(Publisher, KilledBetweenFilesAndManifestIsInvisible) {
  TempDir dir;
  publish_and_kill_before_manifest(dir.path().string());
  if (HasFatalFailure()) return;

  // Version 4's files are complete on disk (an anchor is due at 4 too) but not listed.
  EXPECT_TRUE(std::filesystem::exists(dir.path() / patch::delta_file_name(4)));
  EXPECT_TRUE(std::filesystem::exists(dir.path() / patch::anchor_file_name(4)));
  patch::Receiver receiver;
  const patch::UpdateReport report = receiver.update(dir.path());
  EXPECT_EQ(report.to, 3u);
  PatchRun run(7);
  run.step();
  run.step();
  EXPECT_EQ(receiver.state().digest(), run.expected().digest());
}

// A manifest write that reports an error although the manifest landed (an S3 PUT whose answer
// was lost): the manifest there names the version, so it is published, and the sequence goes on
// from it.
TEST(Publisher, AManifestWriteThatFailsAfterLandingPublishesTheVersion) {
  TempDir dir;
  PatchRun run(7);
  std::uint64_t publishing = 0;
  patch::Publisher publisher(dir.path(),
                             {.anchor_every = 10, .fault_hook = [&](std::string_view point) {
                                if (publishing == 3 && point == "manifest written")
                                  throw IoError("the answer to the manifest's PUT was lost");
                              }});
  patch::Receiver follower;
  publish_versions(publisher, run, publishing, 1, 2);
  (void)follower.update(dir.path());
  publish_versions(publisher, run, publishing, 3, 3);
  EXPECT_EQ(publisher.manifest().versions.back().version, 3u);
  expect_one_patch_to(follower, dir.path(), 3, run);
  publish_versions(publisher, run, publishing, 4, 4);  // its patch starts at version 3
  expect_one_patch_to(follower, dir.path(), 4, run);
}

// A manifest write that reports an error, and a location that cannot be read back: publish
// throws, and the next publish first reloads what readers see, so a version published in the
// end is refused as not above the last and the next one follows it.
TEST(Publisher, AManifestWriteOfUnknownOutcomeIsSettledByTheNextPublish) {
  TempDir dir;
  PatchRun run(7);
  std::uint64_t publishing = 0;
  int read_backs = 0;
  patch::Publisher publisher(dir.path(),
                             {.anchor_every = 10, .fault_hook = [&](std::string_view point) {
                                if (publishing != 3) return;
                                if (point == "manifest written")
                                  throw IoError("the answer to the manifest's PUT was lost");
                                if (point == "manifest read back") {
                                  ++read_backs;
                                  throw IoError("the location cannot be reached");
                                }
                              }});
  patch::Receiver follower;
  publish_versions(publisher, run, publishing, 1, 2);
  (void)follower.update(dir.path());
  run.step();
  publishing = 3;
  EXPECT_THROW((void)publisher.publish(run.views(), 3), IoError);
  EXPECT_EQ(read_backs, 1);
  EXPECT_EQ(publisher.manifest().versions.back().version, 2u);
  expect_one_patch_to(follower, dir.path(), 3, run);  // the manifest landed

  publishing = 0;
  EXPECT_THROW((void)publisher.publish(run.views(), 3), InvalidArgument);
  EXPECT_EQ(publisher.manifest().versions.back().version, 3u);
  EXPECT_EQ(publisher.snapshot().digest(), run.expected().digest());
  publish_versions(publisher, run, publishing, 4, 4);
  expect_one_patch_to(follower, dir.path(), 4, run);
}

// The same error where the manifest did not land: nothing is published, and the next publish
// needs no reload.
TEST(Publisher, AManifestWriteThatFailsBeforeLandingPublishesNothing) {
  TempDir dir;
  PatchRun run(7);
  std::uint64_t publishing = 0;
  patch::Publisher publisher(dir.path(),
                             {.anchor_every = 10, .fault_hook = [&](std::string_view point) {
                                if (publishing != 3) return;
                                if (point == "manifest written")
                                  throw IoError("the manifest's PUT failed");
                                if (point == "manifest read back") {
                                  // The error came before the write landed: the location holds
                                  // the previous manifest.
                                  patch::Manifest previous = patch::read_manifest(dir.path());
                                  previous.versions.pop_back();
                                  patch::write_manifest(dir.path(), previous);
                                }
                              }});
  patch::Receiver follower;
  publish_versions(publisher, run, publishing, 1, 2);
  (void)follower.update(dir.path());
  const patch::Bf16State at_2 = publisher.snapshot();
  run.step();
  publishing = 3;
  EXPECT_THROW((void)publisher.publish(run.views(), 3), IoError);
  EXPECT_EQ(publisher.manifest().versions.back().version, 2u);
  EXPECT_EQ(publisher.snapshot().digest(), at_2.digest());
  publishing = 0;
  (void)publisher.publish(run.views(), 3);
  expect_one_patch_to(follower, dir.path(), 3, run);
}

}  // namespace
}  // namespace pulseloco::testing
