// The patch push server and subscriber over loopback TCP (src/patch/push_server.h,
// subscriber.h): subscribers from nothing and from an older version reach every version
// byte-identically, several at once as versions are published; a wrong secret or another job
// is refused; a subscriber that disconnects resumes from its version; a damaged, truncated or
// misplaced message is refused with the state unchanged; a stalled subscriber blocks neither
// publishing nor the others and is dropped; a server beyond loopback needs a secret.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <poll.h>

#include <array>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/io/atomic_file.h>
#include <pulseloco/patch/compact_files.h>
#include <pulseloco/patch/push_messages.h>
#include <pulseloco/patch/push_server.h>
#include <pulseloco/patch/subscriber.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/tcp/tls_context.h>
#include "io/test_files.h"
#include "patch/patch_run.h"

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

// A run published version by version, with a server told of each.
class LiveRun {
 public:
  explicit LiveRun(const std::filesystem::path& directory)
      : run_(11), publisher_(directory, kPublishing) {}
  void publish(patch::PushServer* server) {
    if (!expected_.empty()) run_.step();
    const std::vector<patch::WeightsView> views = run_.views();
    (void)publisher_.publish(views, expected_.size() + 1);
    expected_.push_back(run_.expected());
    if (server != nullptr) server->announce();
  }
  [[nodiscard]] const patch::Bf16State& expected(std::uint64_t version) const {
    return expected_.at(version - 1);
  }
  [[nodiscard]] std::uint64_t newest() const { return expected_.size(); }

 private:
  PatchRun run_;
  patch::Publisher publisher_;
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
// messages a real server never sends.
class ScriptedServer {
 public:
  using Script = std::function<asio::awaitable<void>(tcp::LinkStream&)>;
  explicit ScriptedServer(Script script)
      : acceptor_(io_, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0)) {
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
        (void)co_await tcp::server_handshake(link, kSecret,
                                             [](const tcp::Hello&) { return std::string(); });
        std::array<std::byte, patch::kPushHeaderBytes> subscribe{};
        co_await asio::async_read(link, asio::buffer(subscribe), asio::use_awaitable);
        co_await script(link);
      } catch (const std::exception&) {  // the subscriber went away
      }
    }
  }

  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
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
  // deadline; the state never changes.
  ScriptedServer truncating([&](tcp::LinkStream& link) -> asio::awaitable<void> {
    co_await send_message(link, PushType::compact, 2, digest2, patch2, std::nullopt, 7);
  });
  patch::Subscriber subscriber(subscriber_options(truncating.port()), run.expected(1), 1);
  EXPECT_THROW((void)subscriber.receive(transport::deadline_after(std::chrono::milliseconds(500))),
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

}  // namespace
}  // namespace pulseloco::testing
