// Group formation's options from the environment, and the advertised address they choose
// (PULSELOCO_SOCKET_IFNAME, PULSELOCO_ADVERTISE_ADDR) in groups formed over loopback.
#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/options.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/group/rendezvous_server.h>
#include <pulseloco/group/test_hooks.h>
#include "transport/loopback_group.h"

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
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"PULSELOCO_TRANSPORT", "udp"},
      {"RANK", "-1"},
      {"PULSELOCO_MASTER_PORT", "70000"},
      {"PULSELOCO_TCP_CONNECTIONS", "0"},
      {"PULSELOCO_TCP_STRIPE_CHUNK", "4X"},
      {"PULSELOCO_TCP_STRIPE_CHUNK", "1K"},
      {"PULSELOCO_TCP_SNDBUF", "4G"},
      {"PULSELOCO_TCP_RCVBUF", "100G"},
      {"PULSELOCO_MPI_PART_BYTES", "4G"},
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

constexpr std::chrono::milliseconds kFormationTimeout{30'000};

// Rank `rank`'s options for a 2-rank loopback group at the rendezvous server on `port`, with what
// the environment sets on top.
TransportOptions loopback_options_from_environment(int rank, std::uint16_t port) {
  TransportOptions defaults = transport::testing::loopback_options({}, rank, 2, port);
  defaults.connect_timeout = kFormationTimeout;
  return from_environment(defaults);
}

TEST(AdvertisedAddress, AnInterfaceWithoutAnIpv4AddressFailsNamingTheVariableAndTheInterface) {
  const ScopedEnv env{{"PULSELOCO_ADVERTISE_ADDR", ""}, {"PULSELOCO_SOCKET_IFNAME", "pl-no-such0"}};
  RendezvousServer server("127.0.0.1", 0, 2, transport::TcpOptions{},
                          transport::deadline_after(kFormationTimeout));
  try {
    (void)make_tcp_transport(loopback_options_from_environment(0, server.port()));
    ADD_FAILURE() << "a group formed advertising the address of interface pl-no-such0";
  } catch (const InvalidArgument& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("PULSELOCO_SOCKET_IFNAME: interface 'pl-no-such0' has no IPv4 address"),
              std::string::npos)
        << what;
  }
  // Rank 0 hosting the rendezvous itself reports the same error, not a timeout about the ranks
  // that never registered.
  TransportOptions hosting =
      loopback_options_from_environment(0, transport::testing::pick_free_port());
  hosting.external_rendezvous_server = false;
  try {
    (void)make_tcp_transport(hosting);
    ADD_FAILURE() << "rank 0 formed a group advertising the address of interface pl-no-such0";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("interface 'pl-no-such0' has no IPv4 address"),
              std::string::npos)
        << error.what();
  }
}

// Forms a 2-rank group over loopback whose ranks read their options from the environment, and
// returns it with the table each rank received. The transports are made as make_tcp_transport()
// makes them, without its tagging of this process's log lines with a rank (LogRank in
// make_transport_test.cpp expects an untagged process).
struct EnvironmentGroup {
  std::vector<transport::GroupTable> tables;
  std::vector<std::unique_ptr<transport::TcpTransport>> ranks;
};

EnvironmentGroup form_group_from_environment() {
  RendezvousServer server("127.0.0.1", 0, 2, transport::TcpOptions{},
                          transport::deadline_after(kFormationTimeout));
  EnvironmentGroup group;
  group.tables.resize(2);
  group.ranks.resize(2);
  transport::testing::run_parallel(2, [&](int rank) {
    const auto r = static_cast<std::size_t>(rank);
    const TransportOptions options = loopback_options_from_environment(rank, server.port());
    group.ranks[r] = std::make_unique<transport::TcpTransport>(
        options.tcp,
        [&](std::uint16_t listen_port) {
          group.tables[r] = environment_rendezvous(options, listen_port);
          return group.tables[r];
        },
        options.connect_timeout);
  });
  server.wait();
  return group;
}

// Every rank is listed at 127.0.0.1, and the group carries a message.
void expect_a_working_loopback_group(const EnvironmentGroup& group) {
  for (const auto& table : group.tables) {
    ASSERT_EQ(table.peers.size(), 2U);
    EXPECT_EQ(table.peers[0].host, "127.0.0.1");
    EXPECT_EQ(table.peers[1].host, "127.0.0.1");
  }
  const auto sent = transport::testing::payload(1, 1000);
  std::vector<std::byte> received(sent.size());
  auto receive = group.ranks[1]->irecv(0, 1, received);
  group.ranks[0]->send(1, 1, sent, transport::deadline_after(kFormationTimeout));
  receive->wait(transport::deadline_after(kFormationTimeout));
  EXPECT_EQ(received, sent);
}

// The variables are process-wide: each is set for the whole formation, on every rank's thread.
TEST(AdvertisedAddress, AGroupFormsAdvertisingTheAddressOfTheSocketInterface) {
  const ScopedEnv env{{"PULSELOCO_ADVERTISE_ADDR", ""}, {"PULSELOCO_SOCKET_IFNAME", "lo"}};
  expect_a_working_loopback_group(form_group_from_environment());
}

TEST(AdvertisedAddress, AGroupFormsAdvertisingTheGivenAddress) {
  const ScopedEnv env{{"PULSELOCO_ADVERTISE_ADDR", "127.0.0.1"}, {"PULSELOCO_SOCKET_IFNAME", ""}};
  expect_a_working_loopback_group(form_group_from_environment());
}

}  // namespace
}  // namespace pulseloco::group
