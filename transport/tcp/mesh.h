// Forming the TCP transport's full mesh (internal header): the lower rank of every pair opens
// connections_per_peer connections to the higher one's data listener, retrying until the
// connect deadline; every connection passes the HMAC-SHA256 challenge-response
// (tcp/handshake.h) and the listener's checks of its claims (group id, ranks, connection
// index) before it becomes one of the peer's lanes. The listener keeps refusing (and logging)
// strangers for the transport's whole life without disturbing the group; the formation's
// timeout error names those it refused meanwhile. An authenticated process of another job
// (tcp/job_id.h) ends the formation at once: two jobs share this job's addresses and secret.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/listener.h>
#include <pulseloco/transport/tcp/refusals.h>

namespace pulseloco::transport::tcp {

class Core;

class Mesh {
 public:
  explicit Mesh(Core& core) noexcept : core_(core) {}

  // Binds the data listener (on the control strand); returns its port.
  std::uint16_t listen(const std::string& host, std::uint16_t port);
  // Starts accepting the lower ranks' connections and connecting to the higher ranks (the
  // group table is in the core by now).
  void start(Deadline deadline);
  // Blocks until every connection of the mesh is in place or the formation failed (rethrown);
  // logs the peers still missing at wait_progress_interval(); at `deadline` throws TimeoutError
  // naming them.
  void wait(Deadline deadline);
  // Closes the data listener. On the control strand (or once no thread runs the io_context).
  void close_listener() noexcept;

  // Connections refused by the data listener so far (authentication failures, strangers).
  [[nodiscard]] int refused_connections() const noexcept { return refused_.load(); }

 private:
  asio::awaitable<void> serve(PendingConnection connection);
  // Decides on an authenticated hello: "" admits it (and claims its lane), else the reason.
  std::string admit(const Hello& hello, int& claimed_lane);
  asio::awaitable<void> connect_lane(int peer, int lane, Deadline deadline);
  // Makes an authenticated connection lane `lane` of `peer`, on the peer's strand.
  void install_lane(int peer, int lane, LinkStream link);
  // Ends the formation with `error` (a refusal that retrying cannot fix).
  void failed(std::exception_ptr error);
  void count_handshake(const HandshakeTraffic& traffic) noexcept;
  // The peers with a lane not yet connected. Under the core's lock.
  [[nodiscard]] std::vector<int> missing_peers() const;

  Core& core_;
  std::optional<Listener> listener_;
  // Under the core's lock:
  std::vector<std::vector<bool>> lane_claimed_;  // [peer][lane]: connected or being connected
  int lanes_missing_ = 0;
  RefusalRecord refusals_;  // named by the formation's timeout error
  std::atomic<int> refused_{0};
};

}  // namespace pulseloco::transport::tcp
