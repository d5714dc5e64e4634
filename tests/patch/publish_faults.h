// Helpers of the tests that fail a publisher's manifest write (publisher_test.cpp for a
// directory, bucket_test.cpp for a bucket): versions published under a fault hook, and a
// follower that must then take a single patch.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>

#include <pulseloco/patch/publisher.h>
#include <pulseloco/patch/receiver.h>
#include "patch/patch_run.h"

namespace pulseloco::testing {

// Publishes versions from..to of `run`, stepping it before every version but version 1;
// `publishing` names the version under way, for the fault hook.
inline void publish_versions(patch::Publisher& publisher, PatchRun& run, std::uint64_t& publishing,
                             std::uint64_t from, std::uint64_t to) {
  for (std::uint64_t v = from; v <= to; ++v) {
    if (v > 1) run.step();
    publishing = v;
    EXPECT_EQ(publisher.publish(run.views(), v).version, v);
  }
}

// Updates `follower` from `location`: it must take one step, a delta or a compact patch (no
// anchor), to `version`, and reach the run's state.
inline void expect_one_patch_to(patch::Receiver& follower, const std::filesystem::path& location,
                                std::uint64_t version, const PatchRun& run) {
  const patch::UpdateReport report = follower.update(location);
  ASSERT_EQ(report.steps.size(), 1u);
  EXPECT_EQ(report.steps[0].version, version);
  EXPECT_NE(report.steps[0].kind, patch::StepKind::anchor);
  EXPECT_EQ(follower.state().digest(), run.expected().digest());
}

}  // namespace pulseloco::testing
