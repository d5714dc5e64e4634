#include <pulseloco/patch/push_server.h>

#include <fmt/format.h>
#include <sys/stat.h>

#include <array>
#include <atomic>
#include <optional>
#include <set>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/thread_name.h>
#include <pulseloco/io/input_file.h>
#include <pulseloco/patch/manifest.h>
#include <pulseloco/patch/push_messages.h>
#include <pulseloco/patch/receiver.h>
#include <pulseloco/patch/send_pace.h>
#include <pulseloco/transport/tcp/exposure.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/tcp/listener.h>
#include <pulseloco/transport/tcp/tls_context.h>

namespace pulseloco::patch {
namespace {

namespace asio = boost::asio;
namespace tcp = transport::tcp;

// What tells one manifest file from the next (each is a new file renamed into place).
struct FileIdentity {
  ino_t inode = 0;
  off_t size = 0;
  std::int64_t mtime_ns = 0;
  bool operator==(const FileIdentity&) const = default;
};

std::optional<FileIdentity> identity_of(const std::filesystem::path& path) {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) return std::nullopt;
  return FileIdentity{
      .inode = info.st_ino,
      .size = info.st_size,
      .mtime_ns = std::int64_t{info.st_mtim.tv_sec} * 1'000'000'000 + info.st_mtim.tv_nsec};
}

PushType push_type_of(StepKind kind) {
  switch (kind) {
    case StepKind::anchor:
      return PushType::anchor;
    case StepKind::delta:
      return PushType::delta;
    case StepKind::compact:
      return PushType::compact;
  }
  return PushType::delta;
}

}  // namespace

struct PushServer::Impl {
  struct Subscriber {
    Subscriber(std::shared_ptr<tcp::Socket> accepted, std::shared_ptr<tcp::TlsContext> tls)
        : socket(accepted),
          link(std::move(accepted), std::move(tls)),
          pace_timer(socket->get_executor()) {}
    const std::shared_ptr<tcp::Socket> socket;
    tcp::LinkStream link;
    std::string from;
    std::optional<std::uint64_t> sent;  // the version the messages sent so far bring it to
    bool writing = false;
    bool closed = false;
    // While messages are on their way: the pace rules, and a timer at their deadline (one per
    // subscriber, moved only when it fires, not at every write).
    std::optional<SendPace> pace;
    asio::steady_timer pace_timer;
    std::uint64_t pace_generation = 0;       // which write loop the timer serves
    std::optional<PaceVerdict> dropped_for;  // why the pace rules reset its connection
  };
  using SubscriberPtr = std::shared_ptr<Subscriber>;

  Impl(std::filesystem::path served, PushServerOptions server_options)
      : directory(std::move(served)),
        options(std::move(server_options)),
        job(transport::derive_job_id(options.secret, options.run_id)),
        tls(tcp::TlsContext::make(options.link_security, options.secret, options.tls_files)),
        poll_timer(io) {}

  const std::filesystem::path directory;
  const PushServerOptions options;
  const transport::JobId job;
  const std::shared_ptr<tcp::TlsContext> tls;
  asio::io_context io;
  std::optional<tcp::Listener> listener;
  asio::steady_timer poll_timer;
  std::thread thread;

  // --- State of the io thread --------------------------------------------------------------
  std::shared_ptr<const Manifest> manifest = std::make_shared<Manifest>();
  std::optional<FileIdentity> manifest_identity;
  std::set<SubscriberPtr> subscribers;
  bool shutting_down = false;

  // --- Shared with other threads -------------------------------------------------------------
  std::atomic<std::uint64_t> subscribed{0};
  std::atomic<std::uint64_t> refused{0};
  std::atomic<std::uint64_t> dropped{0};
  std::atomic<std::uint64_t> dropped_slow{0};
  std::atomic<std::uint64_t> messages{0};
  std::atomic<std::uint64_t> newest{0};

  static void close_socket(Subscriber& subscriber) {
    boost::system::error_code ignored;
    subscriber.socket->shutdown(tcp::Socket::shutdown_both, ignored);
    subscriber.socket->close(ignored);
  }

  void forget(const SubscriberPtr& subscriber) {
    if (subscriber->closed) return;
    subscriber->closed = true;
    subscriber->pace_timer.cancel();
    close_socket(*subscriber);
    if (subscribers.erase(subscriber) > 0) subscribed.fetch_sub(1);
  }

  // Reads the manifest when it is not the one read last (or when `force`), then sends the new
  // versions to every subscriber that is not busy.
  void refresh(bool force) {
    const std::filesystem::path path = directory / kManifestName;
    const std::optional<FileIdentity> identity = identity_of(path);
    if (!identity || (!force && identity == manifest_identity)) return;
    try {
      auto next = std::make_shared<const Manifest>(read_manifest(directory));
      manifest_identity = identity;
      manifest = std::move(next);
      newest.store(manifest->versions.empty() ? 0 : manifest->versions.back().version);
    } catch (const Error& error) {
      logger().warn("patch push server: cannot read the manifest of '{}': {}", directory.string(),
                    error.what());
      return;
    }
    for (const SubscriberPtr& subscriber : subscribers)
      pump(subscriber);
  }

  void poll() {
    if (options.poll_interval.count() <= 0 || shutting_down) return;
    poll_timer.expires_after(options.poll_interval);
    poll_timer.async_wait([this](const boost::system::error_code& error) {
      if (error || shutting_down) return;
      refresh(false);
      poll();
    });
  }

  // Starts sending a subscriber the path to the newest version, unless a message is on its way
  // (the write loop plans again when it is done).
  void pump(const SubscriberPtr& subscriber) {
    if (subscriber->writing || subscriber->closed || manifest->versions.empty()) return;
    const std::uint64_t target = manifest->versions.back().version;
    if (subscriber->sent == target) return;
    subscriber->writing = true;
    asio::co_spawn(io, write_loop(subscriber), asio::detached);
  }

  asio::awaitable<void> write_loop(SubscriberPtr subscriber) {
    subscriber->pace.emplace(pace_limits(), transport::Clock::now());
    watch_pace(subscriber, ++subscriber->pace_generation);
    try {
      while (!subscriber->closed && !shutting_down && !manifest->versions.empty() &&
             subscriber->sent != manifest->versions.back().version) {
        const std::shared_ptr<const Manifest> planned = manifest;
        const std::vector<UpdateStep> steps =
            plan_update(*planned, subscriber->sent, planned->versions.back().version);
        // One message, then plan again: a subscriber that fell behind meanwhile gets the
        // shortest path from where it is.
        co_await send_step(*subscriber, *planned, steps.front());
        subscriber->sent = steps.front().version;
        messages.fetch_add(1);
      }
    } catch (const boost::system::system_error& error) {
      if (!subscriber->closed && !subscriber->dropped_for && !shutting_down)
        logger().warn("patch push server: subscriber {} lost: {}", subscriber->from,
                      error.code().message());
      forget(subscriber);
    } catch (const std::exception& error) {
      logger().error("patch push server: cannot serve subscriber {}: {}", subscriber->from,
                     error.what());
      forget(subscriber);
    }
    subscriber->pace_timer.cancel();
    subscriber->pace.reset();
    subscriber->writing = false;
  }

  // Drops the subscriber when the pace rules' deadline passes without the bytes they ask for;
  // when it took them meanwhile, waits for the next deadline.
  void watch_pace(const SubscriberPtr& subscriber, std::uint64_t generation) {
    subscriber->pace_timer.expires_at(subscriber->pace->deadline());
    subscriber->pace_timer.async_wait(
        [this, subscriber, generation](const boost::system::error_code& error) {
          if (error || subscriber->closed || subscriber->pace_generation != generation ||
              !subscriber->pace)
            return;  // the messages were sent, or the subscriber is gone
          if (auto verdict = subscriber->pace->verdict(transport::Clock::now())) {
            drop(*subscriber, std::move(*verdict));
          } else {
            watch_pace(subscriber, generation);
          }
        });
  }

  [[nodiscard]] PaceLimits pace_limits() const {
    return {.idle_timeout = options.write_timeout,
            .min_bytes_per_second = options.min_bytes_per_second,
            .window = options.rate_window};
  }

  // Sends one step's file, read in pieces: the subscriber holds one piece of the server's memory
  // whatever the file's size. The file must still be what the manifest lists: its size is
  // checked when it is opened, its checksum before the last piece goes out, so that a file
  // changed since it was listed never reaches the subscriber whole (the connection is closed
  // short of it; the subscriber reconnects).
  asio::awaitable<void> send_step(Subscriber& subscriber, const Manifest& planned,
                                  const UpdateStep& step) {
    const ManifestVersion& entry = *planned.find(step.version);
    const ManifestFile& file = step_file(entry, step.kind);
    const io::InputFile input(directory / file.path, "a published file");
    const auto not_listed = [&] {
      return ProtocolError(fmt::format("version {}: '{}' is not the file the manifest lists",
                                       step.version, file.path));
    };
    if (input.size() != file.bytes) throw not_listed();
    const auto header = encode_push_header({.type = push_type_of(step.kind),
                                            .version = step.version,
                                            .digest = entry.digest,
                                            .payload_bytes = file.bytes,
                                            .payload_checksum = file.checksum});
    std::vector<std::byte> piece(
        static_cast<std::size_t>(std::min<std::uint64_t>(kPushPieceBytes, file.bytes)));
    DigestStream checksum;
    std::uint64_t at = 0;
    do {  // once at least: an empty file's checksum is checked too
      const auto bytes = std::span(piece).first(
          static_cast<std::size_t>(std::min<std::uint64_t>(piece.size(), file.bytes - at)));
      input.read_at(at, bytes);
      checksum.update(bytes);
      if (at + bytes.size() == file.bytes && checksum.finish() != file.checksum) throw not_listed();
      if (at == 0) co_await write_paced(subscriber, header);
      co_await write_paced(subscriber, bytes);
      at += bytes.size();
    } while (at < file.bytes);
  }

  // Writes `bytes` as the subscriber takes them, telling the pace rules what each write took;
  // drops the subscriber (its connection reset) at a write that completes after a window that
  // fell short (watch_pace drops one whose write does not complete in time).
  asio::awaitable<void> write_paced(Subscriber& subscriber, std::span<const std::byte> bytes) {
    SendPace& pace = *subscriber.pace;
    while (!bytes.empty()) {
      const std::size_t took = co_await subscriber.link.async_write_some(
          asio::buffer(bytes.data(), bytes.size()), asio::use_awaitable);
      const auto now = transport::Clock::now();
      pace.took(took, now);
      bytes = bytes.subspan(took);
      if (auto verdict = pace.verdict(now)) {
        drop(subscriber, std::move(*verdict));
        throw boost::system::system_error(asio::error::timed_out);
      }
    }
  }

  // Resets a subscriber's connection for `verdict`.
  void drop(Subscriber& subscriber, PaceVerdict verdict) {
    if (subscriber.dropped_for) return;
    // Counted before its socket closes, so that a test that sees the reset sees the count.
    dropped.fetch_add(1);
    if (verdict.rule == PaceVerdict::Rule::slow) dropped_slow.fetch_add(1);
    logger().warn("patch push server: subscriber {} dropped: {} (it may reconnect and resume)",
                  subscriber.from, verdict.reason);
    subscriber.dropped_for = std::move(verdict);
    // Reset, not closed: the bytes it did not take are discarded at once rather than kept by
    // the kernel for a peer that is stalled.
    boost::system::error_code ignored;
    subscriber.socket->set_option(asio::socket_base::linger(true, 0), ignored);
    subscriber.socket->close(ignored);
  }

  void refuse(const tcp::PendingConnection& pending, const std::string& from,
              std::string_view reason) {
    refused.fetch_add(1);
    pending.warn(fmt::format("patch push server: refused a connection from {}: {}", from, reason));
  }

  // A connection the listener accepted: its handshake and subscribe, then its messages until it
  // closes (a subscriber sends nothing after its subscribe).
  asio::awaitable<void> serve(tcp::PendingConnection pending) {
    if (shutting_down) co_return;
    auto subscriber = std::make_shared<Subscriber>(pending.socket(), tls);
    subscriber->from = tcp::remote_description(*subscriber->socket);
    tcp::apply_socket_options(*subscriber->socket, transport::TcpOptions{});
    std::optional<PushHeader> subscribe;
    try {
      const auto result = co_await tcp::server_handshake(
          subscriber->link, options.secret, [this](const tcp::Hello& hello) -> std::string {
            if (hello.purpose != tcp::Purpose::patch_push)
              return "this is a patch push server, not a rendezvous server, coordinator or "
                     "data listener";
            return transport::group_mismatch(hello.group_id, transport::job_only_group_id(job),
                                             /*check_group=*/false);
          });
      if (!result.accepted) {
        refuse(pending, subscriber->from, result.refusal);
        close_socket(*subscriber);
        co_return;
      }
      std::array<std::byte, kPushHeaderBytes> head{};
      co_await asio::async_read(subscriber->link, asio::buffer(head), asio::use_awaitable);
      subscribe = decode_push_header(head);
      if (subscribe->type != PushType::subscribe)
        throw ProtocolError(fmt::format("a '{}' message where a subscribe was due",
                                        push_type_name(subscribe->type)));
      pending.handshake_done();
    } catch (const std::exception& error) {
      if (!shutting_down) refuse(pending, subscriber->from, pending.failure(error));
      close_socket(*subscriber);
      co_return;
    }
    if (shutting_down) co_return;
    subscribers.insert(subscriber);
    subscribed.fetch_add(1);
    refresh(false);
    if (subscribe->holds_version) {
      const ManifestVersion* held = manifest->find(subscribe->version);
      if (held != nullptr && held->digest == subscribe->digest) {
        subscriber->sent = subscribe->version;
      } else {
        logger().info(
            "patch push server: subscriber {} holds version {} (digest {}), which this "
            "directory did not publish: it gets an anchor",
            subscriber->from, subscribe->version, digest_hex(subscribe->digest));
      }
    }
    logger().info(
        "patch push server: subscriber {} from {}", subscriber->from,
        subscriber->sent ? fmt::format("version {}", *subscriber->sent) : std::string("nothing"));
    pump(subscriber);
    try {
      std::array<std::byte, 1> byte{};
      co_await asio::async_read(subscriber->link, asio::buffer(byte), asio::use_awaitable);
      logger().warn("patch push server: subscriber {} sent bytes after its subscribe; closing",
                    subscriber->from);
    } catch (const std::exception&) {  // closed: the subscriber left
    }
    forget(subscriber);
  }

  void begin_shutdown() {
    shutting_down = true;
    listener->close();
    poll_timer.cancel();
    for (const SubscriberPtr& subscriber :
         std::vector<SubscriberPtr>(subscribers.begin(), subscribers.end()))
      forget(subscriber);
  }
};

PushServer::PushServer(std::filesystem::path directory, PushServerOptions options) {
  if (!std::filesystem::is_directory(directory))
    throw InvalidArgument(
        fmt::format("patch push server: '{}' is not a directory", directory.string()));
  if (options.write_timeout.count() <= 0)
    throw InvalidArgument("patch push server: write_timeout must be positive");
  if (options.rate_window.count() <= 0)
    throw InvalidArgument("patch push server: rate_window must be positive");
  if (options.poll_interval.count() < 0)
    throw InvalidArgument("patch push server: poll_interval must not be negative");
  tcp::require_authentication_beyond_loopback(
      "patch push server", options.host,
      transport::effective_link_security(options.link_security, options.secret, options.tls_files),
      options.allow_insecure);
  impl_ = std::make_unique<Impl>(std::move(directory), std::move(options));
  auto& impl = *impl_;
  transport::TcpOptions buffers;
  buffers.socket_send_buffer_bytes = impl.options.socket_send_buffer_bytes;
  impl.listener.emplace(impl.io, impl.io.get_executor(), "patch push server", impl.options.host,
                        impl.options.port, buffers);
  impl.refresh(true);
  logger().info("patch push server: serving '{}' on {}:{}", impl.directory.string(),
                impl.options.host, impl.listener->port());
  impl.listener->start(
      [&impl](tcp::PendingConnection connection) { return impl.serve(std::move(connection)); });
  impl.poll();
  impl.thread = std::thread([&impl] {
    for (;;) {
      try {
        impl.io.run();
        return;
      } catch (const std::exception& error) {  // a bug: keep serving the other subscribers
        logger().error("patch push server: internal error: {}", error.what());
      }
    }
  });
  set_thread_name(impl.thread.native_handle(), "pl-patch-push");
}

PushServer::~PushServer() {
  asio::post(impl_->io, [&impl = *impl_] { impl.begin_shutdown(); });
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::uint16_t PushServer::port() const noexcept {
  return impl_->listener->port();
}

void PushServer::announce() {
  asio::post(impl_->io, [&impl = *impl_] { impl.refresh(true); });
}

PushServerStats PushServer::stats() const {
  return {.subscribers = impl_->subscribed.load(),
          .refused = impl_->refused.load(),
          .dropped = impl_->dropped.load(),
          .dropped_slow = impl_->dropped_slow.load(),
          .messages = impl_->messages.load(),
          .newest = impl_->newest.load()};
}

}  // namespace pulseloco::patch
