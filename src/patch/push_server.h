// Serves a publishing directory (publisher.h) to subscribers over TCP (subscriber.h), for
// inference servers that share no file system with the trainer (docs/patches.md, "Pushing over
// TCP"; the messages: push_messages.h).
//
// A subscriber connects, authenticates like a member of the training group (the shared secret's
// HMAC challenge-response, TLS when the links are encrypted, the job id of the secret and run
// id) and says which version it holds and that version's digest. The server sends it the
// shortest path to the newest version (Receiver's plan_update: the deltas from its version, or
// an anchor and the deltas after it) and then every version as it is published.
//
// The server learns of new versions by reading the directory's manifest: when announce() is
// called (a publisher in the same process calls it after Publisher::publish) and every
// `poll_interval` (a publisher in another process, `pulseloco patch serve`). Reading the
// manifest rather than being handed versions by a Publisher lets one server serve any
// directory, whoever writes it, and a server started late serve the versions already there.
//
// A slow subscriber holds no queue of versions: each has at most one message on its way, and
// when that message has been written, the server plans again from the version just sent to
// the newest, so a subscriber that fell behind gets the shortest path then (an anchor when the
// deltas it missed are larger). Publishing and the other subscribers never wait for it. A
// message is read from its file and sent in pieces of kPushPieceBytes, so that a subscriber
// costs the server one piece of memory whatever the file's size. A subscriber that takes no
// bytes for `write_timeout`, or less than `min_bytes_per_second` over a `rate_window` while a
// message is on its way (send_pace.h), is dropped and the log says which; it may reconnect and
// resume from the version it holds.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include <pulseloco/transport/tcp/tcp_options.h>

namespace pulseloco::patch {

// A message is read from its file and written in pieces of this size: a subscriber with a
// message on its way costs the server one piece of memory.
inline constexpr std::size_t kPushPieceBytes = std::size_t{256} << 10;

struct PushServerOptions {
  std::string host = "127.0.0.1";  // where to listen
  std::uint16_t port = 0;          // 0 = any free port (PushServer::port())
  // Shared secret (PULSELOCO_SECRET). Empty: subscribers are not authenticated, which is refused
  // (InvalidArgument) unless `host` is loopback or allow_insecure is set.
  std::string secret;
  std::string run_id;           // the job's run id (PULSELOCO_RUN_ID); subscribers use the same
  bool allow_insecure = false;  // listen beyond loopback without a secret (warned)
  transport::LinkSecurity link_security = transport::LinkSecurity::automatic;
  transport::TlsFiles tls_files;
  // How often the manifest is read for new versions; 0: only when announce() is called.
  std::chrono::milliseconds poll_interval{500};
  // A subscriber whose connection takes no bytes for this long is dropped.
  std::chrono::milliseconds write_timeout{60'000};
  // A subscriber that takes fewer than min_bytes_per_second × rate_window bytes in a window of
  // rate_window while a message is on its way is dropped (0: no minimum). A subscriber that
  // pauses to apply a message loses that time from a window; with the window as long as the
  // write timeout, the pause that drops it is about as long under both rules.
  std::uint64_t min_bytes_per_second = std::uint64_t{128} << 10;
  std::chrono::milliseconds rate_window{60'000};
  // The sockets' buffer sizes (0: the kernel's autotuning), as transport::TcpOptions.
  int socket_send_buffer_bytes = 0;
};

struct PushServerStats {
  std::uint64_t subscribers = 0;   // connected and subscribed now
  std::uint64_t refused = 0;       // connections refused (secret, job, malformed subscribe)
  std::uint64_t dropped = 0;       // subscribers dropped (too slow or idle, as below)
  std::uint64_t dropped_slow = 0;  // of those, the ones below min_bytes_per_second
  std::uint64_t messages = 0;      // anchors and patches sent, over all subscribers
  std::uint64_t newest = 0;        // the newest version the server knows (0: none yet)
};

// Runs on a background thread until destroyed.
class PushServer {
 public:
  // `directory` must exist; it may hold no manifest yet. Throws InvalidArgument (options, a
  // listener beyond loopback without a secret), IoError (the address cannot be bound).
  PushServer(std::filesystem::path directory, PushServerOptions options);
  ~PushServer();
  PushServer(const PushServer&) = delete;
  PushServer& operator=(const PushServer&) = delete;

  [[nodiscard]] std::uint16_t port() const noexcept;
  // Reads the manifest now and sends new versions to the subscribers (returns at once).
  void announce();
  [[nodiscard]] PushServerStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pulseloco::patch
