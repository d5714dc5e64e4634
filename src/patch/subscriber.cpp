#include <pulseloco/patch/subscriber.h>

#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/unique_fd.h>
#include <pulseloco/patch/compact_files.h>
#include <pulseloco/patch/receiver.h>
#include <pulseloco/patch/trl_files.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/tcp/tls_context.h>

namespace pulseloco::patch {
namespace {

namespace asio = boost::asio;
namespace tcp = transport::tcp;
using transport::Clock;
using transport::Deadline;

// A payload is read in pieces of at most this size, so that a length the peer does not follow
// with bytes allocates no more than what arrived.
constexpr std::size_t kReadPiece = std::size_t{4} << 20;

struct Message {
  PushHeader header;
  std::vector<std::byte> payload;
};

// The safetensors readers read files: a received anchor or TRL delta is put in an anonymous
// in-memory file (memfd) and read from its /proc path, with every check of a file on disk.
class MemoryFile {
 public:
  explicit MemoryFile(std::span<const std::byte> bytes)
      : fd_(::memfd_create("pulseloco-patch-push", MFD_CLOEXEC)) {
    if (fd_.get() < 0) throw IoError(fmt::format("memfd_create failed: {}", errno_message()));
    for (std::size_t at = 0; at < bytes.size();) {
      const ssize_t n = ::write(fd_.get(), bytes.data() + at, bytes.size() - at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw IoError(fmt::format("writing a memfd failed: {}", errno_message()));
      at += static_cast<std::size_t>(n);
    }
  }
  [[nodiscard]] std::filesystem::path path() const {
    return fmt::format("/proc/self/fd/{}", fd_.get());
  }

 private:
  static std::string errno_message() { return std::system_category().message(errno); }
  UniqueFd fd_;
};

}  // namespace

struct Subscriber::Impl {
  explicit Impl(SubscriberOptions subscriber_options)
      : options(checked(std::move(subscriber_options))),
        server(transport::parse_peer_address(options.server, "patch push server")),
        tls(tcp::TlsContext::make(options.link_security, options.secret, options.tls_files)),
        socket(std::make_shared<tcp::Socket>(io)),
        link(socket, nullptr) {}

  static SubscriberOptions checked(SubscriberOptions options) {
    if (options.connect_timeout.count() <= 0)
      throw InvalidArgument(fmt::format("patch push: connect_timeout {} ms must be positive",
                                        options.connect_timeout.count()));
    return options;
  }

  const SubscriberOptions options;
  const transport::PeerAddress server;
  const std::shared_ptr<tcp::TlsContext> tls;
  asio::io_context io;
  std::shared_ptr<tcp::Socket> socket;
  tcp::LinkStream link;
  bool connected = false;
  std::uint64_t connections = 0;
  Receiver receiver;

  void disconnect() noexcept {
    boost::system::error_code ignored;
    socket->close(ignored);
    connected = false;
  }

  // Runs `operation` on the io_context until it completes or `deadline` passes (then the socket
  // is closed and TimeoutError thrown). Other errors propagate.
  template <typename T>
  T run(asio::awaitable<T> operation, Deadline deadline, std::string_view what) {
    bool expired = false;
    auto guarded = [&]() -> asio::awaitable<T> {
      tcp::Watchdog watchdog(io.get_executor(), deadline, [&] {
        expired = true;
        boost::system::error_code ignored;
        socket->close(ignored);
      });
      co_return co_await std::move(operation);
    };
    auto outcome = asio::co_spawn(io, guarded(), asio::use_future);
    io.restart();
    io.run();
    try {
      return outcome.get();
    } catch (const boost::system::system_error&) {
      if (!expired) throw;
      disconnect();
      throw TimeoutError(fmt::format("patch push: {} from {} before the deadline", what,
                                     transport::to_string(server)));
    }
  }

  asio::awaitable<void> open_connection() {
    const auto endpoint = tcp::resolve_endpoint(io, server.host, server.port);
    co_await socket->async_connect(endpoint, asio::use_awaitable);
    tcp::apply_socket_options(*socket, transport::TcpOptions{});
    link = tcp::LinkStream(socket, tls);
    tcp::Hello hello;
    hello.purpose = tcp::Purpose::patch_push;
    hello.group_id =
        transport::job_only_group_id(transport::derive_job_id(options.secret, options.run_id));
    (void)co_await tcp::client_handshake(link, hello, options.secret);
    const std::optional<std::uint64_t> held = receiver.version();
    const auto subscribe =
        encode_push_header({.type = PushType::subscribe,
                            .holds_version = held.has_value(),
                            .version = held.value_or(0),
                            .digest = held ? receiver.state().digest() : Digest{0}});
    co_await asio::async_write(link, asio::buffer(subscribe), asio::use_awaitable);
  }

  // Connects, authenticates and subscribes, retrying what may pass (no server yet, a connection
  // dropped during the handshake) with a growing pause until the connect timeout or `deadline`;
  // a refusal is the server's answer and ends it at once.
  void connect(Deadline deadline) {
    const auto started = Clock::now();
    const Deadline give_up = std::min(deadline, started + options.connect_timeout);
    constexpr auto kReportEvery = std::chrono::seconds(10);
    auto next_report = started + kReportEvery;
    auto backoff = std::chrono::milliseconds(20);
    std::string last_problem;
    for (int attempts = 1;; ++attempts) {
      socket = std::make_shared<tcp::Socket>(io);
      try {
        run(open_connection(), give_up, "could not subscribe");
        connected = true;
        ++connections;
        if (attempts > 1)
          logger().info("patch push: subscribed to {} at attempt {}", transport::to_string(server),
                        attempts);
        return;
      } catch (const tcp::HandshakeRefused& refused) {
        disconnect();
        throw ProtocolError(fmt::format("patch push server at {} refused this subscriber: {}",
                                        transport::to_string(server), refused.message()));
      } catch (const boost::system::system_error& error) {
        disconnect();
        last_problem = error.code().message();
      } catch (const IoError& error) {  // the host does not resolve (yet)
        disconnect();
        last_problem = error.message();
      } catch (const TimeoutError&) {  // give_up came during this attempt
        if (last_problem.empty()) last_problem = "the server did not answer";
      }
      const auto now = Clock::now();
      const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - started);
      if (now >= give_up)
        throw TimeoutError(fmt::format(
            "patch push: could not subscribe to {} in {} ms ({} attempt{}; last problem: {})",
            transport::to_string(server), waited.count(), attempts, attempts == 1 ? "" : "s",
            last_problem));
      if (attempts == 1) {
        logger().info("patch push: cannot subscribe to {} yet ({}); retrying for up to {} ms",
                      transport::to_string(server), last_problem,
                      std::chrono::duration_cast<std::chrono::milliseconds>(give_up - now).count());
      } else if (now >= next_report) {
        logger().warn("patch push: still cannot subscribe to {} after {} attempts in {} ms ({})",
                      transport::to_string(server), attempts, waited.count(), last_problem);
        next_report = now + kReportEvery;
      }
      std::this_thread::sleep_until(std::min(give_up, now + backoff));  // retry pace
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }

  [[nodiscard]] std::uint64_t payload_limit(const PushHeader& header) const {
    if (header.type == PushType::compact)
      return std::min(options.max_message_bytes, max_compact_bytes(receiver.state()));
    return options.max_message_bytes;
  }

  asio::awaitable<Message> read_message() {
    std::array<std::byte, kPushHeaderBytes> head{};
    co_await asio::async_read(link, asio::buffer(head), asio::use_awaitable);
    Message message{.header = decode_push_header(head)};
    const PushHeader& header = message.header;
    if (header.type == PushType::subscribe)
      throw ProtocolError("the server sent a subscribe message");
    if (header.payload_bytes > payload_limit(header))
      throw ProtocolError(fmt::format(
          "version {}: a {} of {} bytes (at most {} for this subscriber)", header.version,
          push_type_name(header.type), header.payload_bytes, payload_limit(header)));
    while (message.payload.size() < header.payload_bytes) {
      const std::size_t at = message.payload.size();
      const auto piece =
          static_cast<std::size_t>(std::min<std::uint64_t>(kReadPiece, header.payload_bytes - at));
      message.payload.resize(at + piece);
      co_await asio::async_read(link, asio::buffer(message.payload.data() + at, piece),
                                asio::use_awaitable);
    }
    co_return message;
  }

  // Applies a message to the held state (unchanged on any failure).
  void apply(const Message& message) {
    const PushHeader& header = message.header;
    const std::string what =
        fmt::format("the {} of version {}", push_type_name(header.type), header.version);
    if (digest_bytes(message.payload) != header.payload_checksum)
      throw ProtocolError(fmt::format("{}: its bytes do not match their checksum", what));
    if (header.type == PushType::anchor) {
      const MemoryFile file(message.payload);
      Anchor anchor = read_anchor_file(file.path());
      check_names(anchor.version, anchor.digest, header, what);
      receiver = Receiver(std::move(anchor.state), anchor.version);
      return;
    }
    if (!receiver.version())
      throw ProtocolError(fmt::format("{}: a patch for a subscriber that holds no version", what));
    Delta delta;
    if (header.type == PushType::compact) {
      delta = read_compact_patch(message.payload, receiver.state(), what);
    } else {
      const MemoryFile file(message.payload);
      delta = read_delta_file(file.path(), receiver.state());
    }
    check_names(delta.version, delta.digest, header, what);
    receiver.apply_delta(delta);
  }

  static void check_names(std::uint64_t version, Digest digest, const PushHeader& header,
                          std::string_view what) {
    if (version != header.version || digest != header.digest)
      throw ProtocolError(
          fmt::format("{}: the file holds version {} with digest {}, the message "
                      "names digest {}",
                      what, version, digest_hex(digest), digest_hex(header.digest)));
  }
};

Subscriber::Subscriber(SubscriberOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}

Subscriber::Subscriber(SubscriberOptions options, Bf16State state, std::uint64_t version)
    : impl_(std::make_unique<Impl>(std::move(options))) {
  impl_->receiver = Receiver(std::move(state), version);
}

Subscriber::~Subscriber() {
  impl_->disconnect();
}

ReceivedVersion Subscriber::receive(Deadline deadline) {
  auto& impl = *impl_;
  for (;;) {
    if (!impl.connected) impl.connect(deadline);
    Message message;
    try {
      message = impl.run(impl.read_message(), deadline, "no version arrived");
    } catch (const boost::system::system_error& error) {
      // The connection was lost: reconnect and resume from the held version.
      logger().warn("patch push: the connection to {} was lost ({}); resuming from {}",
                    transport::to_string(impl.server), error.code().message(),
                    impl.receiver.version() ? fmt::format("version {}", *impl.receiver.version())
                                            : std::string("nothing"));
      impl.disconnect();
      continue;
    } catch (const ProtocolError& error) {
      impl.disconnect();
      throw ProtocolError(fmt::format("patch push server at {} sent a bad message: {}",
                                      transport::to_string(impl.server), error.message()),
                          error.context());
    }
    try {
      impl.apply(message);
    } catch (const Error& error) {
      impl.disconnect();  // the stream after a bad message is not trusted
      throw ProtocolError(error.message(), error.context());
    }
    return {.version = message.header.version,
            .type = message.header.type,
            .bytes = message.header.payload_bytes};
  }
}

const Bf16State& Subscriber::state() const noexcept {
  return impl_->receiver.state();
}

std::optional<std::uint64_t> Subscriber::version() const noexcept {
  return impl_->receiver.version();
}

std::uint64_t Subscriber::connections() const noexcept {
  return impl_->connections;
}

void Subscriber::disconnect() noexcept {
  impl_->disconnect();
}

}  // namespace pulseloco::patch
