// TLS on the TCP links: certificates (mutual authentication through the rendezvous and the data
// plane, a certificate from another CA refused naming the peer), files and settings that cannot
// be used, a packet capture of loopback showing that TLS leaves no plaintext on the wire while
// the HMAC-only links do, and the opt-in that keeps links between ranks of one host plaintext. (The
// conformance tests run over TLS keyed from a secret too: tcp_transport_test.cpp, the collectives'
// "tcp_tls" groups.)
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/group/options.h>
#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/tls_context.h>
#include "transport/child_process.h"
#include "transport/loopback_group.h"
#include "transport/test_pki.h"

namespace pulseloco::transport {
namespace {

using namespace std::chrono_literals;
using group::TransportOptions;
using testing::payload;
using testing::run_parallel;
using testing::TestPki;

constexpr auto kTimeout = 60s;

// One message each way between ranks 0 and 1 arrives intact.
void expect_exchange(std::vector<std::unique_ptr<TcpTransport>>& group) {
  const auto to_one = payload(1, 300'000);
  const auto to_zero = payload(2, 1000);
  std::vector<std::byte> at_one(to_one.size());
  std::vector<std::byte> at_zero(to_zero.size());
  auto r1 = group[1]->irecv(0, 5, at_one);
  auto r0 = group[0]->irecv(1, 5, at_zero);
  group[0]->send(1, 5, to_one, deadline_after(kTimeout));
  group[1]->send(0, 5, to_zero, deadline_after(kTimeout));
  r1->wait(deadline_after(kTimeout));
  r0->wait(deadline_after(kTimeout));
  EXPECT_EQ(at_one, to_one);
  EXPECT_EQ(at_zero, to_zero);
}

TEST(Tls, CertificatesAuthenticateTheRendezvousAndEveryConnection) {
  const TestPki pki;
  TcpOptions server_link;
  server_link.tls_files = pki.files("server");
  ASSERT_EQ(effective_link_security(server_link), LinkSecurity::tls);
  group::RendezvousServer server("127.0.0.1", 0, 2, server_link, deadline_after(kTimeout));
  std::vector<std::unique_ptr<TcpTransport>> group(2);
  run_parallel(2, [&](int rank) {
    TransportOptions options = testing::loopback_options({}, rank, 2, server.port());
    options.tcp.tls_files = pki.files("rank" + std::to_string(rank));
    group[static_cast<std::size_t>(rank)] = group::make_tcp_transport(options);
  });
  server.wait();
  expect_exchange(group);
}

// Which rank holds a certificate from the other CA: rank 1 (rank 0, connecting, rejects its
// certificate) or rank 0 (rank 1, accepting, rejects it; rank 0 learns so from TLS's alert).
class ForeignCertificate : public ::testing::TestWithParam<int> {};

INSTANTIATE_TEST_SUITE_P(Tls, ForeignCertificate, ::testing::Values(0, 1),
                         [](const auto& param_info) {
                           return "AtRank" + std::to_string(param_info.param);
                         });

TEST_P(ForeignCertificate, IsRefusedAndTheRefusalNamesThePeer) {
  const TestPki pki;
  const int stranger = GetParam();
  const auto failures = testing::failed_formation([&](const auto& peers, int rank) {
    auto options = testing::peer_list_options(peers, rank, "", 3s);
    // The stranger trusts the real CA: only its own certificate is wrong.
    options.tcp.tls_files =
        pki.files(rank == stranger ? "stranger" : "rank" + std::to_string(rank));
    return options;
  });
  // Rank 0 connects: TLS refuses the link, naming peer 1; rank 1 gives up waiting for rank 0.
  const std::string& refused = failures.what[0];
  EXPECT_NE(refused.find("authentication failed: TLS refused the connection"), std::string::npos)
      << refused;
  EXPECT_NE(refused.find("certificate"), std::string::npos) << refused;
  EXPECT_NE(refused.find("peer 1"), std::string::npos) << refused;
  EXPECT_EQ(failures.blamed[0], 1);
  EXPECT_NE(failures.what[1].find("could not connect to peers 0"), std::string::npos)
      << failures.what[1];
}

// The message of the InvalidArgument that making a TLS context with these settings throws.
std::string refusal(LinkSecurity security, const std::string& secret, const TlsFiles& files) {
  try {
    (void)tcp::TlsContext::make(security, secret, files);
  } catch (const InvalidArgument& error) {
    return error.what();
  }
  return "(accepted)";
}

TEST(Tls, FilesThatCannotBeUsedAreNamedWithTheirVariable) {
  const TestPki pki;
  const std::string garbage = pki.dir().file("garbage.pem");
  std::ofstream(garbage) << "not a PEM file\n";
  TlsFiles files = pki.files("rank0");

  files.cert = pki.dir().file("missing.pem");
  std::string problem = refusal(LinkSecurity::automatic, "", files);
  EXPECT_NE(problem.find("PULSELOCO_TLS_CERT='" + files.cert + "'"), std::string::npos) << problem;
  EXPECT_NE(problem.find("cannot be opened"), std::string::npos) << problem;

  files.cert = garbage;
  problem = refusal(LinkSecurity::automatic, "", files);
  EXPECT_NE(problem.find("PULSELOCO_TLS_CERT='" + garbage + "': not a PEM certificate chain"),
            std::string::npos)
      << problem;

  files = pki.files("rank0");
  files.key = pki.files("rank1").key;
  problem = refusal(LinkSecurity::automatic, "", files);
  EXPECT_NE(problem.find("PULSELOCO_TLS_KEY='" + files.key + "': not the key of the certificate"),
            std::string::npos)
      << problem;

  files = pki.files("rank0");
  files.ca = garbage;
  problem = refusal(LinkSecurity::automatic, "", files);
  EXPECT_NE(problem.find("PULSELOCO_TLS_CA='" + garbage + "'"), std::string::npos) << problem;

  files = TlsFiles{.cert = pki.files("rank0").cert};
  problem = refusal(LinkSecurity::automatic, "", files);
  EXPECT_NE(problem.find("go together"), std::string::npos) << problem;

  problem = refusal(LinkSecurity::tls, "", {});
  EXPECT_NE(problem.find("tls needs a shared secret"), std::string::npos) << problem;
  problem = refusal(LinkSecurity::hmac, "secret", pki.files("rank0"));
  EXPECT_NE(problem.find("hmac does not use certificates"), std::string::npos) << problem;
}

TEST(Tls, TheSecurityFollowsTheSecretAndTheEnvironment) {
  EXPECT_EQ(effective_link_security(LinkSecurity::automatic, "", {}), LinkSecurity::none);
  EXPECT_EQ(effective_link_security(LinkSecurity::automatic, "s", {}), LinkSecurity::tls);
  EXPECT_EQ(effective_link_security(LinkSecurity::hmac, "s", {}), LinkSecurity::hmac);
  EXPECT_EQ(effective_link_security(LinkSecurity::hmac, "", {}), LinkSecurity::none);
  EXPECT_EQ(tcp::TlsContext::make(LinkSecurity::hmac, "s", {}), nullptr);

  ::setenv("PULSELOCO_LINK_SECURITY", "HMAC", 1);
  EXPECT_EQ(group::from_environment().tcp.link_security, LinkSecurity::hmac);
  ::setenv("PULSELOCO_LINK_SECURITY", "ssl", 1);
  try {
    (void)group::from_environment();
    ADD_FAILURE() << "an unknown link security was accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("PULSELOCO_LINK_SECURITY='ssl'"), std::string::npos)
        << error.what();
  }
  ::unsetenv("PULSELOCO_LINK_SECURITY");
}

// --- Packet capture --------------------------------------------------------------------------

std::optional<std::string> find_tcpdump() {
  for (const char* path : {"/usr/bin/tcpdump", "/usr/sbin/tcpdump"})
    if (::access(path, X_OK) == 0) return path;
  return std::nullopt;
}

// 1 MiB of a recognisable text.
std::vector<std::byte> known_pattern() {
  const std::string line = "pulseloco known tensor pattern 0123456789 ";
  std::vector<std::byte> out(std::size_t{1} << 20);
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<std::byte>(line[i % line.size()]);
  return out;
}

// A link security, and whether same-host links are plaintext (PULSELOCO_SAME_HOST_PLAINTEXT).
struct CaptureCase {
  LinkSecurity security = LinkSecurity::tls;
  bool same_host_plaintext = false;
  // Whether the loopback links carry plaintext then.
  [[nodiscard]] bool plaintext() const {
    return security != LinkSecurity::tls || same_host_plaintext;
  }
};

class Capture : public ::testing::TestWithParam<CaptureCase> {};

INSTANTIATE_TEST_SUITE_P(Tls, Capture,
                         ::testing::Values(CaptureCase{LinkSecurity::hmac, false},
                                           CaptureCase{LinkSecurity::tls, false},
                                           CaptureCase{LinkSecurity::tls, true}),
                         [](const auto& param_info) {
                           return testing::link_name(param_info.param.security) +
                                  (param_info.param.same_host_plaintext ? "SameHostPlaintext" : "");
                         });

// A 2-rank all-gather (each rank sends its block to the other) of a known pattern on loopback
// while tcpdump records the group's ports: the pattern is in the capture with HMAC-only links,
// and with TLS when same-host links are plaintext, and nowhere in it with TLS otherwise.
TEST_P(Capture, TheWireShowsThePatternOnlyWithoutTls) {
  const auto tcpdump = find_tcpdump();
  if (!tcpdump) GTEST_SKIP() << "tcpdump is not installed (scripts/deps installs it)";
  const testing::TempDir dir;
  const std::string capture = dir.file("lo.pcap");
  const std::vector<std::string> peers = testing::free_peer_list(2);
  const auto port = [&](int rank) { return peers[static_cast<std::size_t>(rank)].substr(10); };
  pulseloco::testing::Child dump(
      {"/bin/sh", "-c",
       // As root, -Z root keeps tcpdump from dropping to a user that may not
       // write into the temporary directory.
       "exec " + *tcpdump + (::geteuid() == 0 ? " -Z root" : "") + " -i lo -n -U -B 65536 -w " +
           capture + " 'tcp port " + port(0) + " or tcp port " + port(1) + "' 2>&1"},
      {}, true);
  const auto deadline = pulseloco::testing::ChildClock::now() + kTimeout;
  if (dump.expect("tcpdump: listening on", deadline).empty()) {
    std::string said;
    for (const auto& line : dump.lines())
      said += line + "; ";
    GTEST_SKIP() << "tcpdump cannot capture on lo here: " << said;
  }

  const auto pattern = known_pattern();
  {
    std::vector<std::unique_ptr<TcpTransport>> group(2);
    run_parallel(2, [&](int rank) {
      auto options = testing::peer_list_options(peers, rank, "capture secret", 20s);
      options.tcp.link_security = GetParam().security;
      options.tcp.same_host_plaintext = GetParam().same_host_plaintext;
      group[static_cast<std::size_t>(rank)] = group::make_tcp_transport(options);
    });
    run_parallel(2, [&](int rank) {
      auto& self = *group[static_cast<std::size_t>(rank)];
      std::vector<std::byte> theirs(pattern.size());
      auto recv = self.irecv(1 - rank, 1, theirs);
      self.send(1 - rank, 1, pattern, deadline_after(kTimeout));
      recv->wait(deadline_after(kTimeout));
      EXPECT_EQ(theirs, pattern);
    });
  }
  // tcpdump writes each packet as it sees it (-U), from a buffer large enough for the whole
  // exchange (-B, KiB): wait until it has written both blocks.
  const auto written = [&] {
    std::error_code ignored;
    return std::filesystem::file_size(capture, ignored);
  };
  const auto capture_deadline = pulseloco::testing::ChildClock::now() + 30s;
  while (written() < 2 * pattern.size() && pulseloco::testing::ChildClock::now() < capture_deadline)
    std::this_thread::sleep_for(10ms);
  dump.signal(SIGINT);
  (void)dump.wait_exit(pulseloco::testing::ChildClock::now() + 30s);
  ASSERT_GE(written(), 2 * pattern.size()) << "tcpdump did not record the exchange";

  std::ifstream in(capture, std::ios::binary);
  const std::string recorded((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  const std::string needle(reinterpret_cast<const char*>(pattern.data()), 64);
  const bool plaintext = recorded.find(needle) != std::string::npos;
  if (GetParam().plaintext()) {
    EXPECT_TRUE(plaintext) << "the capture of a plaintext link should show the pattern";
  } else {
    EXPECT_FALSE(plaintext) << "the pattern is readable in the capture of a TLS link";
  }
}

// --- Same-host links -------------------------------------------------------------------------

TEST(SameHostLink, IsALoopbackPeerOrOneOfThisHostsOwnAddresses) {
  const auto same = [](const char* local, const char* remote) {
    return tcp::same_host_link(boost::asio::ip::make_address(local),
                               boost::asio::ip::make_address(remote));
  };
  EXPECT_TRUE(same("127.0.0.1", "127.0.0.1"));
  EXPECT_TRUE(same("127.0.0.1", "127.0.0.2"));
  EXPECT_TRUE(same("::1", "::1"));
  EXPECT_TRUE(same("::ffff:127.0.0.1", "::ffff:127.0.0.1"));
  EXPECT_TRUE(same("10.0.0.5", "10.0.0.5"));         // to one of our own addresses
  EXPECT_TRUE(same("::ffff:10.0.0.5", "10.0.0.5"));  // the same, v4-mapped
  EXPECT_FALSE(same("10.0.0.5", "10.0.0.6"));        // another host
  EXPECT_FALSE(same("10.0.0.5", "::ffff:10.0.0.6"));
  EXPECT_FALSE(same("fd00::1", "fd00::2"));
  EXPECT_FALSE(same("0.0.0.0", "0.0.0.0"));  // not a connected socket's
}

// Plaintext links are authenticated by the secret's HMAC handshake: with certificates and no
// secret they would be open to anyone on the host, so that setting is refused.
TEST(SameHostLink, PlaintextLinksNeedASecretBesideCertificates) {
  TcpOptions options;
  options.link_security = LinkSecurity::tls;
  options.tls_files = {.cert = "rank.pem", .key = "rank.key", .ca = "ca.pem"};
  EXPECT_NO_THROW(validate(options));
  options.same_host_plaintext = true;
  try {
    validate(options);
    ADD_FAILURE() << "same-host plaintext links without a secret were accepted";
  } catch (const InvalidArgument& error) {
    EXPECT_NE(std::string(error.what()).find("PULSELOCO_SAME_HOST_PLAINTEXT) need a shared secret"),
              std::string::npos)
        << error.what();
  }
  options.secret = "a secret";
  EXPECT_NO_THROW(validate(options));
}

TEST(SameHostLink, PlaintextLinksCarryTheGroupsMessages) {
  const auto peers = testing::free_peer_list(2);
  std::vector<std::unique_ptr<TcpTransport>> group(2);
  run_parallel(2, [&](int rank) {
    auto options = testing::peer_list_options(peers, rank, "same host secret", 20s);
    options.tcp.link_security = LinkSecurity::tls;
    options.tcp.same_host_plaintext = true;
    group[static_cast<std::size_t>(rank)] = group::make_tcp_transport(options);
  });
  expect_exchange(group);
}

// TLS everywhere, but only one of the two ranks keeps same-host links plaintext (rank 0 when
// the parameter is true): a plaintext end meets a TLS end, and the ranks fail at once naming
// the mismatch instead of one of them reading the other's bytes in the clear.
class SameHostPlaintextOnOneRank : public ::testing::TestWithParam<bool> {};

INSTANTIATE_TEST_SUITE_P(SameHostLink, SameHostPlaintextOnOneRank, ::testing::Bool(),
                         [](const auto& param_info) {
                           return param_info.param ? "OnTheDialingRank" : "OnTheListeningRank";
                         });

TEST_P(SameHostPlaintextOnOneRank, RanksFailAtOnceNamingTheMismatch) {
  const auto failures = testing::failed_formation([&](const auto& peers, int rank) {
    auto options = testing::peer_list_options(peers, rank, "same host secret", 3s);
    options.tcp.link_security = LinkSecurity::tls;
    options.tcp.same_host_plaintext = (rank == 0) == GetParam();
    return options;
  });
  // Rank 0 dials rank 1, whose listener answers with its own security and closes.
  EXPECT_NE(failures.what[0].find("link security differs"), std::string::npos) << failures.what[0];
  EXPECT_NE(failures.what[0].find("PULSELOCO_SAME_HOST_PLAINTEXT"), std::string::npos)
      << failures.what[0];
  EXPECT_EQ(failures.blamed[0], 1);
  EXPECT_NE(failures.what[1].find("link security differs"), std::string::npos) << failures.what[1];
}

}  // namespace
}  // namespace pulseloco::transport
