// Elastic membership (elastic/coordinator.h, membership_client.h): an in-process coordinator and
// workers on threads over loopback. Generations form, lose and admit workers; boundary answers
// agree; stalled members are removed; the run stops below the minimum and ends when everyone left;
// strangers, wrong secrets, taken ids and garbage never disturb the others. Every wait is bounded
// by a deadline and synchronised on replies or on the coordinator's counters, never on sleeps.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <poll.h>
#include <spdlog/sinks/ostream_sink.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/elastic/coordinator.h>
#include <pulseloco/elastic/membership_client.h>
#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/tcp/tls_context.h>
#include "base/log_capture.h"
#include "transport/refusing_port.h"
#include "transport/test_pki.h"

namespace pulseloco::elastic {
namespace {

using namespace std::chrono_literals;
namespace asio = boost::asio;
namespace tcp = transport::tcp;
using transport::Clock;
using transport::deadline_after;
using transport::PeerAddress;
using Json = nlohmann::json;

constexpr auto kTimeout = 30s;
constexpr const char* kSecret = "the membership secret";

CoordinatorOptions coordinator_options(int initial, int min_workers = 1) {
  CoordinatorOptions options;
  options.host = "127.0.0.1";
  options.port = 0;
  options.initial_workers = initial;
  options.min_workers = min_workers;
  options.secret = kSecret;
  return options;
}

std::unique_ptr<MembershipClient> connect(const Coordinator& coordinator, const std::string& id,
                                          const std::string& secret = kSecret) {
  MembershipClientOptions options;
  options.coordinator = "127.0.0.1:" + std::to_string(coordinator.port());
  options.worker_id = id;
  options.data_address = PeerAddress{
      "127.0.0.1", static_cast<std::uint16_t>(20000 + std::hash<std::string>{}(id) % 1000)};
  options.secret = secret;
  options.connect_timeout = kTimeout;
  return std::make_unique<MembershipClient>(options);
}

std::future<GroupAssignment> ask(MembershipClient& client, std::string reason) {
  return std::async(std::launch::async, [&client, reason = std::move(reason)] {
    return client.next_group(reason, deadline_after(kTimeout));
  });
}

// Waits (bounded) until `condition` holds; the coordinator's counters change on its own thread.
template <typename Condition>
bool eventually(Condition condition) {
  const auto give_up = Clock::now() + kTimeout;
  while (!condition()) {
    if (Clock::now() > give_up) return false;
    std::this_thread::yield();
  }
  return true;
}

// Every client asks for a group at once; returns the assignments in the clients' order.
std::vector<GroupAssignment> next_generation(const std::vector<MembershipClient*>& clients,
                                             const std::string& reason) {
  std::vector<std::future<GroupAssignment>> futures;
  for (auto* client : clients)
    futures.push_back(ask(*client, reason));
  std::vector<GroupAssignment> groups;
  for (auto& future : futures)
    groups.push_back(future.get());
  return groups;
}

// Checks that `groups` describe one generation consistently; returns its member ids.
std::vector<std::string> expect_consistent(const std::vector<GroupAssignment>& groups) {
  EXPECT_FALSE(groups.empty());
  const auto& first = groups.front();
  std::set<int> ranks;
  for (const auto& group : groups) {
    EXPECT_EQ(group.generation, first.generation);
    EXPECT_EQ(group.worker_ids, first.worker_ids);
    EXPECT_EQ(group.peers, first.peers);
    EXPECT_EQ(group.group_key, first.group_key);
    EXPECT_EQ(group.joined, first.joined);
    EXPECT_EQ(group.lost, first.lost);
    EXPECT_EQ(group.peers.size(), group.worker_ids.size());
    ranks.insert(group.rank);
  }
  EXPECT_EQ(ranks.size(), groups.size());
  return first.worker_ids;
}

std::string id_of(const GroupAssignment& group) {
  return group.worker_ids.at(static_cast<std::size_t>(group.rank));
}

// A connection to the coordinator driven byte by byte, for the misbehaving-peer tests; secured
// as a worker with `secret` secures its own.
class RawConnection {
 public:
  RawConnection(std::uint16_t port, const std::string& secret,
                tcp::Purpose purpose = tcp::Purpose::membership)
      : socket_(connected(io_, port)),
        link_(socket_, tcp::TlsContext::make(transport::LinkSecurity::automatic, secret, {})) {
    tcp::Hello hello;
    hello.purpose = purpose;
    hello.group_id = transport::job_only_group_id(transport::derive_job_id(secret, ""));
    auto outcome =
        asio::co_spawn(io_, tcp::client_handshake(link_, hello, secret), asio::use_future);
    io_.run();
    try {
      (void)outcome.get();
    } catch (const std::exception& error) {
      handshake_problem_ = error.what();
    }
  }
  // Connects without TLS or a handshake.
  explicit RawConnection(std::uint16_t port)
      : socket_(connected(io_, port)), link_(socket_, nullptr) {}

  [[nodiscard]] const std::string& handshake_problem() const { return handshake_problem_; }

  void send_bytes(const std::string& bytes) {
    asio::async_write(link_, asio::buffer(bytes),
                      [](const boost::system::error_code&, std::size_t) {});
    io_.restart();
    io_.run();
  }
  void send_frame(const std::string& body) {
    std::string frame(4, '\0');
    for (int i = 0; i < 4; ++i)
      frame[static_cast<std::size_t>(i)] = static_cast<char>(body.size() >> (8 * i));
    send_bytes(frame + body);
  }
  void send_json(const Json& message) { send_frame(message.dump()); }

  // The next message; nullopt when the connection closed or the deadline passed.
  std::optional<Json> receive() {
    while (buffer_.size() < 4 || buffer_.size() < 4 + length()) {
      if (!fill()) return std::nullopt;
    }
    const std::size_t n = length();
    Json message = Json::parse(buffer_.substr(4, n));
    buffer_.erase(0, 4 + n);
    return message;
  }

  // True once the coordinator has closed the connection (within the test timeout).
  bool closed_by_peer() {
    while (fill()) {
    }
    return eof_;
  }

 private:
  static std::shared_ptr<tcp::Socket> connected(asio::io_context& io, std::uint16_t port) {
    auto socket = std::make_shared<tcp::Socket>(io);
    socket->connect(tcp::Endpoint(asio::ip::make_address("127.0.0.1"), port));
    return socket;
  }

  std::size_t length() const {
    std::uint32_t n = 0;
    for (int i = 3; i >= 0; --i)
      n = (n << 8) | static_cast<std::uint8_t>(buffer_[static_cast<std::size_t>(i)]);
    return n;
  }
  // Reads what arrives (bounded by the test timeout); false at end of stream or deadline.
  bool fill() {
    std::array<char, 4096> chunk{};
    bool done = false;
    boost::system::error_code error;
    std::size_t n = 0;
    link_.async_read_some(asio::buffer(chunk),
                          [&](const boost::system::error_code& result, std::size_t received) {
                            error = result;
                            n = received;
                            done = true;
                          });
    io_.restart();
    io_.run_for(kTimeout);
    if (!done) {
      boost::system::error_code ignored;
      socket_->cancel(ignored);
      io_.restart();
      io_.run();
      return false;
    }
    if (error || n == 0) {
      eof_ = true;
      return false;
    }
    buffer_.append(chunk.data(), n);
    return true;
  }

  asio::io_context io_;
  std::shared_ptr<tcp::Socket> socket_;
  tcp::LinkStream link_;
  std::string handshake_problem_;
  std::string buffer_;
  bool eof_ = false;
};

TEST(Membership, TheFirstGenerationFormsOnceTheInitialWorkersWait) {
  Coordinator coordinator(coordinator_options(3));
  EXPECT_EQ(coordinator.generation(), 0u);
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  auto c = connect(coordinator, "c");
  // Alone, `a` is not placed; the timeout names the coordinator and leaves its request queued.
  try {
    (void)a->next_group("join", deadline_after(100ms));
    FAIL() << "a group formed with one of three initial workers waiting";
  } catch (const TimeoutError& error) {
    EXPECT_NE(std::string(error.what()).find("127.0.0.1:"), std::string::npos) << error.what();
  }
  ASSERT_TRUE(eventually([&] { return coordinator.waiting_workers() == 1; }));
  const auto groups = next_generation({a.get(), b.get(), c.get()}, "join");
  const auto ids = expect_consistent(groups);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()), (std::set<std::string>{"a", "b", "c"}));
  const std::vector<std::string> names = {"a", "b", "c"};
  for (std::size_t i = 0; i < groups.size(); ++i) {
    EXPECT_EQ(groups[i].generation, 1u);
    EXPECT_EQ(id_of(groups[i]), names[i]);
    EXPECT_EQ(groups[i].peers[static_cast<std::size_t>(groups[i].rank)].port,
              static_cast<std::uint16_t>(20000 + std::hash<std::string>{}(names[i]) % 1000));
    EXPECT_EQ(groups[i].joined, ids);  // everyone is new in generation 1
    EXPECT_TRUE(groups[i].lost.empty());
    EXPECT_FALSE(groups[i].group_key.empty());
  }
  EXPECT_EQ(coordinator.generation(), 1u);
  EXPECT_EQ(coordinator.waiting_workers(), 0);
}

TEST(Membership, ALostMemberIsLeftOutAndTheSurvivorsKeepTheirOrder) {
  Coordinator coordinator(coordinator_options(3, 2));
  std::vector<std::unique_ptr<MembershipClient>> clients;
  for (const char* id : {"w0", "w1", "w2"})
    clients.push_back(connect(coordinator, id));
  const auto first =
      next_generation({clients[0].get(), clients[1].get(), clients[2].get()}, "join");
  const auto ids = expect_consistent(first);
  // The worker of rank 1 dies (its connection closes); the other two saw their collective fail.
  std::size_t victim = 0;
  for (std::size_t i = 0; i < first.size(); ++i)
    if (first[i].rank == 1) victim = i;
  const std::string lost_id = id_of(first[victim]);
  clients[victim].reset();
  std::vector<MembershipClient*> survivors;
  for (auto& client : clients)
    if (client) survivors.push_back(client.get());
  const auto second = next_generation(survivors, "the collective of window 7 failed");
  const auto new_ids = expect_consistent(second);
  EXPECT_EQ(new_ids, (std::vector<std::string>{ids[0], ids[2]}));  // rank order kept
  for (const auto& group : second) {
    EXPECT_EQ(group.generation, 2u);
    EXPECT_EQ(group.lost, std::vector<std::string>{lost_id});
    EXPECT_TRUE(group.joined.empty());
    EXPECT_NE(group.group_key, first[0].group_key);  // a fresh key per generation
  }
  // Ranks are renumbered 0..n-1 in the old order.
  for (const auto& group : second)
    EXPECT_EQ(group.rank, id_of(group) == ids[0] ? 0 : 1);
  EXPECT_EQ(coordinator.generation(), 2u);
}

TEST(Membership, AJoinerIsAdmittedAtABoundaryAndEveryMemberGetsTheSameAnswer) {
  Coordinator coordinator(coordinator_options(2));
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  const auto first = next_generation({a.get(), b.get()}, "join");
  const auto ids = expect_consistent(first);
  const auto deadline = [] { return deadline_after(kTimeout); };
  EXPECT_FALSE(a->boundary(1, deadline()));  // nobody waits: decided "no" for window 1
  auto c = connect(coordinator, "c");
  auto joined = ask(*c, "join");
  ASSERT_TRUE(eventually([&] { return coordinator.waiting_workers() == 1; }));
  // Window 1 was decided before `c` arrived: `b` gets the same answer as `a`.
  EXPECT_FALSE(b->boundary(1, deadline()));
  EXPECT_TRUE(b->boundary(2, deadline()));
  EXPECT_TRUE(a->boundary(2, deadline()));
  auto members = next_generation({a.get(), b.get()}, "admit joiners");
  members.push_back(joined.get());
  const auto new_ids = expect_consistent(members);
  EXPECT_EQ(new_ids, (std::vector<std::string>{ids[0], ids[1], "c"}));
  EXPECT_EQ(members[2].rank, 2);
  EXPECT_EQ(members[2].generation, 2u);
  EXPECT_EQ(members[2].joined, std::vector<std::string>{"c"});
  EXPECT_TRUE(members[2].lost.empty());
  EXPECT_EQ(coordinator.waiting_workers(), 0);
}

TEST(Membership, JoinEveryThreeWindowsAdmitsOnlyAtMultiplesOfThree) {
  auto options = coordinator_options(2);
  options.join_every_windows = 3;
  Coordinator coordinator(options);
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  (void)next_generation({a.get(), b.get()}, "join");
  auto c = connect(coordinator, "c");
  auto joined = ask(*c, "join");
  ASSERT_TRUE(eventually([&] { return coordinator.waiting_workers() == 1; }));
  for (std::uint64_t window = 1; window <= 2; ++window) {
    EXPECT_FALSE(a->boundary(window, deadline_after(kTimeout))) << "window " << window;
    EXPECT_FALSE(b->boundary(window, deadline_after(kTimeout))) << "window " << window;
  }
  EXPECT_TRUE(b->boundary(3, deadline_after(kTimeout)));
  EXPECT_TRUE(a->boundary(3, deadline_after(kTimeout)));
  (void)next_generation({a.get(), b.get()}, "admit joiners");
  EXPECT_EQ(joined.get().size(), 3);
}

TEST(Membership, AFullGroupAdmitsJoinersOnlyWhenAPlaceFreesUp) {
  auto options = coordinator_options(2);
  options.max_workers = 2;
  Coordinator coordinator(options);
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  const auto ids = expect_consistent(next_generation({a.get(), b.get()}, "join"));
  auto c = connect(coordinator, "c");
  auto joined = ask(*c, "join");
  ASSERT_TRUE(eventually([&] { return coordinator.waiting_workers() == 1; }));
  EXPECT_FALSE(a->boundary(1, deadline_after(kTimeout)));  // no room
  EXPECT_FALSE(b->boundary(1, deadline_after(kTimeout)));
  // `a` dies: at the regroup after the failure, `c` takes its place.
  const std::string lost_id = "a";
  a.reset();
  auto members = next_generation({b.get()}, "peer lost");
  members.push_back(joined.get());
  EXPECT_EQ(expect_consistent(members), (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(members[0].lost, std::vector<std::string>{lost_id});
  EXPECT_EQ(members[0].joined, std::vector<std::string>{"c"});
}

TEST(Membership, AMemberThatDoesNotAskWithinTheRegroupTimeoutIsRemoved) {
  auto options = coordinator_options(3, 2);
  // `a` and `b` ask on threads of their own and must both ask within this of a regroup's
  // trigger, also on a loaded machine; only `stalled` misses it (the test waits it out once).
  options.regroup_timeout = 5s;
  Coordinator coordinator(options);
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  auto stalled = connect(coordinator, "stalled");
  const auto first = next_generation({a.get(), b.get(), stalled.get()}, "join");
  expect_consistent(first);
  // `stalled` keeps its connection but never asks (a stalled or partitioned worker).
  const auto second = next_generation({a.get(), b.get()}, "the collective timed out");
  EXPECT_EQ(expect_consistent(second).size(), 2u);
  EXPECT_EQ(second[0].lost, std::vector<std::string>{"stalled"});
  EXPECT_EQ(second[0].generation, 2u);
  try {
    (void)stalled->next_group("late", deadline_after(kTimeout));
    FAIL() << "a removed worker was placed";
  } catch (const MembershipError& error) {
    EXPECT_NE(std::string(error.what()).find("removed from the group at generation 1"),
              std::string::npos)
        << error.what();
  }
  EXPECT_THROW((void)stalled->boundary(9, deadline_after(kTimeout)), MembershipError);
  // It may come back as a new worker under its id, on a new connection.
  auto returning = connect(coordinator, "stalled");
  auto joined = ask(*returning, "rejoin");
  ASSERT_TRUE(eventually([&] { return coordinator.waiting_workers() == 1; }));
  EXPECT_TRUE(a->boundary(4, deadline_after(kTimeout)));
  EXPECT_TRUE(b->boundary(4, deadline_after(kTimeout)));
  (void)next_generation({a.get(), b.get()}, "admit");
  const auto third = joined.get();
  EXPECT_EQ(third.generation, 3u);
  EXPECT_EQ(third.joined, std::vector<std::string>{"stalled"});
}

// A regroup that waits for a member names it while it waits (on the coordinator), and each
// waiting worker says that it waits (PULSELOCO_WAIT_LOG_SECONDS); the test lets the late member
// ask once both lines appeared, and it is placed with the others.
TEST(Membership, ARegroupWaitingForAMemberNamesItWhileItWaits) {
  ::setenv("PULSELOCO_WAIT_LOG_SECONDS", "0.1", 1);
  const pulseloco::testing::LogCapture log(spdlog::level::warn);
  auto options = coordinator_options(3);
  options.regroup_timeout = kTimeout;
  Coordinator coordinator(options);
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  auto late = connect(coordinator, "late");
  (void)next_generation({a.get(), b.get(), late.get()}, "join");
  auto a_next = ask(*a, "the collective failed");
  auto b_next = ask(*b, "the collective failed");
  const bool late_named = log.wait_for("for worker late to ask for the next group", kTimeout);
  const bool a_said_it_waits = log.wait_for("membership: worker a has waited", kTimeout);
  const GroupAssignment late_group =
      late->next_group("the collective failed", deadline_after(kTimeout));
  const GroupAssignment a_group = a_next.get();
  (void)b_next.get();
  ::unsetenv("PULSELOCO_WAIT_LOG_SECONDS");
  EXPECT_TRUE(late_named) << log.text();
  EXPECT_TRUE(a_said_it_waits) << log.text();
  EXPECT_EQ(late_group.generation, 2u);
  EXPECT_EQ(a_group.generation, 2u);
  EXPECT_TRUE(late_group.lost.empty());
}

TEST(Membership, FallingBelowTheMinimumStopsTheRun) {
  Coordinator coordinator(coordinator_options(2, 2));
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  (void)next_generation({a.get(), b.get()}, "join");
  b.reset();
  try {
    (void)a->next_group("peer lost", deadline_after(kTimeout));
    FAIL() << "a group of one formed with a minimum of two";
  } catch (const MembershipError& error) {
    EXPECT_NE(std::string(error.what()).find("the group fell to 1 worker, below the minimum 2"),
              std::string::npos)
        << error.what();
  }
  try {
    coordinator.wait();
    FAIL() << "wait() returned after the run stopped";
  } catch (const MembershipError& error) {
    EXPECT_NE(std::string(error.what()).find("below the minimum 2"), std::string::npos);
  }
  // Later requests get the same answer.
  EXPECT_THROW((void)a->next_group("again", deadline_after(kTimeout)), MembershipError);
  auto late = connect(coordinator, "late");
  EXPECT_THROW((void)late->next_group("join", deadline_after(kTimeout)), MembershipError);
}

TEST(Membership, ACoordinatorBeyondLoopbackWithoutASecretIsRefusedUnlessInsecureIsAsked) {
  CoordinatorOptions options = coordinator_options(1);
  options.host = "0.0.0.0";
  options.secret.clear();
  try {
    Coordinator refused(options);
    FAIL() << "the coordinator listened on every interface without a secret";
  } catch (const InvalidArgument& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("membership coordinator: refusing to listen on 0.0.0.0"), std::string::npos)
        << what;
    EXPECT_NE(what.find("PULSELOCO_SECRET"), std::string::npos) << what;
    EXPECT_NE(what.find("--insecure"), std::string::npos) << what;
  }
  options.allow_insecure = true;
  Coordinator insecure(options);
  EXPECT_NE(insecure.port(), 0);
}

TEST(Membership, AWorkerOfAnotherJobIsRefusedNamingBothJobs) {
  CoordinatorOptions options = coordinator_options(1);
  options.run_id = "job-a";
  Coordinator coordinator(options);
  MembershipClientOptions worker;
  worker.coordinator = "127.0.0.1:" + std::to_string(coordinator.port());
  worker.worker_id = "of-job-b";
  worker.data_address = PeerAddress{"127.0.0.1", 20999};
  worker.secret = kSecret;
  worker.run_id = "job-b";
  worker.connect_timeout = kTimeout;
  try {
    MembershipClient client(worker);
    FAIL() << "a worker of another job registered";
  } catch (const ProtocolError& error) {
    const std::string both =
        fmt::format("it belongs to job {}, this is job {}",
                    transport::to_string(transport::derive_job_id(kSecret, "job-b")),
                    transport::to_string(transport::derive_job_id(kSecret, "job-a")));
    EXPECT_NE(std::string(error.what()).find(both), std::string::npos) << error.what();
  }
  EXPECT_TRUE(eventually([&] { return coordinator.refused_connections() == 1; }));
  worker.run_id = "job-a";
  MembershipClient same_job(worker);
}

TEST(Membership, WrongSecretsAndStrangersAreRefusedWithoutDisturbingTheRun) {
  Coordinator coordinator(coordinator_options(2));
  try {
    (void)connect(coordinator, "impostor", "not the secret");
    FAIL() << "a worker with the wrong secret registered";
  } catch (const ProtocolError& error) {
    EXPECT_NE(std::string(error.what()).find("authentication failed"), std::string::npos)
        << error.what();
  }
  {
    // The right secret, but a data-plane connection.
    RawConnection wrong_purpose(coordinator.port(), kSecret, tcp::Purpose::data);
    EXPECT_NE(wrong_purpose.handshake_problem().find("not a rendezvous server or a data listener"),
              std::string::npos)
        << wrong_purpose.handshake_problem();
    EXPECT_TRUE(wrong_purpose.closed_by_peer());
  }
  {
    RawConnection stranger(coordinator.port());
    stranger.send_bytes(std::string(80, 'x'));  // a hello without the magic
    EXPECT_TRUE(stranger.closed_by_peer());
  }
  ASSERT_TRUE(eventually([&] { return coordinator.refused_connections() == 3; }));
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  EXPECT_EQ(expect_consistent(next_generation({a.get(), b.get()}, "join")).size(), 2u);
  EXPECT_EQ(coordinator.refused_connections(), 3);
}

TEST(Membership, CertificatesAuthenticateTheWorkersAndTheCoordinator) {
  const transport::testing::TestPki pki;
  CoordinatorOptions options = coordinator_options(2);
  options.secret.clear();
  options.tls_files = pki.files("server");
  Coordinator coordinator(options);
  const auto connect_with = [&](const std::string& id, const std::string& certificate) {
    MembershipClientOptions client;
    client.coordinator = "127.0.0.1:" + std::to_string(coordinator.port());
    client.worker_id = id;
    client.data_address = PeerAddress{"127.0.0.1", 9};
    client.tls_files = pki.files(certificate);
    client.connect_timeout = kTimeout;
    return std::make_unique<MembershipClient>(client);
  };
  try {
    (void)connect_with("stranger", "stranger");  // signed by another CA
    FAIL() << "a worker with a certificate from another CA registered";
  } catch (const ProtocolError& error) {
    EXPECT_NE(std::string(error.what()).find("authentication failed"), std::string::npos)
        << error.what();
  }
  ASSERT_TRUE(eventually([&] { return coordinator.refused_connections() == 1; }));
  auto a = connect_with("a", "rank0");
  auto b = connect_with("b", "rank1");
  EXPECT_EQ(expect_consistent(next_generation({a.get(), b.get()}, "join")).size(), 2u);
  EXPECT_EQ(coordinator.refused_connections(), 1);
}

TEST(Membership, ATakenWorkerIdIsRefused) {
  Coordinator coordinator(coordinator_options(2));
  auto a = connect(coordinator, "a");
  try {
    (void)connect(coordinator, "a");
    FAIL() << "a second live worker registered as 'a'";
  } catch (const ProtocolError& error) {
    EXPECT_NE(std::string(error.what()).find("worker id 'a' is taken"), std::string::npos)
        << error.what();
  }
  EXPECT_EQ(coordinator.refused_connections(), 1);
  auto b = connect(coordinator, "b");
  const auto ids = expect_consistent(next_generation({a.get(), b.get()}, "join"));
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()), (std::set<std::string>{"a", "b"}));
}

TEST(Membership, GarbageAndOversizedMessagesOnlyCostTheirSender) {
  Coordinator coordinator(coordinator_options(3, 2));
  {
    RawConnection oversized(coordinator.port(), kSecret);
    ASSERT_EQ(oversized.handshake_problem(), "");
    oversized.send_bytes(std::string(4, '\xff'));  // announces a 4 GiB message
    EXPECT_TRUE(oversized.closed_by_peer());
  }
  {
    RawConnection garbage(coordinator.port(), kSecret);
    garbage.send_frame("this is not JSON");
    EXPECT_TRUE(garbage.closed_by_peer());
  }
  EXPECT_EQ(coordinator.refused_connections(), 2);  // neither registered

  // A registered member that turns to garbage is treated as lost.
  RawConnection intruder(coordinator.port(), kSecret);
  intruder.send_json(
      {{"type", "register"}, {"worker_id", "intruder"}, {"data_host", ""}, {"data_port", 9}});
  const auto registered = intruder.receive();
  ASSERT_TRUE(registered);
  EXPECT_EQ((*registered)["type"], "registered");
  intruder.send_json({{"type", "next_group"}, {"reason", "join"}});
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  auto first_a = ask(*a, "join");
  auto first_b = ask(*b, "join");
  const auto group = intruder.receive();
  ASSERT_TRUE(group);
  EXPECT_EQ((*group)["type"], "group");
  EXPECT_EQ((*group)["generation"], 1);
  // The wildcard data host was replaced by the connection's address.
  const auto rank = (*group)["rank"].get<std::size_t>();
  EXPECT_EQ((*group)["workers"][rank]["host"], "127.0.0.1");
  EXPECT_EQ(first_a.get().size(), 3);
  EXPECT_EQ(first_b.get().size(), 3);
  intruder.send_json({{"type", "dance"}});
  EXPECT_TRUE(intruder.closed_by_peer());
  const auto second = next_generation({a.get(), b.get()}, "peer lost");
  EXPECT_EQ(expect_consistent(second).size(), 2u);
  EXPECT_EQ(second[0].lost, std::vector<std::string>{"intruder"});
  EXPECT_EQ(coordinator.refused_connections(), 2);
}

TEST(Membership, LeavingEndsTheRunAndTurnsAwayWaitingWorkers) {
  Coordinator coordinator(coordinator_options(2));
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  (void)next_generation({a.get(), b.get()}, "join");
  auto c = connect(coordinator, "c");
  auto turned_away = ask(*c, "join");
  ASSERT_TRUE(eventually([&] { return coordinator.waiting_workers() == 1; }));
  a->leave();
  a->leave();  // idempotent
  b->leave();
  coordinator.wait();  // returns: the run is over
  try {
    (void)turned_away.get();
    FAIL() << "a worker was placed after the run finished";
  } catch (const MembershipError& error) {
    EXPECT_NE(std::string(error.what()).find("the run has finished"), std::string::npos)
        << error.what();
  }
  EXPECT_THROW((void)a->boundary(3, deadline_after(kTimeout)), MembershipError);
  EXPECT_EQ(coordinator.generation(), 1u);
}

TEST(Membership, AMemberLeavingDuringARegroupIsNotWaitedFor) {
  Coordinator coordinator(coordinator_options(3, 2));
  auto a = connect(coordinator, "a");
  auto b = connect(coordinator, "b");
  auto c = connect(coordinator, "c");
  (void)next_generation({a.get(), b.get(), c.get()}, "join");
  auto regrouped = ask(*a, "the collective failed");
  c->leave();
  const auto b_group = b->next_group("the collective failed", deadline_after(kTimeout));
  const auto a_group = regrouped.get();
  EXPECT_EQ(expect_consistent({a_group, b_group}).size(), 2u);
  EXPECT_EQ(a_group.lost, std::vector<std::string>{"c"});
}

TEST(Membership, TheCoordinatorGoingAwayIsReportedAsLost) {
  auto coordinator = std::make_unique<Coordinator>(coordinator_options(1));
  auto a = connect(*coordinator, "a");
  EXPECT_EQ(a->next_group("join", deadline_after(kTimeout)).size(), 1);
  coordinator.reset();
  try {
    (void)a->boundary(1, deadline_after(kTimeout));
    FAIL() << "a boundary answer came from a destroyed coordinator";
  } catch (const PeerLostError& error) {
    EXPECT_NE(std::string(error.what()).find("coordinator lost"), std::string::npos)
        << error.what();
  }
  EXPECT_THROW((void)a->next_group("again", deadline_after(kTimeout)), PeerLostError);
}

// What the log says at warning level and above while a coordinator listens on `host` with
// `run_id`.
std::string warnings_starting_a_coordinator(const std::string& host, const std::string& run_id) {
  std::ostringstream lines;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(lines);
  sink->set_level(spdlog::level::warn);
  logger().sinks().push_back(sink);
  {
    CoordinatorOptions options = coordinator_options(1);
    options.host = host;
    options.run_id = run_id;
    const Coordinator coordinator(options);
  }
  logger().sinks().pop_back();
  return lines.str();
}

TEST(Membership, ACoordinatorReachableBeyondLoopbackWithoutARunIdWarnsThatAnotherJobCouldJoin) {
  const std::string warnings = warnings_starting_a_coordinator("0.0.0.0", "");
  EXPECT_NE(warnings.find("[warning]"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("listening beyond loopback with no run id (PULSELOCO_RUN_ID): a worker "
                          "of another job with the same secret"),
            std::string::npos)
      << warnings;

  const std::string with_run_id = warnings_starting_a_coordinator("0.0.0.0", "job-a");
  EXPECT_EQ(with_run_id.find("PULSELOCO_RUN_ID"), std::string::npos) << with_run_id;
  const std::string on_loopback = warnings_starting_a_coordinator("127.0.0.1", "");
  EXPECT_EQ(on_loopback.find("PULSELOCO_RUN_ID"), std::string::npos) << on_loopback;
}

TEST(Membership, BadOptionsAreRejectedNamingTheField) {
  auto options = coordinator_options(2, 3);
  EXPECT_THROW(Coordinator{options}, InvalidArgument);
  options = coordinator_options(2);
  options.max_workers = 1;
  EXPECT_THROW(Coordinator{options}, InvalidArgument);
  options = coordinator_options(2);
  options.join_every_windows = 0;
  EXPECT_THROW(Coordinator{options}, InvalidArgument);
  MembershipClientOptions client;
  client.coordinator = "127.0.0.1";  // no port
  client.worker_id = "a";
  client.data_address = {"127.0.0.1", 1};
  EXPECT_THROW(MembershipClient{client}, InvalidArgument);
  client.coordinator = "127.0.0.1:1";
  client.worker_id = "";
  EXPECT_THROW(MembershipClient{client}, InvalidArgument);
}

TEST(Membership, AnUnreachableCoordinatorTimesOutNamingIt) {
  const pulseloco::testing::RefusingPort nobody;
  ASSERT_TRUE(nobody.bound());
  MembershipClientOptions client;
  client.coordinator = "127.0.0.1:" + std::to_string(nobody.port());
  client.worker_id = "a";
  client.data_address = {"127.0.0.1", 1};
  client.connect_timeout = 200ms;
  try {
    MembershipClient unreachable(client);
    FAIL() << "registered with a coordinator that is gone";
  } catch (const TimeoutError& error) {
    EXPECT_NE(std::string(error.what()).find(client.coordinator), std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace pulseloco::elastic
