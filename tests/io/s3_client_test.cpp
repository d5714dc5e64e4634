// io::S3Client against a real S3-compatible server (Swift with s3api, tests/io/s3_test_server.h):
// objects round-trip (one request and multipart), listings page, refused credentials and a
// missing bucket are errors naming the bucket and the endpoint, and a multipart upload cut off
// by the server stopping fails, leaves no object, and succeeds once the server is back.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/io/s3_client.h>
#include <pulseloco/io/s3_settings.h>
#include "io/s3_test_server.h"
#include "io/test_files.h"

namespace pulseloco::testing {
namespace {

std::string pattern(std::size_t size, unsigned seed) {
  std::string bytes(size, '\0');
  for (std::size_t i = 0; i < size; ++i)
    bytes[i] = static_cast<char>((i * 131 + seed * 7 + (i >> 9)) & 0xff);
  return bytes;
}

std::string as_string(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

TEST(S3Address, ParsesBucketAndPrefix) {
  const io::S3Address address = io::parse_s3_address("s3://my-bucket/runs/a/");
  EXPECT_EQ(address.bucket, "my-bucket");
  EXPECT_EQ(address.prefix, "runs/a");
  EXPECT_EQ(address.key("manifest.json"), "runs/a/manifest.json");
  EXPECT_EQ(io::parse_s3_address("s3://bucket").key("x"), "x");
  for (const char* bad :
       {"s3://", "s3://B/x", "s3://ab", "s3://bucket/a//b", "s3://bucket/../x", "/tmp/x"}) {
    EXPECT_THROW((void)io::parse_s3_address(bad), InvalidArgument) << bad;
  }
}

// Sets variables for the scope of a test and puts back what was there.
class ScopedEnvironment {
 public:
  ScopedEnvironment(std::initializer_list<std::pair<const char*, const char*>> values) {
    for (const auto& [name, value] : values) {
      const char* before = std::getenv(name);
      saved_.emplace_back(name, before == nullptr ? std::optional<std::string>()
                                                  : std::optional<std::string>(before));
      if (value == nullptr) {
        ::unsetenv(name);
      } else {
        ::setenv(name, value, 1);
      }
    }
  }
  ~ScopedEnvironment() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(S3Settings, VariablesProfilesAndEndpoints) {
  io::test::TempDir home;
  std::filesystem::create_directories(home.path() / ".aws");
  io::test::write_file_bytes(home.path() / ".aws" / "credentials",
                             "[default]\naws_access_key_id = DEFAULTKEY\n"
                             "aws_secret_access_key = defaultsecret\n"
                             "[team]\naws_access_key_id = TEAMKEY\n"
                             "aws_secret_access_key = teamsecret\naws_session_token = tok\n");
  io::test::write_file_bytes(home.path() / ".aws" / "config",
                             "[profile team]\nregion = eu-west-3\n"
                             "endpoint_url = https://r2.example.com\n");
  const std::string home_path = home.path().string();
  const std::initializer_list<std::pair<const char*, const char*>> clean = {
      {"HOME", home_path.c_str()},
      {"AWS_ACCESS_KEY_ID", nullptr},
      {"AWS_SECRET_ACCESS_KEY", nullptr},
      {"AWS_SESSION_TOKEN", nullptr},
      {"AWS_PROFILE", nullptr},
      {"AWS_REGION", nullptr},
      {"AWS_DEFAULT_REGION", nullptr},
      {"AWS_ENDPOINT_URL", nullptr},
      {"AWS_ENDPOINT_URL_S3", nullptr},
      {"PULSELOCO_S3_ENDPOINT", nullptr},
      {"PULSELOCO_S3_PATH_STYLE", nullptr},
      {"AWS_SHARED_CREDENTIALS_FILE", nullptr},
      {"AWS_CONFIG_FILE", nullptr},
      {"PULSELOCO_S3_MAX_ATTEMPTS", nullptr},
      {"PULSELOCO_S3_PART_BYTES", nullptr},
      {"PULSELOCO_S3_VERBOSE", nullptr}};
  {
    ScopedEnvironment environment(clean);
    const io::S3Settings settings = io::S3Settings::from_environment();
    EXPECT_EQ(settings.access_key, "DEFAULTKEY");
    EXPECT_EQ(settings.region, "us-east-1");
    EXPECT_EQ(settings.endpoint_url(), "https://s3.us-east-1.amazonaws.com");
    EXPECT_FALSE(settings.path_style);
  }
  {
    ScopedEnvironment environment(clean);
    ScopedEnvironment profile({{"AWS_PROFILE", "team"}});
    const io::S3Settings settings = io::S3Settings::from_environment();
    EXPECT_EQ(settings.access_key, "TEAMKEY");
    EXPECT_EQ(settings.session_token, "tok");
    EXPECT_EQ(settings.region, "eu-west-3");
    EXPECT_EQ(settings.endpoint, "https://r2.example.com");
    EXPECT_TRUE(settings.path_style);
  }
  {
    // Variables win over the profile; an endpoint without a scheme is HTTPS.
    ScopedEnvironment environment(clean);
    ScopedEnvironment variables({{"AWS_ACCESS_KEY_ID", "VARKEY"},
                                 {"AWS_SECRET_ACCESS_KEY", "varsecret"},
                                 {"AWS_DEFAULT_REGION", "ap-south-1"},
                                 {"AWS_ENDPOINT_URL", "minio.local:9000"},
                                 {"PULSELOCO_S3_PATH_STYLE", "0"}});
    const io::S3Settings settings = io::S3Settings::from_environment();
    EXPECT_EQ(settings.access_key, "VARKEY");
    EXPECT_EQ(settings.secret_key, "varsecret");
    EXPECT_EQ(settings.region, "ap-south-1");
    EXPECT_EQ(settings.endpoint, "https://minio.local:9000");
    EXPECT_FALSE(settings.path_style);
  }
  for (const auto& [name, value] : std::vector<std::pair<const char*, const char*>>{
           {"PULSELOCO_S3_ENDPOINT", "ftp://host"},
           {"PULSELOCO_S3_ENDPOINT", "https://host/path"},
           {"PULSELOCO_S3_PATH_STYLE", "yes"},
           {"PULSELOCO_S3_MAX_ATTEMPTS", "0"},
           {"PULSELOCO_S3_MAX_ATTEMPTS", "101"},
           {"PULSELOCO_S3_VERBOSE", "yes"},
           {"AWS_PROFILE", "tema"},
           {"AWS_ACCESS_KEY_ID", "only-the-id"}}) {
    ScopedEnvironment environment(clean);
    ScopedEnvironment bad({{name, value}});
    const std::string what =
        expect_error(ErrorKind::invalid_argument, [] { (void)io::S3Settings::from_environment(); });
    EXPECT_NE(what.find(name), std::string::npos) << what;
  }
}

// An error's message names each of `parts`.
void expect_names(const std::string& what, std::initializer_list<std::string> parts) {
  for (const std::string& part : parts)
    EXPECT_NE(what.find(part), std::string::npos) << "'" << part << "' not in: " << what;
}

TEST(S3Client, ObjectsRoundTripInOnePartAndInSeveral) {
  PULSELOCO_S3_SERVER_OR_SKIP(server);
  io::S3Client client(server->settings());
  const io::S3Address address = io::parse_s3_address(S3TestServer::fresh_address("client"));
  const std::string small = pattern(1000, 1);
  client.put_object(address.bucket, address.key("small"),
                    std::as_bytes(std::span(small.data(), small.size())));
  EXPECT_EQ(as_string(*client.get_bytes(address.bucket, address.key("small"), 1 << 20)), small);

  io::test::TempDir dir;
  const std::string large = pattern(S3TestServer::kPartBytes * 3 + 12345, 2);  // four parts
  io::test::write_file_bytes(dir.path() / "large", large);
  int parts = 0;
  client.part_hook = [&](int) { ++parts; };
  const io::FileChecksum sent =
      client.put_file(address.bucket, address.key("dir/large"), dir.path() / "large");
  EXPECT_EQ(parts, 4);
  EXPECT_EQ(sent.size, large.size());
  EXPECT_EQ(sent.digest, io::file_checksum(dir.path() / "large").digest);
  EXPECT_EQ(as_string(*client.get_bytes(address.bucket, address.key("dir/large"), 1 << 24)), large);
  // An object above the reader's bound is refused, not received.
  expect_error(ErrorKind::io,
               [&] { (void)client.get_bytes(address.bucket, address.key("dir/large"), 1000); });

  EXPECT_FALSE(client.get_bytes(address.bucket, address.key("absent"), 1 << 20));
  std::vector<std::string> keys = client.list_keys(address.bucket, address.prefix + "/");
  EXPECT_EQ(keys, (std::vector<std::string>{address.key("dir/large"), address.key("small")}));
  client.delete_object(address.bucket, address.key("small"));
  client.delete_object(address.bucket, address.key("small"));  // absent: no error
  EXPECT_FALSE(client.get_bytes(address.bucket, address.key("small"), 1 << 20));
}

// Refused credentials: the error names the bucket, the endpoint and the access key id, never the
// secret.
TEST(S3Client, RefusedCredentialsNameTheBucketAndTheEndpoint) {
  PULSELOCO_S3_SERVER_OR_SKIP(server);
  io::S3Settings settings = server->settings();
  settings.secret_key = "not-the-secret";
  io::S3Client client(settings);
  const std::string what = expect_error(ErrorKind::invalid_argument, [&] {
    (void)client.get_bytes(S3TestServer::kBucket, "x/manifest.json", 1 << 20);
  });
  expect_names(what,
               {"credentials", S3TestServer::kBucket, server->endpoint(), settings.access_key});
  EXPECT_EQ(what.find(settings.secret_key), std::string::npos) << what;

  settings = server->settings();
  settings.access_key = "nobody:none";
  io::S3Client stranger(settings);
  expect_error(ErrorKind::invalid_argument, [&] {
    (void)stranger.get_bytes(S3TestServer::kBucket, "x/manifest.json", 1 << 20);
  });
}

TEST(S3Client, DeniedAccessNamesTheBucketAndTheEndpoint) {
  PULSELOCO_S3_SERVER_OR_SKIP(server);
  io::S3Settings settings = server->settings();
  settings.access_key = server->reader_access_key();
  settings.secret_key = server->reader_secret_key();
  io::S3Client reader(settings);
  const std::string what = expect_error(ErrorKind::invalid_argument, [&] {
    (void)reader.get_bytes(S3TestServer::kBucket, "x/manifest.json", 1 << 20);
  });
  expect_names(what, {"access denied", S3TestServer::kBucket, server->endpoint()});
}

TEST(S3Client, MissingBucketNamesTheBucketAndTheEndpoint) {
  PULSELOCO_S3_SERVER_OR_SKIP(server);
  io::S3Client client(server->settings());
  const std::string what = expect_error(ErrorKind::invalid_argument, [&] {
    const std::string bytes = "x";
    client.put_object("pulseloco-no-such-bucket", "k",
                      std::as_bytes(std::span(bytes.data(), bytes.size())));
  });
  expect_names(what, {"pulseloco-no-such-bucket", server->endpoint(), "does not exist"});
  // Another account's user does not see this account's bucket.
  io::S3Settings settings = server->settings();
  settings.access_key = server->other_access_key();
  settings.secret_key = server->other_secret_key();
  io::S3Client other(settings);
  expect_error(ErrorKind::invalid_argument,
               [&] { (void)other.get_bytes(S3TestServer::kBucket, "x/manifest.json", 1 << 20); });
}

TEST(S3Client, ServerStoppedDuringAMultipartUpload) {
  S3TestServer* server = S3TestServer::own();  // stopped and started: not a shared one
  if (server == nullptr) GTEST_SKIP() << S3TestServer::skip_reason();
  io::S3Client client(server->settings());
  const io::S3Address address = io::parse_s3_address(S3TestServer::fresh_address("stopped"));
  io::test::TempDir dir;
  const std::string large = pattern(S3TestServer::kPartBytes * 2 + 10, 3);
  io::test::write_file_bytes(dir.path() / "large", large);
  client.part_hook = [&](int part) {
    if (part == 1) server->stop();
  };
  const std::string what = expect_error(ErrorKind::io, [&] {
    (void)client.put_file(address.bucket, address.key("large"), dir.path() / "large");
  });
  EXPECT_NE(what.find(server->endpoint()), std::string::npos) << what;
  EXPECT_NE(what.find("attempts"), std::string::npos) << what;
  server->start();
  client.part_hook = nullptr;
  EXPECT_FALSE(client.get_bytes(address.bucket, address.key("large"), 1 << 24));
  (void)client.put_file(address.bucket, address.key("large"), dir.path() / "large");
  EXPECT_EQ(as_string(*client.get_bytes(address.bucket, address.key("large"), 1 << 24)), large);
}

TEST(S3Client, ServerErrorsAreRetriedThenReported) {
  S3TestServer* server = S3TestServer::own();  // stopped and started: not a shared one
  if (server == nullptr) GTEST_SKIP() << S3TestServer::skip_reason();
  io::S3Client client(server->settings());
  const io::S3Address address = io::parse_s3_address(S3TestServer::fresh_address("5xx"));
  const std::string bytes = pattern(100, 4);
  const auto put = [&] {
    client.put_object(address.bucket, address.key("x"),
                      std::as_bytes(std::span(bytes.data(), bytes.size())));
  };
  server->stop("object");  // the proxy answers, but cannot store objects: a 5xx
  const std::string what = expect_error(ErrorKind::io, put);
  EXPECT_NE(what.find("HTTP 5"), std::string::npos) << what;
  EXPECT_NE(what.find("after 2 attempts"), std::string::npos) << what;
  EXPECT_NE(what.find(server->endpoint()), std::string::npos) << what;
  server->start("object");
  put();
  EXPECT_EQ(as_string(*client.get_bytes(address.bucket, address.key("x"), 1 << 20)), bytes);
}

TEST(S3Client, RetriesEndAtTheCallersDeadline) {
  S3TestServer* server = S3TestServer::own();  // stopped and started: not a shared one
  if (server == nullptr) GTEST_SKIP() << S3TestServer::skip_reason();
  io::S3Settings settings = server->settings();
  settings.max_attempts = 1000;  // left alone, these retries would take minutes
  settings.first_backoff = std::chrono::milliseconds(50);
  settings.max_backoff = std::chrono::milliseconds(50);
  io::S3Client client(settings);
  const io::S3Address address = io::parse_s3_address(S3TestServer::fresh_address("deadline"));
  const std::string bytes = pattern(100, 5);
  const auto put = [&] {
    client.put_object(address.bucket, address.key("x"),
                      std::as_bytes(std::span(bytes.data(), bytes.size())));
  };
  server->stop("object");  // a 5xx for every attempt
  client.set_deadline(std::chrono::steady_clock::now() + std::chrono::milliseconds(500));
  const std::string what = expect_error(ErrorKind::timeout, put);
  expect_names(what, {"deadline", address.key("x"), server->endpoint()});
  // A deadline already past still makes the first attempt, and no retry.
  client.set_deadline(std::chrono::steady_clock::now());
  const std::string once = expect_error(ErrorKind::timeout, put);
  EXPECT_NE(once.find("after 1 attempt:"), std::string::npos) << once;
  server->start("object");
  client.set_deadline(std::nullopt);
  put();
  EXPECT_EQ(as_string(*client.get_bytes(address.bucket, address.key("x"), 1 << 20)), bytes);
}

}  // namespace
}  // namespace pulseloco::testing
