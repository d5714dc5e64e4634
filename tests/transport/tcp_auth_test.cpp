// Authentication of TCP connections: the HMAC-SHA256 challenge-response, strangers and wrong
// secrets at the rendezvous server and at the data listener, none of which disturbs the group.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <array>
#include <future>
#include <optional>
#include <string>
#include <thread>

#include <pulseloco/base/errors.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/tls_context.h>
#include "transport/loopback_group.h"

namespace pulseloco::transport {
namespace {

using namespace std::chrono_literals;
using group::TransportOptions;
using testing::make_loopback_group;
using testing::payload;
using testing::run_parallel;
namespace asio = boost::asio;

constexpr auto kTimeout = 30s;
constexpr const char* kSecret = "the group's secret";

void expect_group_works(std::vector<std::unique_ptr<TcpTransport>>& group) {
  const auto message = payload(42, 70'000);
  std::vector<std::byte> got(message.size());
  auto recv = group[1]->irecv(0, 1, got);
  group[0]->send(1, 1, message, deadline_after(kTimeout));
  recv->wait(deadline_after(kTimeout));
  EXPECT_EQ(got, message);
}

// Connects to 127.0.0.1:port and runs the client side of the handshake; returns the error
// message it failed with ("" on success). Afterwards waits until the server has closed the
// connection, so that the server has finished its bookkeeping.
// The link is secured as a group with this secret secures its own (security).
std::string intrude(std::uint16_t port, tcp::Hello hello, const std::string& secret,
                    LinkSecurity security = LinkSecurity::automatic) {
  asio::io_context io;
  auto socket = std::make_shared<tcp::Socket>(io);
  socket->connect(tcp::Endpoint(asio::ip::make_address("127.0.0.1"), port));
  tcp::LinkStream link(socket, tcp::TlsContext::make(security, secret, {}));
  auto outcome = asio::co_spawn(io, tcp::client_handshake(link, hello, secret), asio::use_future);
  io.run();
  std::string problem;
  try {
    (void)outcome.get();
  } catch (const std::exception& error) {
    problem = error.what();
  }
  std::array<char, 256> sink{};
  boost::system::error_code error;
  while (!error)
    (void)socket->read_some(asio::buffer(sink), error);
  return problem;
}

TEST(Hmac, MatchesRfc4231TestCase2) {
  const std::string_view data = "what do ya want for nothing?";
  const auto mac = tcp::hmac_sha256(
      "Jefe", std::span(reinterpret_cast<const std::uint8_t*>(data.data()), data.size()));
  std::string hex;
  for (auto byte : mac)
    hex += fmt::format("{:02x}", byte);
  EXPECT_EQ(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
}

TEST(TcpAuth, StrangersWithTheWrongSecretAreRefusedByTheDataListener) {
  TransportOptions options;
  options.tcp.secret = kSecret;
  auto group = make_loopback_group(2, options);
  tcp::Hello hello;
  hello.purpose = tcp::Purpose::data;
  hello.src_rank = 0;
  hello.dst_rank = 1;
  hello.world_size = 2;
  hello.lanes = static_cast<std::uint16_t>(options.tcp.connections_per_peer);
  hello.group_id = group[1]->group_id();
  const std::string problem = intrude(group[1]->listen_port(), hello, "not the secret");
  EXPECT_NE(problem.find("authentication failed"), std::string::npos) << problem;
  EXPECT_EQ(group[1]->refused_connections(), 1);
  expect_group_works(group);
}

TEST(TcpAuth, AStrangerDuringFormationDoesNotKeepTheRealPeerOut) {
  for (int attempt = 0;; ++attempt) {
    const std::vector<std::string> peers = testing::free_peer_list(2);
    const auto options_for = [&](int rank) {
      return testing::peer_list_options(peers, rank, kSecret, kTimeout);
    };
    // Rank 1 starts alone and waits for rank 0; a stranger gets to its listener first.
    std::unique_ptr<TcpTransport> rank1;
    std::exception_ptr rank1_error;
    std::thread starter([&] {
      try {
        rank1 = group::make_tcp_transport(options_for(1));
      } catch (...) {
        rank1_error = std::current_exception();
      }
    });
    const auto port = parse_peer_address(peers[1], "peers[1]").port;
    std::string problem;
    {
      asio::io_context io;
      tcp::Socket socket(io);
      // Connection attempts until rank 1 listens (refused meanwhile), as any client retries.
      const auto give_up = Clock::now() + kTimeout;
      boost::system::error_code error = asio::error::connection_refused;
      while (error && Clock::now() < give_up) {
        socket.close();
        socket.connect(tcp::Endpoint(asio::ip::make_address("127.0.0.1"), port), error);
        if (error) std::this_thread::yield();
      }
      ASSERT_FALSE(error) << error.message();
      socket.close();
    }
    tcp::Hello hello;
    hello.purpose = tcp::Purpose::data;
    hello.src_rank = 0;
    hello.dst_rank = 1;
    hello.world_size = 2;
    hello.lanes = 2;
    problem = intrude(port, hello, "wrong secret");
    EXPECT_NE(problem.find("authentication failed"), std::string::npos) << problem;
    // Now the real rank 0 arrives, and the group forms.
    std::unique_ptr<TcpTransport> rank0;
    try {
      rank0 = group::make_tcp_transport(options_for(0));
    } catch (const IoError&) {
      starter.join();
      if (attempt < 3) continue;  // rank 0's port was taken meanwhile
      throw;
    }
    starter.join();
    if (rank1_error) std::rethrow_exception(rank1_error);
    EXPECT_GE(rank1->refused_connections(), 1);
    std::vector<std::unique_ptr<TcpTransport>> group;
    group.push_back(std::move(rank0));
    group.push_back(std::move(rank1));
    expect_group_works(group);
    break;
  }
}

TEST(TcpAuth, AuthenticatedButUnwantedConnectionsAreRefusedWithAReason) {
  TransportOptions options;
  options.tcp.secret = kSecret;
  auto group = make_loopback_group(2, options);
  tcp::Hello hello;
  hello.purpose = tcp::Purpose::data;
  hello.src_rank = 0;
  hello.dst_rank = 1;
  hello.world_size = 2;
  hello.lanes = static_cast<std::uint16_t>(options.tcp.connections_per_peer);
  // A connection that already exists.
  hello.group_id = group[1]->group_id();
  EXPECT_NE(intrude(group[1]->listen_port(), hello, kSecret).find("already exists"),
            std::string::npos);
  // Another group of this job (e.g. a process left over from an earlier rendezvous).
  hello.group_id.back() ^= 1;
  EXPECT_NE(intrude(group[1]->listen_port(), hello, kSecret).find("another group"),
            std::string::npos);
  EXPECT_EQ(group[1]->refused_connections(), 2);
  expect_group_works(group);
}

TEST(TcpAuth, GarbageIsDroppedWithoutDisturbingTheGroup) {
  TransportOptions options;
  options.tcp.secret = kSecret;
  auto group = make_loopback_group(2, options);
  asio::io_context io;
  tcp::Socket socket(io);
  socket.connect(tcp::Endpoint(asio::ip::make_address("127.0.0.1"), group[0]->listen_port()));
  const std::string junk(tcp::kHelloBytes, 'x');
  asio::write(socket, asio::buffer(junk));
  std::array<char, 256> sink{};
  boost::system::error_code error;
  while (!error)
    (void)socket.read_some(asio::buffer(sink), error);
  EXPECT_EQ(group[0]->refused_connections(), 1);
  expect_group_works(group);
}

TEST(TcpAuth, TheRendezvousServerRefusesAWrongSecretAndCarriesOn) {
  group::RendezvousServer server("127.0.0.1", 0, 2, TcpOptions{.secret = kSecret},
                                 deadline_after(kTimeout));
  TransportOptions intruder = testing::loopback_options({}, 0, 2, server.port());
  intruder.tcp.secret = "guessed";
  intruder.connect_timeout = 10s;
  try {
    (void)group::environment_rendezvous(intruder, 4242);
    FAIL() << "a wrong secret must not register";
  } catch (const ProtocolError& error) {
    EXPECT_NE(std::string(error.what()).find("authentication failed"), std::string::npos)
        << error.what();
  }
  std::vector<std::unique_ptr<TcpTransport>> ranks(2);
  run_parallel(2, [&](int rank) {
    TransportOptions options = testing::loopback_options({}, rank, 2, server.port());
    options.tcp.secret = kSecret;
    ranks[static_cast<std::size_t>(rank)] = group::make_tcp_transport(options);
  });
  server.wait();
  EXPECT_EQ(server.refused_connections(), 1);
  expect_group_works(ranks);
}

// With the HMAC handshake alone, and with TLS keyed from the secrets.
class DifferentSecrets : public ::testing::TestWithParam<LinkSecurity> {};

INSTANTIATE_TEST_SUITE_P(TcpAuth, DifferentSecrets,
                         ::testing::Values(LinkSecurity::hmac, LinkSecurity::tls),
                         [](const auto& param_info) {
                           return testing::link_name(param_info.param);
                         });

TEST_P(DifferentSecrets, RanksDoNotConnectAndNameEachOther) {
  const auto failures = testing::failed_formation([&](const auto& peers, int rank) {
    auto options = testing::peer_list_options(peers, rank, rank == 0 ? "alpha" : "beta", 3s);
    options.tcp.link_security = GetParam();
    return options;
  });
  // Rank 0 connects and finds rank 1's proof wrong; rank 1 refuses rank 0 and gives up
  // waiting for it. Each names the other.
  EXPECT_NE(failures.what[0].find("authentication failed"), std::string::npos) << failures.what[0];
  EXPECT_NE(failures.what[1].find("could not connect to peers 0"), std::string::npos)
      << failures.what[1];
  EXPECT_EQ(failures.blamed[0], 1);
  EXPECT_EQ(failures.blamed[1], 0);
}

// The same secret, but one rank encrypts its links and the other does not (rank 0 with the
// parameter's security, rank 1 with the other).
class DifferentLinkSecurity : public ::testing::TestWithParam<LinkSecurity> {};

INSTANTIATE_TEST_SUITE_P(TcpAuth, DifferentLinkSecurity,
                         ::testing::Values(LinkSecurity::hmac, LinkSecurity::tls),
                         [](const auto& param_info) {
                           return testing::link_name(param_info.param);
                         });

TEST_P(DifferentLinkSecurity, RanksFailAtOnceNamingTheMismatch) {
  const auto failures = testing::failed_formation([&](const auto& peers, int rank) {
    auto options = testing::peer_list_options(peers, rank, kSecret, 3s);
    const bool as_parameter = rank == 0;
    options.tcp.link_security =
        as_parameter == (GetParam() == LinkSecurity::tls) ? LinkSecurity::tls : LinkSecurity::hmac;
    return options;
  });
  // Rank 0 dials rank 1, whose listener answers with its own security and closes: rank 0 fails
  // at its first attempt naming the mismatch and rank 1; rank 1 waits for rank 0 and names the
  // refusal when it gives up.
  EXPECT_NE(failures.what[0].find("link security differs"), std::string::npos) << failures.what[0];
  EXPECT_EQ(failures.blamed[0], 1);
  EXPECT_NE(failures.what[1].find("could not connect to peers 0"), std::string::npos)
      << failures.what[1];
  EXPECT_NE(failures.what[1].find("link security differs"), std::string::npos) << failures.what[1];
}

}  // namespace
}  // namespace pulseloco::transport
