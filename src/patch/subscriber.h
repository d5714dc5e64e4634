// Receives the versions a patch push server (push_server.h) sends and applies each with the
// checks of patch::Receiver: the message's checksum, the whole file's validity, its version and
// digest against the header's, the parent version and digest before and the result's digest
// after. Any failure throws an error naming the version and leaves the held state and version
// exactly as they were.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <pulseloco/patch/bf16_state.h>
#include <pulseloco/patch/push_messages.h>
#include <pulseloco/transport/tcp/tcp_options.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::patch {

struct SubscriberOptions {
  std::string server;  // "host:port"
  std::string secret;  // the server's shared secret
  std::string run_id;  // the server's run id (job_id.h)
  transport::LinkSecurity link_security = transport::LinkSecurity::automatic;
  transport::TlsFiles tls_files;
  // An anchor or patch larger than this is refused before it is read (a compact patch is also
  // bounded by the held state's size).
  std::uint64_t max_message_bytes = std::uint64_t{1} << 40;
  // How long a connection (the first, or one after a lost connection) is retried when the
  // server cannot be reached or drops it during the handshake, before receive() gives up
  // (PULSELOCO_CONNECT_TIMEOUT_MS for `pulseloco patch subscribe`). A refusal is not retried.
  std::chrono::milliseconds connect_timeout{60'000};
};

// What receive() applied.
struct ReceivedVersion {
  std::uint64_t version = 0;
  PushType type = PushType::compact;
  std::uint64_t bytes = 0;  // the message's payload
};

class Subscriber {
 public:
  // Holds nothing: the server starts it with an anchor. Throws InvalidArgument for bad options.
  explicit Subscriber(SubscriberOptions options);
  // Holds `state` as `version`: the server sends the deltas from it when it published that
  // version with that digest, and an anchor otherwise.
  Subscriber(SubscriberOptions options, Bf16State state, std::uint64_t version);
  ~Subscriber();
  Subscriber(const Subscriber&) = delete;
  Subscriber& operator=(const Subscriber&) = delete;

  // Receives and applies the next version. Connects first when not connected (again after a
  // lost connection, resuming from the held version), retrying a server that cannot be reached
  // with a growing pause (logged at info, then at warning while it lasts) until the connect
  // timeout or `deadline`. Throws TimeoutError when no version arrived before the deadline, or
  // no connection within the connect timeout (naming the last problem; the connection is then
  // closed and the next call resumes), ProtocolError at once when the server refused this
  // subscriber (another secret, job or link security; the reason is the handshake's) or a
  // message is damaged or does not fit the held state (naming the version; the connection is
  // closed, the state unchanged).
  ReceivedVersion receive(transport::Deadline deadline);

  [[nodiscard]] const Bf16State& state() const noexcept;
  [[nodiscard]] std::optional<std::uint64_t> version() const noexcept;
  // Connections made so far (1 after the first receive; more after reconnections).
  [[nodiscard]] std::uint64_t connections() const noexcept;
  // Closes the connection (the next receive reconnects).
  void disconnect() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pulseloco::patch
