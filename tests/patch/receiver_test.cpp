// patch::Receiver over a published run (tests/patch/patch_run.h): every version from every
// starting version byte-identically, by the shortest path; and every way a file can be wrong
// (missing, reordered, truncated, bit-flipped, foreign, wrong parent, an index out of range or
// unsorted, a NaN value, a digest that does not match) is an error naming the version that
// leaves the receiver's state and version exactly as they were. Each test that reads a
// directory runs again on a bucket (tests/io/s3_test_server.h): the directory, as the test
// changed it, is mirrored to the bucket (the changed files, then the manifest, and the removed
// ones deleted) before each update, which then reads the bucket.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/io/s3_client.h>
#include <pulseloco/patch/compact_files.h>
#include <pulseloco/patch/receiver.h>
#include <pulseloco/patch/trl_files.h>
#include "io/s3_test_server.h"
#include "io/test_files.h"
#include "patch/patch_run.h"

namespace pulseloco::testing {
namespace {

using io::test::read_file_bytes;
using io::test::TempDir;
using io::test::write_file_bytes;

constexpr std::uint64_t kVersions = 8;

void expect_state(const patch::Bf16State& state, const patch::Bf16State& expected,
                  const std::string& where) {
  ASSERT_EQ(state.tensors().size(), expected.tensors().size()) << where;
  for (std::size_t t = 0; t < state.tensors().size(); ++t) {
    EXPECT_EQ(state.tensors()[t].name, expected.tensors()[t].name) << where;
    EXPECT_EQ(state.tensors()[t].shape, expected.tensors()[t].shape) << where;
    EXPECT_TRUE(state.tensors()[t].bits == expected.tensors()[t].bits)
        << where << ": " << state.tensors()[t].name << " differs";
  }
}

// A published run and receivers at its versions. The receiver reads the compact patches
// when they are published (PublishedRun's parameter) and the TRL deltas otherwise.
class PublishedRunBase : public ::testing::Test {
 protected:
  void publish(bool compact, bool bucket = false) {
    compact_ = compact;
    if (bucket) {
      S3TestServer* server = S3TestServer::instance();
      if (server == nullptr) GTEST_SKIP() << S3TestServer::skip_reason();
      server->set_environment();
      client_ = std::make_unique<io::S3Client>(server->settings());
      bucket_ = io::parse_s3_address(S3TestServer::fresh_address("receiver"));
    }
    expected_ =
        publish_run(dir_.path(), kVersions, 7,
                    {.anchor_every = 4, .compact = compact, .chunk_elements = 4096, .threads = 2});
  }

  [[nodiscard]] const patch::Bf16State& expected(std::uint64_t version) const {
    return expected_.at(version - 1);
  }
  // The file a receiver reads for a version's delta.
  [[nodiscard]] std::filesystem::path delta(std::uint64_t version) const {
    return dir_.path() /
           (compact_ ? patch::compact_file_name(version) : patch::delta_file_name(version));
  }
  [[nodiscard]] patch::Delta read_delta(const std::filesystem::path& path,
                                        const patch::Bf16State& held) const {
    return compact_ ? patch::read_compact_file(path, held) : patch::read_delta_file(path, held);
  }
  [[nodiscard]] patch::Receiver receiver_at(std::uint64_t version) {
    patch::Receiver receiver;
    (void)receiver.update(source(), version);
    return receiver;
  }

  // What a receiver reads: the directory, or the bucket after the directory is mirrored there.
  [[nodiscard]] std::filesystem::path source() {
    if (!bucket_) return dir_.path();
    std::map<std::string, Digest> files;
    for (const auto& entry : std::filesystem::recursive_directory_iterator(dir_.path())) {
      if (!entry.is_regular_file()) continue;
      const std::string relative = entry.path().lexically_relative(dir_.path()).generic_string();
      files[relative] = io::file_checksum(entry.path()).digest;
    }
    const std::string manifest(patch::kManifestName);
    const auto upload = [&](const std::string& relative) {
      const auto sent = mirrored_.find(relative);
      if (sent != mirrored_.end() && sent->second == files.at(relative)) return;
      (void)client_->put_file(bucket_->bucket, bucket_->key(relative), dir_.path() / relative);
      mirrored_[relative] = files.at(relative);
    };
    for (const auto& [relative, digest] : files)
      if (relative != manifest) upload(relative);
    if (files.count(manifest) != 0) upload(manifest);
    for (auto it = mirrored_.begin(); it != mirrored_.end();) {
      if (files.count(it->first) != 0) {
        ++it;
        continue;
      }
      client_->delete_object(bucket_->bucket, bucket_->key(it->first));
      it = mirrored_.erase(it);
    }
    return bucket_->url();
  }

  // `action` throws an Error of `kind` whose message names `version`; the receiver (at
  // `held`) still holds exactly that version's state.
  template <typename Action>
  void expect_refused(patch::Receiver& receiver, std::uint64_t held, ErrorKind kind,
                      std::uint64_t version, Action action) {
    try {
      action();
      ADD_FAILURE() << "no error";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), kind) << error.what();
      // Named by its number, or by its file when the file cannot be read at all.
      const std::string what = error.what();
      EXPECT_TRUE(what.find("version " + std::to_string(version)) != std::string::npos ||
                  what.find(fmt::format("step_{:06d}", version)) != std::string::npos)
          << what;
    }
    ASSERT_EQ(receiver.version(), held);
    expect_state(receiver.state(), expected(held), "after the refusal");
  }

  TempDir dir_;
  bool compact_ = false;
  std::vector<patch::Bf16State> expected_;
  std::unique_ptr<io::S3Client> client_;
  std::optional<io::S3Address> bucket_;
  std::map<std::string, Digest> mirrored_;  // what the bucket holds: path -> checksum
};

struct Source {
  bool compact = false;
  bool bucket = false;
};

class PublishedRun : public PublishedRunBase, public ::testing::WithParamInterface<Source> {
 protected:
  void SetUp() override { publish(GetParam().compact, GetParam().bucket); }
};

TEST_P(PublishedRun, EveryVersionFromEveryStartingVersion) {
  for (std::uint64_t from = 0; from <= kVersions; ++from) {
    for (std::uint64_t to = 1; to <= kVersions; ++to) {
      patch::Receiver receiver;
      if (from > 0) {
        const patch::UpdateReport first = receiver.update(source(), from);
        ASSERT_EQ(first.steps.front().kind,
                  patch::StepKind::anchor);  // a fresh receiver starts from an anchor
      }
      const patch::UpdateReport report = receiver.update(source(), to);
      const std::string where = "from " + std::to_string(from) + " to " + std::to_string(to);
      ASSERT_EQ(receiver.version(), to) << where;
      expect_state(receiver.state(), expected(to), where);
      EXPECT_EQ(receiver.state().digest(), expected(to).digest()) << where;
      if (from > 0 && from <= to && to - from <= 1) {
        // One delta at most: never an anchor (an anchor is larger than a delta here).
        for (const patch::UpdateStep& step : report.steps) {
          EXPECT_EQ(step.kind,
                    GetParam().compact ? patch::StepKind::compact : patch::StepKind::delta)
              << where;
        }
      }
    }
  }
  // With no target the receiver goes to the newest version.
  patch::Receiver receiver = receiver_at(2);
  EXPECT_EQ(receiver.update(source()).to, kVersions);
  expect_state(receiver.state(), expected(kVersions), "newest");
}

TEST_P(PublishedRun, ShortestPathPrefersAnAnchorOverALongerChain) {
  const patch::Manifest manifest = patch::read_manifest(dir_.path());
  // Anchors every 4 versions: 1, 5 (and maybe more when the chain grew larger than one).
  ASSERT_TRUE(manifest.find(1)->anchor);
  ASSERT_TRUE(manifest.find(5)->anchor);
  const std::vector<patch::UpdateStep> fresh = patch::plan_update(manifest, std::nullopt, 7);
  ASSERT_FALSE(fresh.empty());
  EXPECT_EQ(fresh.front().kind, patch::StepKind::anchor);
  EXPECT_GE(fresh.front().version, 5u);
  const std::vector<patch::UpdateStep> near = patch::plan_update(manifest, 6, 7);
  ASSERT_EQ(near.size(), 1u);
  EXPECT_NE(near.front().kind, patch::StepKind::anchor);
  EXPECT_EQ(near.front().version, 7u);
}

TEST_P(PublishedRun, MissingVersionIsRefused) {
  patch::Receiver receiver = receiver_at(2);
  std::filesystem::remove(delta(4));
  expect_refused(receiver, 2, ErrorKind::io, 4, [&] { (void)receiver.update(source(), 4); });
}

TEST_P(PublishedRun, ReorderedDeltasAreRefused) {
  patch::Receiver receiver = receiver_at(2);
  const std::string third = read_file_bytes(delta(3));
  write_file_bytes(delta(3), read_file_bytes(delta(4)));
  write_file_bytes(delta(4), third);
  expect_refused(receiver, 2, ErrorKind::protocol, 3, [&] { (void)receiver.update(source(), 4); });
}

TEST_P(PublishedRun, TruncatedFileIsRefused) {
  patch::Receiver receiver = receiver_at(2);
  std::string bytes = read_file_bytes(delta(3));
  bytes.resize(bytes.size() - 9);
  write_file_bytes(delta(3), bytes);
  expect_refused(receiver, 2, ErrorKind::protocol, 3, [&] { (void)receiver.update(source(), 4); });
  // Fed the file directly (no manifest to compare with), the file itself is invalid.
  try {
    receiver.apply_file(delta(3));
    ADD_FAILURE() << "a truncated file was applied";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::protocol) << error.what();
  }
  expect_state(receiver.state(), expected(2), "after a truncated file");
}

TEST_P(PublishedRun, BitFlippedFileIsRefused) {
  patch::Receiver receiver = receiver_at(2);
  std::string bytes = read_file_bytes(delta(3));
  bytes[bytes.size() - 2] = static_cast<char>(bytes[bytes.size() - 2] ^ 0x01);  // a value bit
  write_file_bytes(delta(3), bytes);
  expect_refused(receiver, 2, ErrorKind::protocol, 3, [&] { (void)receiver.update(source(), 4); });
  // Without the manifest, the state's digest after applying it is not the one the file names:
  // the elements it changed are put back.
  expect_refused(receiver, 2, ErrorKind::protocol, 3, [&] { receiver.apply_file(delta(3)); });
}

TEST_P(PublishedRun, BitFlippedAnchorIsRefused) {
  patch::Receiver receiver;
  const std::filesystem::path anchor = dir_.path() / patch::anchor_file_name(5);
  std::string bytes = read_file_bytes(anchor);
  bytes[bytes.size() / 2] = static_cast<char>(bytes[bytes.size() / 2] ^ 0x10);
  write_file_bytes(anchor, bytes);
  try {
    (void)receiver.update(source(), 6);
    ADD_FAILURE() << "a corrupted anchor was loaded";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::protocol) << error.what();
    EXPECT_NE(std::string(error.what()).find("version 5"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(receiver.version());
  EXPECT_TRUE(receiver.state().empty());
}

TEST_P(PublishedRun, WrongParentIsRefused) {
  patch::Receiver receiver = receiver_at(2);
  expect_refused(receiver, 2, ErrorKind::protocol, 4, [&] { receiver.apply_file(delta(4)); });
  receiver.apply_file(delta(3));
  expect_state(receiver.state(), expected(3), "after the right parent");
}

TEST_P(PublishedRun, ForeignPatchIsRefused) {
  TempDir other;
  (void)publish_run(other.path(), 3, 8,
                    {.anchor_every = 4, .compact = compact_, .chunk_elements = 4096});
  patch::Receiver receiver = receiver_at(2);
  // Same version numbers and tensors, another run: its parent digest is not the held state's.
  expect_refused(receiver, 2, ErrorKind::protocol, 3, [&] {
    receiver.apply_file(other.path() / delta(3).lexically_relative(dir_.path()));
  });
  // A receiver holding the other run's version 2 is refused by this directory.
  patch::Receiver stranger;
  (void)stranger.update(other.path(), 2);
  const patch::Bf16State before = stranger.state();
  try {
    (void)stranger.update(source());
    ADD_FAILURE() << "a foreign state was updated";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::protocol) << error.what();
  }
  EXPECT_TRUE(stranger.state().tensors()[0].bits == before.tensors()[0].bits);
}

// Writes a delta for version 3 over the receiver's version 2 with one tensor's entries replaced.
class CraftedDelta : public PublishedRunBase {
 protected:
  void SetUp() override { publish(false); }

  std::filesystem::path write_crafted(patch::IndexEncoding encoding,
                                      std::vector<std::uint32_t> indices,
                                      std::vector<std::uint16_t> values) {
    patch::Delta crafted =
        patch::read_delta_file(dir_.path() / patch::delta_file_name(3), expected(2));
    crafted.encoding = encoding;
    crafted.tensors.front().indices = std::move(indices);
    crafted.tensors.front().values = std::move(values);
    const std::filesystem::path path = dir_.path() / "crafted.safetensors";
    (void)patch::write_delta_file(path, crafted);
    return path;
  }

  void expect_bad_file(patch::Receiver& receiver, const std::filesystem::path& path,
                       std::uint64_t index) {
    try {
      receiver.apply_file(path);
      ADD_FAILURE() << "a bad delta was applied";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::protocol) << error.what();
      EXPECT_EQ(error.context().index.value_or(index), index) << error.what();
      EXPECT_FALSE(error.context().tensor.empty()) << error.what();
    }
    ASSERT_EQ(receiver.version(), 2u);
    expect_state(receiver.state(), expected(2), "after a bad delta");
  }
};

TEST_F(CraftedDelta, IndexOutOfRange) {
  patch::Receiver receiver = receiver_at(2);
  const std::uint64_t numel = expected(2).tensors().front().bits.size();
  const auto n = static_cast<std::uint32_t>(numel);
  for (const auto encoding : {patch::IndexEncoding::raw, patch::IndexEncoding::gap_delta}) {
    expect_bad_file(receiver, write_crafted(encoding, {1, n}, {0x3F80, 0x3F80}), n);
  }
}

TEST_F(CraftedDelta, UnsortedOrRepeatedIndex) {
  patch::Receiver receiver = receiver_at(2);
  expect_bad_file(receiver, write_crafted(patch::IndexEncoding::raw, {9, 4}, {0x3F80, 0x3F80}), 4);
  expect_bad_file(receiver, write_crafted(patch::IndexEncoding::raw, {4, 4}, {0x3F80, 0x3F80}), 4);
}

TEST_F(CraftedDelta, NanValue) {
  patch::Receiver receiver = receiver_at(2);
  for (const std::uint16_t nan : {std::uint16_t{0x7FC0}, std::uint16_t{0xFF81}}) {
    expect_bad_file(receiver, write_crafted(patch::IndexEncoding::gap_delta, {3, 8}, {0x3F80, nan}),
                    8);
  }
}

TEST_F(CraftedDelta, NanValueInACompactPatch) {
  patch::Receiver receiver = receiver_at(2);
  patch::Delta crafted =
      patch::read_delta_file(dir_.path() / patch::delta_file_name(3), expected(2));
  for (patch::TensorDelta& tensor : crafted.tensors) {
    for (const std::uint32_t index : tensor.indices)
      tensor.previous.push_back(expected(2).find(tensor.name)->bits[index]);
  }
  crafted.tensors.front().values[1] = 0x7FC1;
  const std::filesystem::path path = dir_.path() / "crafted.plsp";
  (void)patch::write_compact_file(path, crafted);
  expect_bad_file(receiver, path, crafted.tensors.front().indices[1]);
}

TEST_P(PublishedRun, FailureAfterSeveralDeltasRestoresTheStartingState) {
  // Version 4's delta (listed with its true checksum) names a digest its result does not have:
  // versions 2 and 3 were applied first and are undone.
  patch::Delta bad = read_delta(delta(4), expected(3));
  for (patch::TensorDelta& tensor : bad.tensors) {
    for (const std::uint32_t index : tensor.indices)
      tensor.previous.push_back(expected(3).find(tensor.name)->bits[index]);
  }
  bad.tensors.front().values.front() ^= 0x0001;
  const io::FileChecksum file =
      compact_ ? patch::write_compact_file(delta(4), bad) : patch::write_delta_file(delta(4), bad);
  patch::Manifest manifest = patch::read_manifest(dir_.path());
  for (patch::ManifestVersion& entry : manifest.versions) {
    if (entry.version != 4) continue;
    patch::ManifestFile& listed = compact_ ? *entry.compact : *entry.delta;
    listed.bytes = file.size;
    listed.checksum = file.digest;
  }
  patch::write_manifest(dir_.path(), manifest);
  patch::Receiver receiver = receiver_at(1);
  expect_refused(receiver, 1, ErrorKind::protocol, 4, [&] { (void)receiver.update(source(), 4); });
}

TEST_P(PublishedRun, CorruptedManifestIsRefused) {
  const std::filesystem::path path = dir_.path() / patch::kManifestName;
  std::string text = read_file_bytes(path);
  const auto at = text.find("\"changed\": ");
  ASSERT_NE(at, std::string::npos);
  text[at + 11] = text[at + 11] == '9' ? '8' : '9';
  write_file_bytes(path, text);
  patch::Receiver receiver;
  try {
    (void)receiver.update(source());
    ADD_FAILURE() << "a corrupted manifest was read";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::protocol) << error.what();
  }
  EXPECT_FALSE(receiver.version());
}

INSTANTIATE_TEST_SUITE_P(DeltaFiles, PublishedRun,
                         ::testing::Values(Source{false, false}, Source{true, false},
                                           Source{false, true}, Source{true, true}),
                         [](const auto& param_info) {
                           return std::string(param_info.param.compact ? "compact" : "trl") +
                                  (param_info.param.bucket ? "_bucket" : "");
                         });

}  // namespace
}  // namespace pulseloco::testing
