// The bucket tests' S3 server: OpenStack Swift with s3api (tests/io/swift_s3_server.py),
// started once per test binary on first use and stopped at exit. Tests skip, saying why, only
// when Swift is not installed (scripts/deps installs it); any other failure to start fails.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/build_config.h>
#include <pulseloco/io/s3_client.h>
#include <pulseloco/io/s3_settings.h>
#include "transport/child_process.h"

#ifndef PULSELOCO_SWIFT_S3_SERVER
#error "PULSELOCO_SWIFT_S3_SERVER must name tests/io/swift_s3_server.py"
#endif

namespace pulseloco::testing {

class S3TestServer {
 public:
  static constexpr const char* kBucket = "pulseloco-tests";

  // The running server; nullptr (with skip_reason()) when Swift is not installed. Under ctest,
  // the one its fixture started for every test (PULSELOCO_TEST_S3_SERVER names its state
  // file); otherwise this process's own.
  static S3TestServer* instance() {
    static std::unique_ptr<S3TestServer> shared = attach();
    if (shared) return shared.get();
    return own();
  }
  // A server of this process's own, for tests that stop and start it.
  static S3TestServer* own() {
    static std::unique_ptr<S3TestServer> server = launch();
    return server.get();
  }
  static std::string& skip_reason() {
    static std::string reason;
    return reason;
  }

  // Settings for a client of the server, with few and short retries.
  [[nodiscard]] io::S3Settings settings() const {
    io::S3Settings settings;
    settings.endpoint = endpoint_;
    settings.region = "us-east-1";
    settings.access_key = access_key_;
    settings.secret_key = secret_key_;
    settings.path_style = true;
    settings.max_attempts = 2;
    settings.first_backoff = std::chrono::milliseconds(20);
    settings.part_bytes = kPartBytes;
    return settings;
  }
  // The variables a process (this one, or a child) reads them from (S3Settings::from_environment).
  [[nodiscard]] std::map<std::string, std::string> environment() const {
    return {{"PULSELOCO_S3_ENDPOINT", endpoint_},
            {"AWS_REGION", "us-east-1"},
            {"AWS_ACCESS_KEY_ID", access_key_},
            {"AWS_SECRET_ACCESS_KEY", secret_key_},
            {"PULSELOCO_S3_MAX_ATTEMPTS", "2"},
            {"PULSELOCO_S3_PART_BYTES", std::to_string(kPartBytes)}};
  }
  void set_environment() const {
    for (const auto& [name, value] : environment())
      ::setenv(name.c_str(), value.c_str(), 1);
    ::unsetenv("AWS_SESSION_TOKEN");
    ::unsetenv("AWS_PROFILE");
  }
  [[nodiscard]] const std::string& endpoint() const { return endpoint_; }
  [[nodiscard]] const std::string& other_access_key() const { return other_access_key_; }
  [[nodiscard]] const std::string& other_secret_key() const { return other_secret_key_; }
  [[nodiscard]] const std::string& reader_access_key() const { return reader_access_key_; }
  [[nodiscard]] const std::string& reader_secret_key() const { return reader_secret_key_; }

  // A prefix no other test of any process uses.
  [[nodiscard]] static std::string fresh_address(const std::string& name) {
    static std::atomic<int> counter{0};
    return "s3://" + std::string(kBucket) + "/" + name + "-" + std::to_string(::getpid()) + "-" +
           std::to_string(counter++);
  }

  // Stops the S3 endpoint (the proxy) and returns once it has exited; start() brings it back
  // on the same port and returns once it answers.
  // Only a server of this process's own (own()). `server`: "proxy" (the S3 endpoint: requests
  // fail to connect), or "object" (the proxy answers 503).
  void stop(const std::string& server = "proxy") { command("stop " + server, "stopped"); }
  void start(const std::string& server = "proxy") { command("start " + server, "started"); }

  ~S3TestServer() {
    if (!child_) return;
    // End of input: the fixture stops Swift and removes its directory.
    child_->close_stdin();
    (void)child_->wait_exit(ChildClock::now() + std::chrono::seconds(60));
  }

  // Parts small enough that the tests' anchors are uploaded in several.
  static constexpr std::uint64_t kPartBytes = 256 * 1024;

 private:
  S3TestServer() = default;

  static std::unique_ptr<S3TestServer> launch() {
    if (!PULSELOCO_HAS_S3) {
      skip_reason() = "this build has no S3 support (PULSELOCO_WITH_S3)";
      return nullptr;
    }
    std::unique_ptr<S3TestServer> server(new S3TestServer());
    // Children that outlive a failed wait must not write into a closed pipe.
    ::signal(SIGPIPE, SIG_IGN);
    server->child_ = std::make_unique<Child>(
        std::vector<std::string>{"/usr/bin/python3", PULSELOCO_SWIFT_S3_SERVER, "--bucket",
                                 kBucket},
        std::map<std::string, std::string>{}, true);
    const auto line = server->child_->next_line(ChildClock::now() + std::chrono::seconds(240));
    if (!line) throw std::runtime_error("the Swift S3 server did not start within 240 s");
    if (line->rfind("SKIP:", 0) == 0) {
      skip_reason() = line->substr(6);
      return nullptr;
    }
    server->read_info(*line);
    return server;
  }

  // The server ctest's fixture started (tests/io/CMakeLists.txt), when there is one.
  static std::unique_ptr<S3TestServer> attach() {
    const char* state = std::getenv("PULSELOCO_TEST_S3_SERVER");
    if (state == nullptr || !PULSELOCO_HAS_S3) return nullptr;
    std::ifstream file(state);
    std::string line;
    if (!std::getline(file, line)) {
      throw std::runtime_error(std::string("the S3 server fixture wrote no ") + state +
                               " (its setup test failed)");
    }
    if (line.rfind("SKIP:", 0) == 0) {
      skip_reason() = line.substr(6);
      return nullptr;
    }
    std::unique_ptr<S3TestServer> server(new S3TestServer());
    server->read_info(line);
    return server;
  }

  void read_info(const std::string& line) {
    const nlohmann::json info = nlohmann::json::parse(line);
    endpoint_ = info.at("endpoint").get<std::string>();
    access_key_ = info.at("access_key").get<std::string>();
    secret_key_ = info.at("secret_key").get<std::string>();
    other_access_key_ = info.at("other_access_key").get<std::string>();
    other_secret_key_ = info.at("other_secret_key").get<std::string>();
    reader_access_key_ = info.at("reader_access_key").get<std::string>();
    reader_secret_key_ = info.at("reader_secret_key").get<std::string>();
  }

  void command(const std::string& what, const std::string& answer) {
    if (!child_) throw std::runtime_error("stop() and start() need a server of one's own");
    if (!child_->write_line(what)) throw std::runtime_error("the Swift S3 server is gone");
    const std::string line = child_->expect(answer, ChildClock::now() + std::chrono::seconds(180));
    if (line != answer) throw std::runtime_error("the Swift S3 server did not answer " + answer);
  }

  std::unique_ptr<Child> child_;
  std::string endpoint_;
  std::string access_key_;
  std::string secret_key_;
  std::string other_access_key_;
  std::string other_secret_key_;
  std::string reader_access_key_;
  std::string reader_secret_key_;
};

// Runs `action`, which must throw an Error of `kind`; returns its text.
template <typename Action>
std::string expect_error(ErrorKind kind, Action action) {
  try {
    action();
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), kind) << error.what();
    return error.what();
  }
  ADD_FAILURE() << "no error";
  return {};
}

// In a test body or SetUp: the running server, or a skip saying why there is none.
#define PULSELOCO_S3_SERVER_OR_SKIP(server)                                                    \
  ::pulseloco::testing::S3TestServer* server = ::pulseloco::testing::S3TestServer::instance(); \
  if (server == nullptr) GTEST_SKIP() << ::pulseloco::testing::S3TestServer::skip_reason()

// The names of the objects under `address`, relative to its prefix.
inline std::set<std::string> object_names(io::S3Client& client, const io::S3Address& address) {
  std::set<std::string> names;
  for (const std::string& key : client.list_keys(address.bucket, address.prefix + "/"))
    names.insert(key.substr(address.prefix.size() + 1));
  return names;
}

// A test fixture's fresh prefix on the running server (or a skip): the client, its s3:// url and
// parsed address, and the names of the objects written under it.
class BucketPrefixTest : public ::testing::Test {
 protected:
  // `purpose` starts the prefix's name.
  void attach(S3TestServer* server, const std::string& purpose) {
    server_ = server;
    if (server_ == nullptr) GTEST_SKIP() << S3TestServer::skip_reason();
    client_ = std::make_unique<io::S3Client>(server_->settings());
    url_ = S3TestServer::fresh_address(purpose);
    address_ = io::parse_s3_address(url_);
  }

  [[nodiscard]] std::set<std::string> object_names() {
    return testing::object_names(*client_, address_);
  }

  S3TestServer* server_ = nullptr;
  std::unique_ptr<io::S3Client> client_;
  std::string url_;
  io::S3Address address_;
};

}  // namespace pulseloco::testing
