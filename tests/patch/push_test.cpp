// The patch push server and subscriber over loopback TCP (src/patch/push_server.h,
// subscriber.h): subscribers from nothing and from an older version reach every version
// byte-identically, several at once as versions are published; a wrong secret or another job
// is refused; a subscriber that disconnects resumes from its version; a damaged, truncated or
// misplaced message is refused with the state unchanged; a stalled subscriber blocks neither
// publishing nor the others and is dropped, as is one below the minimum rate; a server beyond
// loopback needs a secret; a subscriber whose secret or link security differs fails at once
// naming why, one that cannot connect retries until its connect timeout; stalled subscribers
// of a 100 MB anchor cost `pulseloco patch serve` bounded memory.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>

#include <array>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/io/atomic_file.h>
#include <pulseloco/patch/compact_files.h>
#include <pulseloco/patch/manifest.h>
#include <pulseloco/patch/push_messages.h>
#include <pulseloco/patch/push_server.h>
#include <pulseloco/patch/subscriber.h>
#include <pulseloco/patch/trl_files.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/tcp/tls_context.h>
#include "io/test_files.h"
#include "patch/patch_run.h"
#include "transport/child_process.h"

namespace pulseloco::testing {
namespace {

namespace asio = boost::asio;
namespace tcp = transport::tcp;
using io::test::TempDir;
using patch::PushType;

constexpr char kSecret[] = "push-test-secret";
const patch::PublisherOptions kPublishing{
    .anchor_every = 3, .compact = true, .chunk_elements = 4096, .threads = 1};

// Every wait is bounded by this; none of them is reached when the code works.
transport::Deadline bounded() {
  return transport::deadline_after(std::chrono::milliseconds(60'000));
}

void expect_state(const patch::Bf16State& state, const patch::Bf16State& expected,
                  const std::string& where) {
  ASSERT_EQ(state.tensors().size(), expected.tensors().size()) << where;
  for (std::size_t t = 0; t < state.tensors().size(); ++t) {
    EXPECT_EQ(state.tensors()[t].name, expected.tensors()[t].name) << where;
    EXPECT_TRUE(state.tensors()[t].bits == expected.tensors()[t].bits)
        << where << ": " << state.tensors()[t].name << " differs";
  }
}

patch::PushServerOptions server_options() {
  return {.host = "127.0.0.1", .secret = kSecret, .poll_interval = std::chrono::milliseconds(0)};
}

patch::SubscriberOptions subscriber_options(std::uint16_t port) {
  return {.server = fmt::format("127.0.0.1:{}", port), .secret = kSecret};
}

// A run published version by version, with a server told of each. Subscribers' threads read
// the expected states while versions are published: a version's state is recorded before the
// manifest lists it (the server may send it as soon as it reads a manifest that does, before
// being told), and readers get copies.
class LiveRun {
 public:
  explicit LiveRun(const std::filesystem::path& directory)
      : run_(11), publisher_(directory, kPublishing) {}
  void publish(patch::PushServer* server) {
    std::uint64_t version = 0;
    {
      const std::lock_guard lock(mutex_);
      if (!expected_.empty()) run_.step();
      expected_.push_back(run_.expected());
      version = expected_.size();
    }
    (void)publisher_.publish(run_.views(), version);
    if (server != nullptr) server->announce();
  }
  [[nodiscard]] patch::Bf16State expected(std::uint64_t version) const {
    const std::lock_guard lock(mutex_);
    return expected_.at(version - 1);
  }
  [[nodiscard]] std::uint64_t newest() const {
    const std::lock_guard lock(mutex_);
    return expected_.size();
  }

 private:
  PatchRun run_;
  patch::Publisher publisher_;
  mutable std::mutex mutex_;
  std::vector<patch::Bf16State> expected_;
};

// Receives until `target`, checking every version against the run's.
void follow(patch::Subscriber& subscriber, const LiveRun& run, std::uint64_t target,
            const std::string& who) {
  while (subscriber.version() != target) {
    const patch::ReceivedVersion received = subscriber.receive(bounded());
    ASSERT_EQ(subscriber.version(), received.version) << who;
    expect_state(subscriber.state(), run.expected(received.version),
                 fmt::format("{} at version {}", who, received.version));
  }
}

TEST(PatchPush, SubscribersFromNothingAndFromAnOlderVersionReachEveryVersion) {
  TempDir dir;
  LiveRun run(dir.path());
  for (int v = 0; v < 7; ++v)
    run.publish(nullptr);
  patch::PushServer server(dir.path(), server_options());

  patch::Subscriber fresh(subscriber_options(server.port()));
  const patch::ReceivedVersion first = fresh.receive(bounded());
  EXPECT_EQ(first.type, PushType::anchor);  // nothing held: an anchor first
  follow(fresh, run, 7, "fresh");

  patch::Subscriber older(subscriber_options(server.port()), run.expected(5), 5);
  const patch::ReceivedVersion next = older.receive(bounded());
  EXPECT_EQ(next.version, 6u);  // the deltas from the held version, not an anchor
  EXPECT_EQ(next.type, PushType::compact);
  follow(older, run, 7, "older");

  // A held state the directory did not publish under its version gets an anchor.
  patch::Subscriber foreign(subscriber_options(server.port()), run.expected(2), 5);
  EXPECT_EQ(foreign.receive(bounded()).type, PushType::anchor);
  follow(foreign, run, 7, "foreign");
}

TEST(PatchPush, SeveralSubscribersReceiveEachVersionAsItIsPublished) {
  TempDir dir;
  LiveRun run(dir.path());
  run.publish(nullptr);
  patch::PushServer server(dir.path(), server_options());
  constexpr std::uint64_t kNewest = 6;
  constexpr int kSubscribers = 3;
  std::vector<std::unique_ptr<patch::Subscriber>> subscribers;
  for (int i = 0; i < kSubscribers; ++i) {
    subscribers.push_back(std::make_unique<patch::Subscriber>(subscriber_options(server.port())));
    ASSERT_EQ(subscribers.back()->receive(bounded()).version, 1u);  // subscribed
  }
  std::vector<std::thread> threads;
  for (int i = 0; i < kSubscribers; ++i)
    threads.emplace_back([&, i] {
      follow(*subscribers[static_cast<std::size_t>(i)], run, kNewest,
             fmt::format("subscriber {}", i));
    });
  for (std::uint64_t v = 2; v <= kNewest; ++v)
    run.publish(&server);
  for (auto& thread : threads)
    thread.join();
  for (const auto& subscriber : subscribers)
    EXPECT_EQ(subscriber->state().digest(), run.expected(kNewest).digest());
}

TEST(PatchPush, AWrongSecretOrAnotherJobIsRefusedWithAClearError) {
  TempDir dir;
  LiveRun run(dir.path());
  run.publish(nullptr);
  patch::PushServerOptions options = server_options();
  options.run_id = "job-a";
  patch::PushServer server(dir.path(), options);

  patch::SubscriberOptions wrong_secret = subscriber_options(server.port());
  wrong_secret.run_id = "job-a";
  wrong_secret.secret = "another secret";
  patch::Subscriber intruder(wrong_secret);
  try {
    (void)intruder.receive(bounded());
    FAIL() << "a subscriber with another secret was served";
  } catch (const ProtocolError& error) {
    EXPECT_NE(std::string(error.what()).find("refused this subscriber"), std::string::npos)
        << error.what();
  }
  EXPECT_FALSE(intruder.version().has_value());

  patch::SubscriberOptions other_job = subscriber_options(server.port());
  other_job.run_id = "job-b";
  patch::Subscriber stranger(other_job);
  try {
    (void)stranger.receive(bounded());
    FAIL() << "a subscriber of another job was served";
  } catch (const ProtocolError& error) {
    const std::string what = error.what();
    const std::string ours = transport::to_string(transport::derive_job_id(kSecret, "job-a"));
    EXPECT_NE(what.find(ours), std::string::npos) << what;  // names the server's job
  }
  EXPECT_FALSE(stranger.version().has_value());
}

TEST(PatchPush, ASubscriberThatDisconnectsResumesFromItsVersion) {
  TempDir dir;
  LiveRun run(dir.path());
  for (int v = 0; v < 2; ++v)
    run.publish(nullptr);
  patch::PushServer server(dir.path(), server_options());
  patch::Subscriber subscriber(subscriber_options(server.port()));
  follow(subscriber, run, 2, "subscriber");
  subscriber.disconnect();
  run.publish(&server);
  run.publish(&server);
  const patch::ReceivedVersion resumed = subscriber.receive(bounded());
  EXPECT_EQ(resumed.version, 3u);
  EXPECT_EQ(resumed.type, PushType::compact);
  follow(subscriber, run, 4, "resumed");
  EXPECT_EQ(subscriber.connections(), 2u);
}

// A server that authenticates its subscriber and then sends what a test gives it, for the
// messages a real server never sends; or, without `authenticate`, that runs the script on the
// connection as it was accepted.
class ScriptedServer {
 public:
  using Script = std::function<asio::awaitable<void>(tcp::LinkStream&)>;
  explicit ScriptedServer(Script script, bool authenticate = true)
      : acceptor_(io_, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)),
        authenticate_(authenticate) {
    asio::co_spawn(io_, serve(std::move(script)), asio::detached);
    thread_ = std::thread([this] { io_.run(); });
  }
  ~ScriptedServer() {
    asio::post(io_, [this] { io_.stop(); });
    thread_.join();
  }
  [[nodiscard]] std::uint16_t port() const { return acceptor_.local_endpoint().port(); }

 private:
  // Serves connections one after another, each with the script.
  asio::awaitable<void> serve(Script script) {
    for (;;) {
      auto socket = std::make_shared<tcp::Socket>(io_);
      co_await acceptor_.async_accept(*socket, asio::use_awaitable);
      tcp::LinkStream link(socket,
                           tcp::TlsContext::make(transport::LinkSecurity::automatic, kSecret, {}));
      try {
        if (authenticate_) {
          (void)co_await tcp::server_handshake(link, kSecret,
                                               [](const tcp::Hello&) { return std::string(); });
          std::array<std::byte, patch::kPushHeaderBytes> subscribe{};
          co_await asio::async_read(link, asio::buffer(subscribe), asio::use_awaitable);
        }
        co_await script(link);
      } catch (const std::exception&) {  // the subscriber went away
      }
    }
  }

  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
  bool authenticate_;
  std::thread thread_;
};

// Sends `payload` as a message of `type` bringing its receiver to `version` (digest `digest`),
// with the payload's checksum unless `checksum` is given; `cut` bytes of the payload are left
// out; the connection closes after it.
asio::awaitable<void> send_message(tcp::LinkStream& link, PushType type, std::uint64_t version,
                                   Digest digest, std::vector<std::byte> payload,
                                   std::optional<Digest> checksum = std::nullopt,
                                   std::size_t cut = 0) {
  const auto header =
      patch::encode_push_header({.type = type,
                                 .version = version,
                                 .digest = digest,
                                 .payload_bytes = payload.size(),
                                 .payload_checksum = checksum.value_or(digest_bytes(payload))});
  co_await asio::async_write(link, asio::buffer(header), asio::use_awaitable);
  co_await asio::async_write(link, asio::buffer(payload.data(), payload.size() - cut),
                             asio::use_awaitable);
  // Returning closes the connection (ScriptedServer::serve).
}

std::vector<std::byte> file_bytes(const std::filesystem::path& path) {
  return io::read_file(path, std::uint64_t{1} << 30);
}

TEST(PatchPush, ADamagedTruncatedOrMisplacedMessageIsRefusedWithTheStateUnchanged) {
  TempDir dir;
  LiveRun run(dir.path());
  for (int v = 0; v < 3; ++v)
    run.publish(nullptr);
  const std::vector<std::byte> patch2 = file_bytes(dir.path() / patch::compact_file_name(2));
  const std::vector<std::byte> patch3 = file_bytes(dir.path() / patch::compact_file_name(3));
  const Digest digest2 = run.expected(2).digest();
  const Digest digest3 = run.expected(3).digest();

  struct Case {
    std::string name;
    ScriptedServer::Script script;
    std::string expected;  // in the error
  };
  std::vector<Case> cases;
  cases.push_back({"a bit flipped in transit",
                   [&](tcp::LinkStream& link) -> asio::awaitable<void> {
                     std::vector<std::byte> flipped = patch2;
                     flipped[flipped.size() / 2] ^= std::byte{0x10};
                     co_await send_message(link, PushType::compact, 2, digest2, flipped,
                                           digest_bytes(patch2));
                   },
                   "do not match their checksum"});
  cases.push_back({"a damaged patch with a matching checksum",
                   [&](tcp::LinkStream& link) -> asio::awaitable<void> {
                     std::vector<std::byte> flipped = patch2;
                     flipped[flipped.size() / 2] ^= std::byte{0x10};
                     co_await send_message(link, PushType::compact, 2, digest2, flipped);
                   },
                   "version 2"});
  cases.push_back({"the patch of another parent",
                   [&](tcp::LinkStream& link) -> asio::awaitable<void> {
                     co_await send_message(link, PushType::compact, 3, digest3, patch3);
                   },
                   "version 3"});
  cases.push_back({"a header naming another digest",
                   [&](tcp::LinkStream& link) -> asio::awaitable<void> {
                     co_await send_message(link, PushType::compact, 2, digest3, patch2);
                   },
                   "version 2"});
  cases.push_back({"a header that is not a push message",
                   [&](tcp::LinkStream& link) -> asio::awaitable<void> {
                     std::array<std::byte, patch::kPushHeaderBytes> junk{};
                     junk.fill(std::byte{0x5A});
                     co_await asio::async_write(link, asio::buffer(junk), asio::use_awaitable);
                   },
                   "magic"});
  for (const Case& test : cases) {
    SCOPED_TRACE(test.name);
    ScriptedServer server(test.script);
    patch::Subscriber subscriber(subscriber_options(server.port()), run.expected(1), 1);
    try {
      (void)subscriber.receive(bounded());
      ADD_FAILURE() << "the message was applied";
    } catch (const ProtocolError& error) {
      EXPECT_NE(std::string(error.what()).find(test.expected), std::string::npos) << error.what();
    }
    EXPECT_EQ(subscriber.version(), 1u);
    expect_state(subscriber.state(), run.expected(1), test.name);
  }

  // A message cut short: the connection is lost mid-payload, every reconnection too, until the
  // deadline; the state never changes. The deadline leaves a loaded machine time to connect,
  // authenticate and subscribe at least once.
  ScriptedServer truncating([&](tcp::LinkStream& link) -> asio::awaitable<void> {
    co_await send_message(link, PushType::compact, 2, digest2, patch2, std::nullopt, 7);
  });
  patch::Subscriber subscriber(subscriber_options(truncating.port()), run.expected(1), 1);
  EXPECT_THROW((void)subscriber.receive(transport::deadline_after(std::chrono::seconds(5))),
               TimeoutError);
  EXPECT_GE(subscriber.connections(), 1u);
  EXPECT_EQ(subscriber.version(), 1u);
  expect_state(subscriber.state(), run.expected(1), "after truncated messages");
}

// A subscriber that authenticates and subscribes from nothing, then never reads, with a small
// receive buffer so that an anchor cannot fit in the sockets' buffers.
class StalledSubscriber {
 public:
  explicit StalledSubscriber(std::uint16_t port)
      : socket_(std::make_shared<tcp::Socket>(io_)),
        link_(socket_, tcp::TlsContext::make(transport::LinkSecurity::automatic, kSecret, {})) {
    socket_->open(asio::ip::tcp::v4());
    socket_->set_option(asio::socket_base::receive_buffer_size(4096));
    socket_->connect({asio::ip::make_address("127.0.0.1"), port});
    auto subscribe = [this]() -> asio::awaitable<void> {
      tcp::Hello hello;
      hello.purpose = tcp::Purpose::patch_push;
      hello.group_id = transport::job_only_group_id(transport::derive_job_id(kSecret, ""));
      (void)co_await tcp::client_handshake(link_, hello, kSecret);
      const auto header = patch::encode_push_header({.type = PushType::subscribe});
      co_await asio::async_write(link_, asio::buffer(header), asio::use_awaitable);
    };
    auto done = asio::co_spawn(io_, subscribe(), asio::use_future);
    io_.run();
    done.get();
  }
  // Waits, reading nothing, until the server resets the connection (bounded: 60 s).
  void wait_until_reset() {
    pollfd watched{.fd = socket_->native_handle(), .events = POLLRDHUP, .revents = 0};
    ASSERT_EQ(::poll(&watched, 1, 60'000), 1) << "the server did not drop the subscriber";
    EXPECT_NE(watched.revents & (POLLERR | POLLHUP), 0);
  }
  // Waits, reading nothing, until the server has begun sending (bounded: 60 s).
  void wait_until_sent_to() {
    pollfd watched{.fd = socket_->native_handle(), .events = POLLIN, .revents = 0};
    ASSERT_EQ(::poll(&watched, 1, 60'000), 1) << "the server sent the subscriber nothing";
  }
  // Reads `piece` bytes, pauses for `pause`, and so on (the bytes are not decrypted: only the
  // pace matters) until the server closes or resets the connection; false when that did not
  // happen within 60 s. Each read waits in poll() for what is left of the 60 s (a blocking read
  // would wait forever on a server that stops sending without closing).
  bool read_slowly(std::size_t piece, std::chrono::milliseconds pause) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    std::vector<std::byte> bytes(piece);
    for (;;) {
      for (std::size_t got = 0; got < piece;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            give_up - std::chrono::steady_clock::now());
        pollfd watched{.fd = socket_->native_handle(), .events = POLLIN, .revents = 0};
        if (left.count() <= 0 || ::poll(&watched, 1, static_cast<int>(left.count())) != 1)
          return false;
        boost::system::error_code error;
        got += socket_->read_some(asio::buffer(bytes.data() + got, piece - got), error);
        if (error) return true;  // closed or reset
      }
      std::this_thread::sleep_for(pause);  // the slowness under test, not a synchronisation
    }
  }

 private:
  asio::io_context io_;
  std::shared_ptr<tcp::Socket> socket_;
  tcp::LinkStream link_;
};

TEST(PatchPush, AStalledSubscriberBlocksNeitherPublishingNorOthersAndIsDropped) {
  TempDir dir;
  LiveRun run(dir.path());
  run.publish(nullptr);
  {
    // A write timeout no test run reaches: the stalled subscriber stays while others are served.
    patch::PushServerOptions options = server_options();
    options.socket_send_buffer_bytes = 16 << 10;
    options.write_timeout = std::chrono::milliseconds(600'000);
    options.min_bytes_per_second = 0;
    patch::PushServer server(dir.path(), options);
    StalledSubscriber stalled(server.port());
    patch::Subscriber active(subscriber_options(server.port()));
    follow(active, run, 1, "active");
    for (int v = 0; v < 4; ++v)
      run.publish(&server);
    follow(active, run, 5, "active");
    EXPECT_EQ(server.stats().dropped, 0u);
    EXPECT_EQ(server.stats().subscribers, 2u);
  }
  // A short write timeout: the stalled subscriber is dropped.
  patch::PushServerOptions options = server_options();
  options.socket_send_buffer_bytes = 16 << 10;
  options.write_timeout = std::chrono::milliseconds(500);
  patch::PushServer server(dir.path(), options);
  StalledSubscriber stalled(server.port());
  stalled.wait_until_reset();
  EXPECT_EQ(server.stats().dropped, 1u);
  EXPECT_EQ(server.stats().dropped_slow, 0u);
}

TEST(PatchPush, ASubscriberBelowTheMinimumRateIsDroppedWhileOneThatKeepsUpIsServed) {
  TempDir dir;
  LiveRun run(dir.path());
  run.publish(nullptr);  // an anchor of about 640 KB, far more than the sockets' buffers hold
  patch::PushServerOptions options = server_options();
  options.socket_send_buffer_bytes = 16 << 10;
  options.write_timeout = std::chrono::milliseconds(600'000);  // out of the test's reach
  options.min_bytes_per_second = 32 << 10;
  options.rate_window = std::chrono::milliseconds(3'000);
  patch::PushServer server(dir.path(), options);
  // 1 KiB per 200 ms: never idle, but about 5 KiB/s where 32 KiB/s are due.
  StalledSubscriber slow(server.port());
  bool dropped = false;
  std::thread reader([&] { dropped = slow.read_slowly(1024, std::chrono::milliseconds(200)); });
  patch::Subscriber keeping_up(subscriber_options(server.port()));
  follow(keeping_up, run, 1, "keeping up");
  for (int v = 0; v < 3; ++v)
    run.publish(&server);
  follow(keeping_up, run, 4, "keeping up");
  reader.join();
  EXPECT_TRUE(dropped) << "the slow subscriber was not dropped within 60 s";
  EXPECT_EQ(server.stats().dropped_slow, 1u);
  EXPECT_EQ(server.stats().dropped, 1u);
  EXPECT_EQ(keeping_up.connections(), 1u);
}

TEST(PatchPush, AServerBeyondLoopbackWithoutASecretIsRefusedUnlessInsecureIsAsked) {
  TempDir dir;
  patch::PushServerOptions options = server_options();
  options.host = "0.0.0.0";
  options.secret.clear();
  try {
    patch::PushServer refused(dir.path(), options);
    FAIL() << "the push server listened on every interface without a secret";
  } catch (const InvalidArgument& error) {
    const std::string what = error.what();
    EXPECT_NE(what.find("patch push server: refusing to listen on 0.0.0.0"), std::string::npos)
        << what;
    EXPECT_NE(what.find("PULSELOCO_SECRET"), std::string::npos) << what;
  }
  options.allow_insecure = true;
  patch::PushServer insecure(dir.path(), options);
  EXPECT_NE(insecure.port(), 0);
}

TEST(PatchPush, AMalformedHeaderIsAProtocolError) {
  auto bytes = patch::encode_push_header({.type = PushType::compact, .version = 3});
  EXPECT_EQ(patch::decode_push_header(bytes).version, 3u);
  auto bad_type = bytes;
  bad_type[5] = std::byte{9};
  EXPECT_THROW((void)patch::decode_push_header(bad_type), ProtocolError);
  auto bad_flags = bytes;
  bad_flags[6] = std::byte{1};  // holds-version on a patch
  EXPECT_THROW((void)patch::decode_push_header(bad_flags), ProtocolError);
  auto subscribe = patch::encode_push_header({.type = PushType::subscribe, .payload_bytes = 1});
  EXPECT_THROW((void)patch::decode_push_header(subscribe), ProtocolError);
}

TEST(PatchPush, AFileChangedSinceTheManifestListedItNeverReachesASubscriberWhole) {
  TempDir dir;
  LiveRun run(dir.path());
  run.publish(nullptr);
  const std::filesystem::path anchor = dir.path() / patch::anchor_file_name(1);
  std::vector<std::byte> bytes = file_bytes(anchor);
  ASSERT_GT(bytes.size(), patch::kPushPieceBytes);  // sent in several pieces
  bytes[bytes.size() / 2] ^= std::byte{0x01};       // same size, another checksum
  (void)io::write_file_atomically(anchor, bytes);
  patch::PushServer server(dir.path(), server_options());
  patch::Subscriber subscriber(subscriber_options(server.port()));
  // Each connection ends short of the message (a whole one would fail its checksum, a protocol
  // error); the subscriber reconnects until the deadline, which leaves a loaded machine time to
  // connect, authenticate and subscribe at least once.
  EXPECT_THROW((void)subscriber.receive(transport::deadline_after(std::chrono::seconds(5))),
               TimeoutError);
  EXPECT_GE(subscriber.connections(), 1u);
  EXPECT_FALSE(subscriber.version().has_value());
}

// A subscriber whose secret or link security is not the server's fails at its first attempt,
// with a protocol error naming the reason, instead of retrying until its connect timeout.
struct Mismatch {
  std::string name;
  transport::LinkSecurity server_security;
  std::string subscriber_secret;
  transport::LinkSecurity subscriber_security;
  std::string reason;  // in the error
};

class SubscriberMismatch : public ::testing::TestWithParam<Mismatch> {};

constexpr auto kAutomatic = transport::LinkSecurity::automatic;
constexpr auto kHmac = transport::LinkSecurity::hmac;
constexpr char kServerUsesTls[] = "the server's links use TLS and ours are plaintext";
constexpr char kSecretsDiffer[] = "the shared secrets differ";

INSTANTIATE_TEST_SUITE_P(
    PatchPush, SubscriberMismatch,
    ::testing::Values(
        Mismatch{"HmacAgainstTls", kAutomatic, kSecret, kHmac, kServerUsesTls},
        Mismatch{"NoSecretAgainstTls", kAutomatic, "", kAutomatic, kServerUsesTls},
        Mismatch{"TlsAgainstHmac", kHmac, kSecret, kAutomatic,
                 "the server's links are plaintext and ours use TLS"},
        Mismatch{"WrongSecretOverTls", kAutomatic, "another secret", kAutomatic, kSecretsDiffer},
        Mismatch{"WrongSecretOverHmac", kHmac, "another secret", kHmac, kSecretsDiffer},
        Mismatch{"NoSecretAgainstHmac", kHmac, "", kAutomatic, kSecretsDiffer}),
    [](const auto& param_info) { return param_info.param.name; });

TEST_P(SubscriberMismatch, FailsAtOnceNamingTheReason) {
  TempDir dir;
  LiveRun run(dir.path());
  run.publish(nullptr);
  patch::PushServerOptions options = server_options();
  options.link_security = GetParam().server_security;
  patch::PushServer server(dir.path(), options);
  patch::SubscriberOptions mismatched = subscriber_options(server.port());
  mismatched.secret = GetParam().subscriber_secret;
  mismatched.link_security = GetParam().subscriber_security;
  // Retried, a mismatch would end at the deadline as a timeout.
  mismatched.connect_timeout = std::chrono::milliseconds(60'000);
  patch::Subscriber subscriber(mismatched);
  try {
    (void)subscriber.receive(bounded());
    FAIL() << "a mismatched subscriber was served";
  } catch (const Error& error) {
    const std::string what = error.what();
    EXPECT_EQ(error.kind(), ErrorKind::protocol) << what;
    EXPECT_NE(what.find("refused this subscriber"), std::string::npos) << what;
    EXPECT_NE(what.find(GetParam().reason), std::string::npos) << what;
  }
  EXPECT_EQ(subscriber.connections(), 0u);
  EXPECT_FALSE(subscriber.version().has_value());
}

TEST(PatchPush, AServerThatDropsEveryConnectionIsRetriedUntilTheConnectTimeout) {
  // Closes every connection as it is accepted, before any handshake.
  ScriptedServer dropping([](tcp::LinkStream&) -> asio::awaitable<void> { co_return; },
                          /*authenticate=*/false);
  patch::SubscriberOptions options = subscriber_options(dropping.port());
  options.connect_timeout = std::chrono::milliseconds(2'000);
  patch::Subscriber subscriber(options);
  const transport::Deadline deadline = bounded();
  try {
    (void)subscriber.receive(deadline);
    FAIL() << "a subscriber was served by a server that drops every connection";
  } catch (const TimeoutError& error) {
    EXPECT_LT(transport::Clock::now(), deadline);  // it gave up at its connect timeout
    const std::string what = error.what();
    EXPECT_NE(what.find(fmt::format("could not subscribe to 127.0.0.1:{} in", dropping.port())),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("last problem: "), std::string::npos) << what;
    EXPECT_EQ(what.find("(1 attempt;"), std::string::npos) << what;  // it retried
  }
  EXPECT_EQ(subscriber.connections(), 0u);
}

// Writes a `bytes`-byte file of pseudo-random bytes and a manifest that lists it as version 1's
// anchor: the push server sends a listed file as it is, whatever it holds.
void publish_large_anchor(const std::filesystem::path& directory, std::uint64_t bytes) {
  const std::string name = "anchors/step_000001.safetensors";
  std::filesystem::create_directories(directory / "anchors");
  io::AtomicFile file(directory / name);
  std::vector<std::uint64_t> block(std::size_t{1} << 17);  // 1 MiB
  std::uint64_t state = 0x9E3779B97F4A7C15ULL;
  for (std::uint64_t written = 0; written < bytes;) {
    for (std::uint64_t& word : block)
      word = state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    const auto piece = std::as_bytes(std::span(block))
                           .first(static_cast<std::size_t>(std::min<std::uint64_t>(
                               block.size() * sizeof(std::uint64_t), bytes - written)));
    file.write(piece);
    written += piece.size();
  }
  file.commit();
  patch::Manifest manifest{.total_elements = bytes / 2};
  manifest.versions.push_back(
      {.version = 1,
       .digest = 1,
       .anchor = patch::ManifestFile{.path = name, .bytes = bytes, .checksum = file.digest()}});
  patch::write_manifest(directory, manifest);
}

// A field of /proc/PID/status, in KiB.
std::uint64_t status_kib(pid_t pid, const std::string& field) {
  std::ifstream status(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1));
  }
  throw std::runtime_error(fmt::format("/proc/{}/status has no {}", pid, field));
}

// `pulseloco patch serve` in a process of its own, so that its memory is its own: subscribers
// that authenticate, subscribe and then read nothing cost it a piece of a file each, not the
// file (the sockets' buffers are the kernel's, outside its resident memory).
TEST(PatchPush, StalledSubscribersOfALargeAnchorCostTheServerBoundedMemory) {
  TempDir dir;
  constexpr std::uint64_t kAnchorBytes = std::uint64_t{100} << 20;
  constexpr int kStalled = 20;
  constexpr std::uint64_t kBoundKib = std::uint64_t{64} << 10;  // 64 MiB beyond the base
  publish_large_anchor(dir.path(), kAnchorBytes);
  Child server({PULSELOCO_CLI, "patch", "serve", dir.path().string(), "--listen", "127.0.0.1:0"},
               {{"PULSELOCO_SECRET", kSecret}}, /*report_to_stdout=*/true);
  const std::string serving =
      server.expect("serving ", ChildClock::now() + std::chrono::seconds(60));
  ASSERT_FALSE(serving.empty()) << "the server did not start";
  const auto port = static_cast<std::uint16_t>(std::stoi(serving.substr(serving.rfind(':') + 1)));
  const std::uint64_t base = status_kib(server.pid(), "VmRSS");
  std::vector<std::unique_ptr<StalledSubscriber>> stalled;
  for (int i = 0; i < kStalled; ++i)
    stalled.push_back(std::make_unique<StalledSubscriber>(port));
  // Each has its anchor on the way: the server began sending it, and never finishes.
  for (const auto& subscriber : stalled)
    subscriber->wait_until_sent_to();
  const std::uint64_t peak = status_kib(server.pid(), "VmHWM");
  EXPECT_LT(peak - base, kBoundKib) << "base " << base << " KiB, peak " << peak << " KiB";
}

}  // namespace
}  // namespace pulseloco::testing
