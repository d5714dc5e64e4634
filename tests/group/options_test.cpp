// Group formation's options from the environment.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/group/options.h>
#include <pulseloco/group/test_hooks.h>

namespace pulseloco::group {
namespace {

// Sets environment variables for the scope of a test and restores them afterwards.
class ScopedEnv {
 public:
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> values) {
    for (const auto& [name, value] : values) {
      const char* old = std::getenv(name);
      saved_.emplace(name, old ? std::optional<std::string>(old) : std::nullopt);
      ::setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::map<std::string, std::optional<std::string>> saved_;
};

TEST(FromEnvironment, ReadsEveryVariable) {
  const ScopedEnv env{{"PULSELOCO_TRANSPORT", "mpi"},
                      {"PULSELOCO_RENDEZVOUS", "peers"},
                      {"RANK", "3"},
                      {"WORLD_SIZE", "8"},
                      {"MASTER_ADDR", "10.0.0.1"},
                      {"MASTER_PORT", "29500"},
                      {"PULSELOCO_RENDEZVOUS_EXTERNAL", "yes"},
                      {"PULSELOCO_PEERS", "a:1, b:2 ,c:3"},
                      {"PULSELOCO_LISTEN_ADDR", "0.0.0.0"},
                      {"PULSELOCO_LISTEN_PORT", "7000"},
                      {"PULSELOCO_ADVERTISE_ADDR", "203.0.113.5"},
                      {"PULSELOCO_SOCKET_IFNAME", "eth1"},
                      {"PULSELOCO_TCP_CONNECTIONS", "8"},
                      {"PULSELOCO_TCP_STRIPE_THRESHOLD", "768K"},
                      {"PULSELOCO_TCP_STRIPE_CHUNK", "2MiB"},
                      {"PULSELOCO_TCP_NODELAY", "off"},
                      {"PULSELOCO_TCP_SNDBUF", "4M"},
                      {"PULSELOCO_TCP_RCVBUF", "8M"},
                      {"PULSELOCO_TCP_KEEPALIVE", "0"},
                      {"PULSELOCO_TCP_KEEPALIVE_IDLE", "30"},
                      {"PULSELOCO_TCP_KEEPALIVE_INTERVAL", "5"},
                      {"PULSELOCO_TCP_KEEPALIVE_COUNT", "3"},
                      {"PULSELOCO_CONNECT_TIMEOUT_MS", "1234"},
                      {"PULSELOCO_IO_TIMEOUT_MS", "5678"},
                      {"PULSELOCO_TCP_MAX_UNEXPECTED", "1G"},
                      {"PULSELOCO_TCP_CHECKSUMS", "false"},
                      {"PULSELOCO_TCP_IO_THREADS", "2"},
                      {"PULSELOCO_TCP_BUSY_POLL_US", "0"},
                      {"PULSELOCO_SECRET", "s3cret"},
                      {"PULSELOCO_MPI_PART_BYTES", "64M"},
                      {"PULSELOCO_CUDA_DEVICE", "1"},
                      {"LOCAL_RANK", "5"},
                      {"PULSELOCO_NCCL_BOOTSTRAP", "tcp"}};
  const auto o = from_environment();
  EXPECT_EQ(o.backend, transport::Backend::mpi);
  EXPECT_EQ(o.rendezvous, RendezvousMethod::peer_list);
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.world_size, 8);
  EXPECT_EQ(o.master_addr, "10.0.0.1");
  EXPECT_EQ(o.master_port, 29500);
  EXPECT_TRUE(o.external_rendezvous_server);
  EXPECT_EQ(o.peers, (std::vector<std::string>{"a:1", "b:2", "c:3"}));
  EXPECT_EQ(o.tcp.listen_addr, "0.0.0.0");
  EXPECT_EQ(o.tcp.listen_port, 7000);
  EXPECT_EQ(o.advertise_addr, "203.0.113.5");
  EXPECT_EQ(o.socket_ifname, "eth1");
  EXPECT_EQ(o.tcp.connections_per_peer, 8);
  EXPECT_EQ(o.tcp.stripe_threshold_bytes, 768U * 1024);
  EXPECT_EQ(o.tcp.stripe_chunk_bytes, 2U << 20);
  EXPECT_FALSE(o.tcp.tcp_nodelay);
  EXPECT_EQ(o.tcp.socket_send_buffer_bytes, 4 << 20);
  EXPECT_EQ(o.tcp.socket_receive_buffer_bytes, 8 << 20);
  EXPECT_FALSE(o.tcp.keepalive);
  EXPECT_EQ(o.tcp.keepalive_idle_s, 30);
  EXPECT_EQ(o.tcp.keepalive_interval_s, 5);
  EXPECT_EQ(o.tcp.keepalive_count, 3);
  EXPECT_EQ(o.connect_timeout.count(), 1234);
  EXPECT_EQ(o.tcp.io_timeout.count(), 5678);
  EXPECT_EQ(o.tcp.max_unexpected_bytes, std::size_t{1} << 30);
  EXPECT_FALSE(o.tcp.payload_checksums);
  EXPECT_EQ(o.tcp.io_threads, 2);
  EXPECT_EQ(o.tcp.busy_poll.count(), 0);
  EXPECT_EQ(o.tcp.secret, "s3cret");
  EXPECT_EQ(o.mpi.part_bytes, std::size_t{64} << 20);
  EXPECT_EQ(o.nccl.cuda_device, 1);
  EXPECT_EQ(o.nccl.local_rank, 5);
  EXPECT_EQ(o.nccl_bootstrap, NcclBootstrap::tcp);
  EXPECT_NO_THROW(validate(o));
}

TEST(FromEnvironment, PrefixedNamesWinAndEmptyMeansUnset) {
  const ScopedEnv env{{"RANK", "1"}, {"PULSELOCO_RANK", "2"}, {"WORLD_SIZE", ""}};
  TransportOptions defaults;
  defaults.world_size = 4;
  const auto o = from_environment(defaults);
  EXPECT_EQ(o.rank, 2);
  EXPECT_EQ(o.world_size, 4);
}

TEST(FromEnvironment, BadValuesNameTheVariable) {
  const std::map<std::string, std::string> bad = {{"PULSELOCO_TRANSPORT", "udp"},
                                                  {"RANK", "-1"},
                                                  {"PULSELOCO_MASTER_PORT", "70000"},
                                                  {"PULSELOCO_TCP_CONNECTIONS", "0"},
                                                  {"PULSELOCO_TCP_STRIPE_CHUNK", "4X"},
                                                  {"PULSELOCO_TCP_NODELAY", "maybe"},
                                                  {"PULSELOCO_TCP_BUSY_POLL_US", "2000000"},
                                                  {"PULSELOCO_RENDEZVOUS", "dns"},
                                                  {"PULSELOCO_SECRET", " \t "},
                                                  {"PULSELOCO_SECRET_FILE", "/nonexistent/secret"}};
  for (const auto& [name, value] : bad) {
    const ScopedEnv env{{name.c_str(), value.c_str()}};
    try {
      (void)from_environment();
      ADD_FAILURE() << name << "=" << value << " was accepted";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find(name), std::string::npos) << error.what();
    }
  }
}

// The test hook's variable is read by make_transport, not from_environment (test_hooks.h).
TEST(TestHooks, TheCorruptFrameVariableIsParsedOrNamedWhenBad) {
  {
    const ScopedEnv env{{"PULSELOCO_TEST_CORRUPT_FRAME", "17:header"}};
    const auto hook = corrupt_frame_from_environment();
    ASSERT_TRUE(hook.has_value());
    EXPECT_EQ(hook->frame_index, 17U);
    EXPECT_EQ(hook->target, transport::FrameCorruption::header);
  }
  {
    const ScopedEnv env{{"PULSELOCO_TEST_CORRUPT_FRAME", "3"}};
    const auto hook = corrupt_frame_from_environment();
    ASSERT_TRUE(hook.has_value());
    EXPECT_EQ(hook->frame_index, 3U);
    EXPECT_EQ(hook->target, transport::FrameCorruption::payload);
  }
  {
    const ScopedEnv env{{"PULSELOCO_TEST_CORRUPT_FRAME", "x"}};
    try {
      (void)corrupt_frame_from_environment();
      ADD_FAILURE() << "PULSELOCO_TEST_CORRUPT_FRAME=x was accepted";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find("PULSELOCO_TEST_CORRUPT_FRAME"), std::string::npos)
          << error.what();
    }
  }
  const ScopedEnv env{{"PULSELOCO_TEST_CORRUPT_FRAME", ""}};
  EXPECT_FALSE(corrupt_frame_from_environment().has_value());
}

TEST(FromEnvironment, SecretFromAFile) {
  const std::string path = ::testing::TempDir() + "pulseloco_secret_test";
  {
    std::ofstream out(path);
    out << "file secret\nsecond line\n";
  }
  const ScopedEnv env{{"PULSELOCO_SECRET_FILE", path.c_str()}};
  EXPECT_EQ(from_environment().tcp.secret, "file secret");
  // A file written with CRLF line ends holds the same secret.
  std::ofstream(path, std::ios::binary | std::ios::trunc) << "file secret\r\nsecond line\r\n";
  EXPECT_EQ(from_environment().tcp.secret, "file secret");
  // A first line of whitespace (or a lone '\r') is no secret.
  for (const char* blank : {"   \n", "\r\n", "\t\n"}) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << blank;
    try {
      (void)from_environment();
      ADD_FAILURE() << "a blank secret file was accepted";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find("PULSELOCO_SECRET_FILE"), std::string::npos)
          << error.what();
      EXPECT_NE(std::string(error.what()).find("empty or only whitespace"), std::string::npos)
          << error.what();
    }
  }
  std::remove(path.c_str());
}

}  // namespace
}  // namespace pulseloco::group
