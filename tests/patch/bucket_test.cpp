// Publishing to and receiving from a bucket of a real S3-compatible server (Swift with s3api,
// tests/io/s3_test_server.h): the bucket holds the directory's layout; a publisher killed
// between its files and its manifest is invisible; a server stopped during an upload fails that
// version only; a manifest PUT whose answer is lost publishes its version, and one whose outcome
// cannot be read back is settled by the next publish; refused credentials name the bucket and the
// endpoint; a tampered object is
// refused naming the version, the receiver's state unchanged. (receiver_test.cpp runs every
// receiver test on a bucket too.)
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/io/s3_client.h>
#include <pulseloco/patch/bucket.h>
#include <pulseloco/patch/publisher.h>
#include <pulseloco/patch/receiver.h>
#include "io/s3_test_server.h"
#include "io/test_files.h"
#include "patch/killed_publisher.h"
#include "patch/patch_run.h"
#include "patch/publish_faults.h"

namespace pulseloco::testing {
namespace {

using io::test::TempDir;

class Bucket : public testing::BucketPrefixTest {
 protected:
  void SetUp() override { attach_with_environment(S3TestServer::instance()); }
  void attach_with_environment(S3TestServer* server) {
    attach(server, "bucket");
    if (server_ != nullptr) server_->set_environment();
  }
};

std::set<std::string> file_names(const std::filesystem::path& directory) {
  std::set<std::string> names;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(directory))
    if (entry.is_regular_file())
      names.insert(entry.path().lexically_relative(directory).generic_string());
  return names;
}

TEST_F(Bucket, HoldsTheDirectorysLayoutAndEveryVersion) {
  const patch::PublisherOptions options{.anchor_every = 3, .chunk_elements = 4096};
  const std::vector<patch::Bf16State> expected = publish_run(url_, 6, 7, options);
  TempDir dir;
  (void)publish_run(dir.path(), 6, 7, options);
  EXPECT_EQ(object_names(), file_names(dir.path()));
  // Byte for byte the directory's files.
  for (const std::string& name : file_names(dir.path())) {
    EXPECT_EQ(client_->get_bytes(address_.bucket, address_.key(name), 1 << 24).value(),
              io::read_file(dir.path() / name, 1 << 24))
        << name;
  }
  patch::Receiver receiver;
  for (std::uint64_t v = 1; v <= 6; ++v) {
    (void)receiver.update(url_, v);
    EXPECT_EQ(receiver.state().digest(), expected[v - 1].digest()) << "version " << v;
  }
  // The anchors are larger than a part: they went up as multipart uploads.
  EXPECT_GT(
      client_->get_bytes(address_.bucket, address_.key("anchors/step_000001.safetensors"), 1 << 24)
          ->size(),
      S3TestServer::kPartBytes);
  // A publisher continues the bucket's run from its newest version.
  EXPECT_THROW(patch::Publisher(url_, {}), InvalidArgument);
  patch::Publisher continued(url_, {.anchor_every = 3, .continue_existing = true});
  EXPECT_EQ(continued.manifest().versions.back().version, 6u);
  EXPECT_EQ(continued.snapshot().digest(), expected.back().digest());
}

TEST_F(Bucket, PublisherKilledBetweenFilesAndManifestIsInvisible) {
  TempDir staging;  // the killed publisher's temporary directory goes here, and is removed
  publish_and_kill_before_manifest(url_, [&] { ::setenv("TMPDIR", staging.path().c_str(), 1); });
  if (HasFatalFailure()) return;

  // Version 4's objects are in the bucket (an anchor is due at 4 too) but not listed.
  const std::set<std::string> names = object_names();
  EXPECT_EQ(names.count("deltas/step_000004.safetensors"), 1u);
  EXPECT_EQ(names.count("anchors/step_000004.safetensors"), 1u);
  patch::Receiver receiver;
  EXPECT_EQ(receiver.update(url_).to, 3u);
  PatchRun run(7);
  run.step();
  run.step();
  EXPECT_EQ(receiver.state().digest(), run.expected().digest());
}

// A server of the test's own, which it stops and starts.
class OwnBucket : public Bucket {
 protected:
  void SetUp() override { attach_with_environment(S3TestServer::own()); }
};

TEST_F(OwnBucket, ServerStoppedDuringAnUploadFailsThatVersionOnly) {
  PatchRun run(7);
  std::uint64_t publishing = 0;
  bool stopped = false;
  patch::Publisher publisher(url_, {.anchor_every = 10, .fault_hook = [&](std::string_view point) {
                                      // After the first of version 3's files is uploaded.
                                      if (publishing == 3 && point == "file uploaded" && !stopped) {
                                        server_->stop();
                                        stopped = true;
                                      }
                                    }});
  for (std::uint64_t v = 1; v <= 2; ++v) {
    if (v > 1) run.step();
    publishing = v;
    (void)publisher.publish(run.views(), v);
  }
  run.step();
  publishing = 3;
  const std::string what =
      expect_error(ErrorKind::io, [&] { (void)publisher.publish(run.views(), 3); });
  EXPECT_NE(what.find(server_->endpoint()), std::string::npos) << what;
  ASSERT_TRUE(stopped);
  server_->start();
  EXPECT_EQ(publisher.manifest().versions.back().version, 2u);

  run.step();
  publishing = 4;
  (void)publisher.publish(run.views(), 4);
  const patch::Manifest manifest = *patch::read_bucket_manifest(*client_, address_);
  std::vector<std::uint64_t> versions;
  for (const patch::ManifestVersion& entry : manifest.versions)
    versions.push_back(entry.version);
  EXPECT_EQ(versions, (std::vector<std::uint64_t>{1, 2, 4}));
  // Every published version is intact: a fresh receiver reaches each one.
  for (const std::uint64_t v : versions) {
    patch::Receiver receiver;
    (void)receiver.update(url_, v);
  }
  patch::Receiver receiver;
  (void)receiver.update(url_);
  EXPECT_EQ(receiver.state().digest(), run.expected().digest());
}

// The manifest's PUT lands but its answer is lost: the publisher reads the manifest back, finds
// the version there, and the sequence goes on from it.
TEST_F(Bucket, AManifestPutWhoseAnswerIsLostPublishesTheVersion) {
  PatchRun run(7);
  std::uint64_t publishing = 0;
  patch::Publisher publisher(url_, {.anchor_every = 10, .fault_hook = [&](std::string_view point) {
                                      if (publishing == 2 && point == "manifest written")
                                        throw IoError("the answer to the manifest's PUT was lost");
                                    }});
  patch::Receiver follower;
  publish_versions(publisher, run, publishing, 1, 1);
  (void)follower.update(url_);
  publish_versions(publisher, run, publishing, 2, 2);
  expect_one_patch_to(follower, url_, 2, run);
  publish_versions(publisher, run, publishing, 3, 3);  // its patch starts at version 2
  expect_one_patch_to(follower, url_, 3, run);
}

// The server stops right after storing the manifest: the PUT's outcome cannot be read back, so
// publish fails; once the server is back, the next publish finds the version there and goes on
// after it.
TEST_F(OwnBucket, AManifestPutOfUnknownOutcomeIsSettledByTheNextPublish) {
  PatchRun run(7);
  std::uint64_t publishing = 0;
  patch::Publisher publisher(url_, {.anchor_every = 10, .fault_hook = [&](std::string_view point) {
                                      if (publishing == 2 && point == "manifest written") {
                                        server_->stop();
                                        throw IoError("the answer to the manifest's PUT was lost");
                                      }
                                    }});
  patch::Receiver follower;
  publish_versions(publisher, run, publishing, 1, 1);
  (void)follower.update(url_);
  run.step();
  publishing = 2;
  EXPECT_THROW((void)publisher.publish(run.views(), 2), IoError);
  server_->start();
  publishing = 0;
  EXPECT_THROW((void)publisher.publish(run.views(), 2), InvalidArgument);
  EXPECT_EQ(publisher.manifest().versions.back().version, 2u);
  expect_one_patch_to(follower, url_, 2, run);
  publish_versions(publisher, run, publishing, 3, 3);
  expect_one_patch_to(follower, url_, 3, run);
}

TEST_F(Bucket, RefusedCredentialsNameTheBucketAndTheEndpoint) {
  (void)publish_run(url_, 2, 7, {.chunk_elements = 4096});
  ::setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret", 1);
  patch::Receiver receiver;
  for (const auto& action : std::vector<std::function<void()>>{
           [&] { (void)receiver.update(url_); },
           [&] { (void)patch::Publisher(S3TestServer::fresh_address("denied"), {}); }}) {
    const std::string what = expect_error(ErrorKind::invalid_argument, action);
    EXPECT_NE(what.find(S3TestServer::kBucket), std::string::npos) << what;
    EXPECT_NE(what.find(server_->endpoint()), std::string::npos) << what;
  }
  EXPECT_FALSE(receiver.version());
  server_->set_environment();
}

TEST_F(Bucket, TamperedObjectIsRefusedNamingTheVersion) {
  const std::vector<patch::Bf16State> expected =
      publish_run(url_, 4, 7, {.anchor_every = 10, .compact = false, .chunk_elements = 4096});
  patch::Receiver receiver;
  (void)receiver.update(url_, 2);
  const std::string key = address_.key("deltas/step_000003.safetensors");
  std::vector<std::byte> bytes = client_->get_bytes(address_.bucket, key, 1 << 24).value();
  bytes[bytes.size() - 2] ^= std::byte{0x01};
  client_->put_object(address_.bucket, key, bytes);
  const std::string what = expect_error(ErrorKind::protocol, [&] { (void)receiver.update(url_); });
  EXPECT_NE(what.find("version 3"), std::string::npos) << what;
  EXPECT_EQ(receiver.version(), 2u);
  EXPECT_EQ(receiver.state().digest(), expected[1].digest());
}

}  // namespace
}  // namespace pulseloco::testing
