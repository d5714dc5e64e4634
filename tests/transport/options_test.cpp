// Options from the environment, peer addresses, and the TCP frame format.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/factory.h>
#include <pulseloco/transport/rendezvous.h>
#include <pulseloco/transport/tcp/frame.h>

namespace pulseloco::transport {
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
                      {"PULSELOCO_TEST_CORRUPT_FRAME", "17:header"},
                      {"PULSELOCO_MPI_PART_BYTES", "64M"},
                      {"PULSELOCO_CUDA_DEVICE", "1"},
                      {"LOCAL_RANK", "5"},
                      {"PULSELOCO_NCCL_BOOTSTRAP", "tcp"}};
  const auto o = from_environment();
  EXPECT_EQ(o.backend, Backend::mpi);
  EXPECT_EQ(o.rendezvous, RendezvousMethod::peer_list);
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.world_size, 8);
  EXPECT_EQ(o.master_addr, "10.0.0.1");
  EXPECT_EQ(o.master_port, 29500);
  EXPECT_TRUE(o.external_rendezvous_server);
  EXPECT_EQ(o.peers, (std::vector<std::string>{"a:1", "b:2", "c:3"}));
  EXPECT_EQ(o.listen_addr, "0.0.0.0");
  EXPECT_EQ(o.listen_port, 7000);
  EXPECT_EQ(o.advertise_addr, "203.0.113.5");
  EXPECT_EQ(o.socket_ifname, "eth1");
  EXPECT_EQ(o.connections_per_peer, 8);
  EXPECT_EQ(o.stripe_threshold_bytes, 768U * 1024);
  EXPECT_EQ(o.stripe_chunk_bytes, 2U << 20);
  EXPECT_FALSE(o.tcp_nodelay);
  EXPECT_EQ(o.socket_send_buffer_bytes, 4 << 20);
  EXPECT_EQ(o.socket_receive_buffer_bytes, 8 << 20);
  EXPECT_FALSE(o.keepalive);
  EXPECT_EQ(o.keepalive_idle_s, 30);
  EXPECT_EQ(o.keepalive_interval_s, 5);
  EXPECT_EQ(o.keepalive_count, 3);
  EXPECT_EQ(o.connect_timeout.count(), 1234);
  EXPECT_EQ(o.io_timeout.count(), 5678);
  EXPECT_EQ(o.max_unexpected_bytes, std::size_t{1} << 30);
  EXPECT_FALSE(o.payload_checksums);
  EXPECT_EQ(o.io_threads, 2);
  EXPECT_EQ(o.busy_poll.count(), 0);
  EXPECT_EQ(o.secret, "s3cret");
  ASSERT_TRUE(o.corrupt_frame.has_value());
  EXPECT_EQ(o.corrupt_frame->frame_index, 17U);
  EXPECT_EQ(o.corrupt_frame->target, FrameCorruption::header);
  EXPECT_EQ(o.mpi_part_bytes, std::size_t{64} << 20);
  EXPECT_EQ(o.cuda_device, 1);
  EXPECT_EQ(o.local_rank, 5);
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
                                                  {"PULSELOCO_TEST_CORRUPT_FRAME", "x"},
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

TEST(FromEnvironment, SecretFromAFile) {
  const std::string path = ::testing::TempDir() + "pulseloco_secret_test";
  {
    std::ofstream out(path);
    out << "file secret\nsecond line\n";
  }
  const ScopedEnv env{{"PULSELOCO_SECRET_FILE", path.c_str()}};
  EXPECT_EQ(from_environment().secret, "file secret");
  std::remove(path.c_str());
}

TEST(PeerAddress, ParsesHostsAndPorts) {
  EXPECT_EQ(parse_peer_address("node-7:29500", "x"), (PeerAddress{"node-7", 29500}));
  EXPECT_EQ(parse_peer_address("10.1.2.3:1", "x"), (PeerAddress{"10.1.2.3", 1}));
  EXPECT_EQ(parse_peer_address("[fe80::1]:443", "x"), (PeerAddress{"fe80::1", 443}));
  EXPECT_EQ(to_string(PeerAddress{"fe80::1", 443}), "[fe80::1]:443");
  for (const char* bad : {"nohost", ":80", "host:", "host:0", "host:65536", "host:8x", "[::1]80"})
    EXPECT_THROW((void)parse_peer_address(bad, "PULSELOCO_PEERS[0]"), InvalidArgument) << bad;
}

TEST(Frame, HeadersRoundTrip) {
  tcp::FrameHeader header;
  header.kind = tcp::FrameKind::data;
  header.has_payload_checksum = true;
  header.tag = 0x8000'0000'1234'5678ULL;
  header.sequence = 42;
  header.message_bytes = 10'000'000;
  header.chunk_offset = 4'194'304;
  header.chunk_bytes = 4'194'304;
  header.payload_checksum = 0xDEADBEEFCAFEF00DULL;
  const auto encoded = tcp::encode_header(header);
  std::string problem;
  const auto decoded = tcp::decode_header(encoded, problem);
  ASSERT_TRUE(decoded) << problem;
  EXPECT_EQ(decoded->tag, header.tag);
  EXPECT_EQ(decoded->sequence, header.sequence);
  EXPECT_EQ(decoded->message_bytes, header.message_bytes);
  EXPECT_EQ(decoded->chunk_offset, header.chunk_offset);
  EXPECT_EQ(decoded->chunk_bytes, header.chunk_bytes);
  EXPECT_EQ(decoded->payload_checksum, header.payload_checksum);
  EXPECT_TRUE(decoded->has_payload_checksum);
}

TEST(Frame, EveryFlippedHeaderBitIsDetected) {
  tcp::FrameHeader header;
  header.tag = 7;
  header.message_bytes = 100;
  header.chunk_bytes = 100;
  const auto encoded = tcp::encode_header(header);
  for (std::size_t bit = 0; bit < tcp::kFrameHeaderBytes * 8; ++bit) {
    auto damaged = encoded;
    damaged[bit / 8] ^= static_cast<std::byte>(1U << (bit % 8));
    std::string problem;
    EXPECT_FALSE(tcp::decode_header(damaged, problem)) << "bit " << bit;
    EXPECT_FALSE(problem.empty());
  }
}

TEST(Frame, ChunksOutsideTheirMessageAreRejected) {
  tcp::FrameHeader header;
  header.message_bytes = 100;
  header.chunk_offset = 90;
  header.chunk_bytes = 11;  // one byte past the end
  std::string problem;
  EXPECT_FALSE(tcp::decode_header(tcp::encode_header(header), problem));
  EXPECT_NE(problem.find("outside"), std::string::npos) << problem;
  header.kind = tcp::FrameKind::abort;
  header.message_bytes = header.chunk_bytes = tcp::kMaxAbortReasonBytes + 1;
  header.chunk_offset = 0;
  EXPECT_FALSE(tcp::decode_header(tcp::encode_header(header), problem));
}

TEST(Frame, ChunkPlansCoverTheMessageAndUseEveryConnection) {
  constexpr std::uint64_t kThreshold = 1 << 20;
  constexpr std::uint64_t kChunk = 4 << 20;
  EXPECT_EQ(tcp::plan_chunks(0, 4, kThreshold, kChunk).count, 1U);
  EXPECT_EQ(tcp::plan_chunks(kThreshold, 4, kThreshold, kChunk).count, 1U);
  for (const std::uint64_t bytes : {kThreshold + 1, std::uint64_t{3'000'017},
                                    std::uint64_t{64} << 20, (std::uint64_t{256} << 20) + 5}) {
    for (int connections : {1, 2, 4, 8}) {
      const auto plan = tcp::plan_chunks(bytes, connections, kThreshold, kChunk);
      EXPECT_GE(plan.chunk_bytes * plan.count, bytes);
      EXPECT_LT(plan.chunk_bytes * (plan.count - 1), bytes);
      EXPECT_GE(plan.count, static_cast<std::uint64_t>(connections));
      EXPECT_LE(plan.chunk_bytes, std::max<std::uint64_t>(kChunk, 4096));
    }
  }
}

}  // namespace
}  // namespace pulseloco::transport
