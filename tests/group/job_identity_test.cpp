// Who may join a group: a server that would listen beyond loopback without a secret is refused;
// two jobs that share a port and a secret fail with an error naming both jobs instead of
// training together; a rank that arrives after its rendezvous failed is told why; a rank whose
// slot is taken is told who holds it; and rank 0 learns at once of an authenticated process of
// another world size, while a stranger that fails authentication cannot end its rendezvous (its
// timeout error names the stranger instead).
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <spdlog/sinks/ostream_sink.h>

#include <array>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <thread>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/group/rendezvous_messages.h>
#include <pulseloco/group/rendezvous_server.h>
#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/tcp/link_stream.h>
#include "transport/loopback_group.h"
#include "transport/refusing_port.h"
#include "transport/test_pki.h"

namespace pulseloco::group {
namespace {

using namespace std::chrono_literals;
using transport::deadline_after;
using transport::derive_job_id;
namespace asio = boost::asio;
namespace tcp = transport::tcp;

constexpr auto kTimeout = 30s;
constexpr const char* kSecret = "a secret two jobs share";

// What `run` threw: its kind and message (the test fails when it returned).
struct Failure {
  ErrorKind kind = ErrorKind::io;
  std::string what;
};

template <typename Run>
Failure failure_of(Run run) {
  try {
    run();
  } catch (const Error& error) {
    return {error.kind(), error.what()};
  }
  ADD_FAILURE() << "no error";
  return {};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string job(const std::string& run_id) {
  return transport::to_string(derive_job_id(kSecret, run_id));
}

// The link options of a rendezvous server: `secret`, and whether to listen beyond loopback
// without one.
transport::TcpOptions link(const std::string& secret, bool allow_insecure = false) {
  transport::TcpOptions options;
  options.secret = secret;
  options.allow_insecure = allow_insecure;
  return options;
}

TEST(SecureByDefault, ADataListenerBeyondLoopbackWithoutASecretIsRefusedSayingHowToSetOne) {
  TransportOptions options = transport::testing::peer_list_options(
      transport::testing::free_peer_list(2), 0, /*secret=*/"", kTimeout);
  options.tcp.listen_addr = "0.0.0.0";
  const Failure failure = failure_of([&] { (void)make_tcp_transport(options); });
  EXPECT_EQ(failure.kind, ErrorKind::invalid_argument);
  EXPECT_TRUE(contains(failure.what, "without a shared secret")) << failure.what;
  EXPECT_TRUE(contains(failure.what, "PULSELOCO_SECRET")) << failure.what;
  EXPECT_TRUE(contains(failure.what, "PULSELOCO_ALLOW_INSECURE=1")) << failure.what;
}

TEST(SecureByDefault, ARendezvousServerBeyondLoopbackWithoutASecretIsRefused) {
  const Failure failure = failure_of(
      [] { RendezvousServer server("0.0.0.0", 0, 2, link(""), deadline_after(kTimeout)); });
  EXPECT_EQ(failure.kind, ErrorKind::invalid_argument);
  EXPECT_TRUE(contains(failure.what, "rendezvous server: refusing to listen on 0.0.0.0"))
      << failure.what;
  // The explicit opt-in lets it listen (with a warning).
  RendezvousServer insecure("0.0.0.0", 0, 1, link("", /*allow_insecure=*/true),
                            deadline_after(kTimeout));
  EXPECT_NE(insecure.port(), 0);
}

// Certificates authenticate the links as a secret does: listening beyond loopback is allowed.
TEST(SecureByDefault, CertificatesWithoutASecretMayListenBeyondLoopback) {
  const transport::testing::TestPki pki;
  transport::TcpOptions options = link("");
  options.tls_files = pki.files("server");
  RendezvousServer server("0.0.0.0", 0, 1, options, deadline_after(kTimeout));
  EXPECT_NE(server.port(), 0);
}

TEST(SecureByDefault, ASingleHostGroupWithoutASecretListensOnLoopbackAndForms) {
  for (int attempt = 0;; ++attempt) {
    const auto peers = transport::testing::free_peer_list(2);
    try {
      std::vector<std::unique_ptr<transport::TcpTransport>> group(2);
      transport::testing::run_parallel(2, [&](int rank) {
        // No listen address and no secret: the peer list's loopback entry is where it listens.
        group[static_cast<std::size_t>(rank)] = make_tcp_transport(
            transport::testing::peer_list_options(peers, rank, /*secret=*/"", kTimeout));
      });
      EXPECT_EQ(group[1]->size(), 2);
      return;
    } catch (const IoError&) {
      if (attempt >= 3) throw;  // a port was taken meanwhile
    }
  }
}

// What the log says at warning level and above while a group of one forms from a peer list,
// listening on `listen_addr` ("" = where the peer list says: loopback) with `run_id`.
std::string warnings_forming_a_group(const std::string& listen_addr, const std::string& run_id) {
  std::ostringstream lines;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(lines);
  sink->set_level(spdlog::level::warn);
  logger().sinks().push_back(sink);
  for (int attempt = 0;; ++attempt) {
    TransportOptions options = transport::testing::peer_list_options(
        transport::testing::free_peer_list(1), 0, kSecret, kTimeout);
    options.tcp.listen_addr = listen_addr;
    options.run_id = run_id;
    try {
      (void)make_tcp_transport(options);
      break;
    } catch (const IoError&) {
      if (attempt >= 3) throw;  // a port was taken meanwhile
    }
  }
  logger().sinks().pop_back();
  return lines.str();
}

TEST(RunId, AGroupReachableBeyondLoopbackWithoutARunIdWarnsThatAnotherJobCouldJoinIt) {
  const std::string warnings = warnings_forming_a_group("0.0.0.0", "");
  EXPECT_TRUE(contains(warnings, "[warning]")) << warnings;
  EXPECT_TRUE(contains(warnings, "has no run id (PULSELOCO_RUN_ID)")) << warnings;
  EXPECT_TRUE(contains(warnings,
                       "a process of another job with the same secret and the peer "
                       "list can take one of its ranks"))
      << warnings;
}

TEST(RunId, AGroupWithARunIdOrOnLoopbackFormsWithoutThatWarning) {
  const std::string with_run_id = warnings_forming_a_group("0.0.0.0", "job-a");
  EXPECT_FALSE(contains(with_run_id, "PULSELOCO_RUN_ID")) << with_run_id;
  const std::string on_loopback = warnings_forming_a_group("", "");
  EXPECT_FALSE(contains(on_loopback, "PULSELOCO_RUN_ID")) << on_loopback;
}

// Fault: two jobs with the same secret and peer list. Job a's rank 0 reaches job b's rank 1
// (which listens where job a's rank 1 would): both fail naming both jobs.
TEST(JobIdentity, TwoJobsOnOnePeerListFailNamingBothJobsInsteadOfTrainingTogether) {
  for (int attempt = 0;; ++attempt) {
    const auto peers = transport::testing::free_peer_list(2);
    auto options_for = [&](int rank, const std::string& run_id) {
      TransportOptions options =
          transport::testing::peer_list_options(peers, rank, kSecret, kTimeout);
      options.run_id = run_id;
      return options;
    };
    auto job_b_rank_1 = std::async(std::launch::async, [&] {
      return failure_of([&] { (void)make_tcp_transport(options_for(1, "job-b")); });
    });
    const Failure job_a = failure_of([&] { (void)make_tcp_transport(options_for(0, "job-a")); });
    const Failure job_b = job_b_rank_1.get();
    if ((job_a.kind == ErrorKind::io || job_b.kind == ErrorKind::io) && attempt < 3)
      continue;  // a port was taken meanwhile
    const std::string both =
        fmt::format("it belongs to job {}, this is job {}", job("job-a"), job("job-b"));
    EXPECT_EQ(job_a.kind, ErrorKind::protocol) << job_a.what;
    EXPECT_TRUE(contains(job_a.what, both)) << job_a.what;
    EXPECT_EQ(job_b.kind, ErrorKind::protocol) << job_b.what;
    EXPECT_TRUE(contains(job_b.what, both)) << job_b.what;
    return;
  }
}

// Fault: two jobs with the same secret and master port. Job b's rank 1 registers with job a's
// rendezvous: it is refused naming both jobs, and the rendezvous fails with that reason. Job a's
// rank 0 is told the same whether it registered before the failure, was in its handshake then,
// or arrived afterwards (the server lingers for the rank's whole connect timeout here, so that
// no scheduling of the two threads can bring it after the port closed).
TEST(JobIdentity, TwoJobsOnOneRendezvousFailNamingBothJobsInsteadOfTrainingTogether) {
  RendezvousServer server("127.0.0.1", 0, 2, link(kSecret), deadline_after(kTimeout), "job-a",
                          /*linger=*/kTimeout);
  auto options_for = [&](int rank, const std::string& run_id) {
    TransportOptions options = transport::testing::loopback_options({}, rank, 2, server.port());
    options.tcp.secret = kSecret;
    options.run_id = run_id;
    options.connect_timeout = kTimeout;
    return options;
  };
  auto job_a_rank_0 = std::async(std::launch::async, [&] {
    return failure_of([&] { (void)environment_rendezvous(options_for(0, "job-a"), 4000); });
  });
  const Failure job_b =
      failure_of([&] { (void)environment_rendezvous(options_for(1, "job-b"), 4001); });
  const std::string both =
      fmt::format("it belongs to job {}, this is job {}", job("job-b"), job("job-a"));
  EXPECT_EQ(job_b.kind, ErrorKind::protocol) << job_b.what;
  EXPECT_TRUE(contains(job_b.what, both)) << job_b.what;
  const Failure job_a = job_a_rank_0.get();
  EXPECT_EQ(job_a.kind, ErrorKind::protocol) << job_a.what;
  EXPECT_TRUE(contains(job_a.what, both)) << job_a.what;
  const Failure server_failure = failure_of([&] { server.wait(); });
  EXPECT_EQ(server_failure.kind, ErrorKind::protocol);
  EXPECT_TRUE(contains(server_failure.what, both)) << server_failure.what;
}

// A failed rendezvous keeps answering: a rank of the job that arrives only after the failure is
// told its kind and reason at once, instead of meeting a closed port until its own timeout.
TEST(LateRanks, ARankArrivingAfterARefusalIsToldWhyTheRendezvousFailed) {
  RendezvousServer server("127.0.0.1", 0, 2, link(kSecret), deadline_after(kTimeout), "job-a",
                          /*linger=*/kTimeout);
  auto options_for = [&](int rank, const std::string& run_id) {
    TransportOptions options = transport::testing::loopback_options({}, rank, 2, server.port());
    options.tcp.secret = kSecret;
    options.run_id = run_id;
    options.connect_timeout = kTimeout;
    return options;
  };
  (void)failure_of([&] { (void)environment_rendezvous(options_for(1, "job-b"), 4001); });
  const Failure server_failure = failure_of([&] { server.wait(); });  // the rendezvous failed
  const std::string both =
      fmt::format("it belongs to job {}, this is job {}", job("job-b"), job("job-a"));
  ASSERT_TRUE(contains(server_failure.what, both)) << server_failure.what;

  const Failure late =
      failure_of([&] { (void)environment_rendezvous(options_for(0, "job-a"), 4000); });
  EXPECT_EQ(late.kind, ErrorKind::protocol) << late.what;
  EXPECT_TRUE(contains(late.what, both)) << late.what;
  EXPECT_FALSE(contains(late.what, "could not register")) << late.what;
}

TEST(LateRanks, ARankArrivingAfterTheDeadlineIsToldWhichRanksWereMissing) {
  RendezvousServer server("127.0.0.1", 0, 2, link(kSecret), deadline_after(100ms), "job-a",
                          /*linger=*/kTimeout);
  auto options_for = [&](int rank, const std::string& run_id) {
    TransportOptions options = transport::testing::loopback_options({}, rank, 2, server.port());
    options.tcp.secret = kSecret;
    options.run_id = run_id;
    options.connect_timeout = kTimeout;
    return options;
  };
  const Failure server_failure = failure_of([&] { server.wait(); });  // nobody came in time
  ASSERT_EQ(server_failure.kind, ErrorKind::timeout) << server_failure.what;

  const Failure late =
      failure_of([&] { (void)environment_rendezvous(options_for(1, "job-a"), 4001); });
  EXPECT_EQ(late.kind, ErrorKind::timeout) << late.what;
  EXPECT_TRUE(contains(late.what, "ranks 0, 1 did not register in time")) << late.what;
  EXPECT_FALSE(contains(late.what, "could not register")) << late.what;
  // A process of another job is still refused for what it is.
  const Failure stranger =
      failure_of([&] { (void)environment_rendezvous(options_for(0, "job-b"), 4000); });
  EXPECT_EQ(stranger.kind, ErrorKind::protocol) << stranger.what;
  EXPECT_TRUE(contains(stranger.what, fmt::format("it belongs to job {}, this is job {}",
                                                  job("job-b"), job("job-a"))))
      << stranger.what;
}

// The linger ends as soon as every rank of the job has been told: the port closes then, however
// long the linger (an hour here; ctest's timeout would end the test long before it passed).
TEST(LateRanks, AFailedServerStopsListeningOnceEveryRankWasTold) {
  RendezvousServer server("127.0.0.1", 0, 2, link(kSecret), deadline_after(100ms), "job-a",
                          /*linger=*/std::chrono::hours(1));
  auto options_for = [&](int rank) {
    TransportOptions options = transport::testing::loopback_options({}, rank, 2, server.port());
    options.tcp.secret = kSecret;
    options.run_id = "job-a";
    options.connect_timeout = kTimeout;
    return options;
  };
  (void)failure_of([&] { server.wait(); });
  for (int rank = 0; rank < 2; ++rank) {
    const Failure late =
        failure_of([&] { (void)environment_rendezvous(options_for(rank), 4000 + rank); });
    EXPECT_EQ(late.kind, ErrorKind::timeout) << late.what;
    EXPECT_TRUE(contains(late.what, "did not register in time")) << late.what;
  }
  server.wait_closed();
}

// After the linger the port is closed: a rank arriving then meets it closed.
TEST(LateRanks, AfterTheLingerTheServerNoLongerListens) {
  RendezvousServer server("127.0.0.1", 0, 2, link(kSecret), deadline_after(100ms), "job-a",
                          /*linger=*/0ms);
  (void)failure_of([&] { server.wait(); });
  server.wait_closed();
  // Held from here on, so that no listener of another test takes the closed port meanwhile.
  const pulseloco::testing::RefusingPort closed(server.port());
  if (!closed.bound()) GTEST_SKIP() << "another process took port " << server.port();
  TransportOptions options = transport::testing::loopback_options({}, 1, 2, server.port());
  options.tcp.secret = kSecret;
  options.run_id = "job-a";
  options.connect_timeout = 300ms;
  const Failure late = failure_of([&] { (void)environment_rendezvous(options, 4001); });
  EXPECT_EQ(late.kind, ErrorKind::timeout) << late.what;
  EXPECT_TRUE(contains(late.what, "could not register with the server")) << late.what;
}

// Fault: a client registering first took rank 1 (no secret: a single-host run on loopback), and
// the real rank 1 later failed with "Connection refused". Now it is told at once who holds it.
TEST(JobIdentity, ARankWhoseSlotIsTakenIsToldWhichAddressHoldsIt) {
  RendezvousServer server("127.0.0.1", 0, 2, link(""), deadline_after(kTimeout));
  // The stranger: a handshake claiming rank 1 and a registration, then it waits for the table.
  asio::io_context io;
  auto socket = std::make_shared<tcp::Socket>(io);
  socket->connect(tcp::Endpoint(asio::ip::make_address("127.0.0.1"), server.port()));
  tcp::LinkStream stranger(socket, nullptr);  // no secret: a plain link
  tcp::Hello hello;
  hello.purpose = tcp::Purpose::rendezvous;
  hello.src_rank = 1;
  hello.world_size = 2;
  hello.group_id = transport::job_only_group_id(derive_job_id("", ""));
  auto handshake = asio::co_spawn(io, tcp::client_handshake(stranger, hello, ""), asio::use_future);
  io.run();
  (void)handshake.get();  // accepted: rank 1 is now claimed by the stranger
  asio::write(*socket, asio::buffer(encode_registration({"127.0.0.1", 4999})));
  const std::string holder = fmt::format("127.0.0.1:{}", socket->local_endpoint().port());

  TransportOptions real = transport::testing::loopback_options({}, 1, 2, server.port());
  real.connect_timeout = kTimeout;
  const Failure failure = failure_of([&] { (void)environment_rendezvous(real, 4001); });
  EXPECT_EQ(failure.kind, ErrorKind::protocol) << failure.what;
  EXPECT_TRUE(
      contains(failure.what, fmt::format("rank 1 is taken: {} registered it first", holder)))
      << failure.what;
  // Nobody trains with the stranger either: the rendezvous has failed.
  const Failure server_failure = failure_of([&] { server.wait(); });
  EXPECT_EQ(server_failure.kind, ErrorKind::protocol);
  EXPECT_TRUE(contains(server_failure.what, "rank 1 is taken")) << server_failure.what;
}

TEST(RendezvousFailures, RankZeroFailsNamingAnAuthenticatedRankOfAnotherWorldSize) {
  const std::uint16_t port = transport::testing::pick_free_port();
  auto options_for = [&](int rank, int world_size) {
    TransportOptions options = transport::testing::loopback_options({}, rank, world_size, port);
    options.external_rendezvous_server = false;  // rank 0 hosts it
    options.tcp.secret = kSecret;
    options.connect_timeout = kTimeout;
    return options;
  };
  auto rank_0 = std::async(std::launch::async, [&] {
    return failure_of([&] { (void)environment_rendezvous(options_for(0, 2), 4000); });
  });
  // Retries until rank 0's server listens, then is refused.
  const Failure rank_1 = failure_of([&] { (void)environment_rendezvous(options_for(1, 3), 4001); });
  EXPECT_EQ(rank_1.kind, ErrorKind::protocol) << rank_1.what;
  EXPECT_TRUE(contains(rank_1.what, "its world size 3 differs from this rendezvous's 2"))
      << rank_1.what;
  const Failure failure = rank_0.get();
  EXPECT_EQ(failure.kind, ErrorKind::protocol) << failure.what;
  EXPECT_TRUE(contains(failure.what, "claiming rank 1: its world size 3 differs")) << failure.what;
}

TEST(RendezvousFailures, AWrongSecretCannotEndRankZerosRendezvousButItsTimeoutNamesIt) {
  const std::uint16_t port = transport::testing::pick_free_port();
  auto options_for = [&](int rank, const std::string& secret, std::chrono::milliseconds timeout) {
    TransportOptions options = transport::testing::loopback_options({}, rank, 2, port);
    options.external_rendezvous_server = false;  // rank 0 hosts it
    options.tcp.secret = secret;
    options.connect_timeout = timeout;
    return options;
  };
  // Rank 0 waits a few seconds for rank 1, which never comes.
  auto rank_0 = std::async(std::launch::async, [&] {
    return failure_of([&] { (void)environment_rendezvous(options_for(0, kSecret, 4s), 4000); });
  });
  const Failure stranger = failure_of(
      [&] { (void)environment_rendezvous(options_for(1, "a guessed secret", kTimeout), 4001); });
  EXPECT_TRUE(contains(stranger.what, "authentication failed")) << stranger.what;
  const Failure failure = rank_0.get();
  EXPECT_EQ(failure.kind, ErrorKind::timeout) << failure.what;
  EXPECT_TRUE(contains(failure.what, "rank 1 did not register")) << failure.what;
  EXPECT_TRUE(contains(failure.what, "refused in the meantime: 127.0.0.1:")) << failure.what;
  // Under TLS the wrong key is refused before the hello names a rank.
  EXPECT_TRUE(contains(failure.what, "failed authentication")) << failure.what;
}

}  // namespace
}  // namespace pulseloco::group
