#include <pulseloco/transport/tcp/mesh.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include <pulseloco/base/log.h>
#include <pulseloco/base/log_lines.h>
#include <pulseloco/transport/tcp/core.h>
#include <pulseloco/transport/tcp/exposure.h>
#include <pulseloco/transport/tcp/job_id.h>
#include <pulseloco/transport/waiting.h>

namespace pulseloco::transport::tcp {

std::uint16_t Mesh::listen(const std::string& host, std::uint16_t port) {
  const auto& options = core_.options_;
  if (options.listen_socket >= 0) {
    // The caller's socket: checked by the address it is bound to (nothing is accepted before
    // start()).
    listener_.emplace(core_.io_, core_.control_, "tcp transport", options.listen_socket, options);
    require_authentication_beyond_loopback("tcp transport", listener_->host(),
                                           effective_link_security(options),
                                           options.allow_insecure);
    return listener_->port();
  }
  require_authentication_beyond_loopback("tcp transport", host, effective_link_security(options),
                                         options.allow_insecure);
  listener_.emplace(core_.io_, core_.control_, "tcp transport", host, port, options);
  return listener_->port();
}

void Mesh::start(Deadline deadline) {
  const int size = core_.size_;
  const int lanes = core_.lanes_per_peer_;
  {
    const std::lock_guard lock(core_.mutex_);
    lane_claimed_.assign(static_cast<std::size_t>(size),
                         std::vector<bool>(static_cast<std::size_t>(lanes), false));
    lanes_missing_ = (size - 1) * lanes;
  }
  listener_->start([this](PendingConnection connection) { return serve(std::move(connection)); });
  for (int peer = core_.rank_ + 1; peer < size; ++peer)
    for (int lane = 0; lane < lanes; ++lane)
      asio::co_spawn(asio::make_strand(core_.io_), connect_lane(peer, lane, deadline),
                     asio::detached);
}

std::vector<int> Mesh::missing_peers() const {
  const int lanes = core_.lanes_per_peer_;
  std::vector<int> missing;
  for (int peer = 0; peer < core_.size_; ++peer) {
    if (peer == core_.rank_) continue;
    const auto& claimed = lane_claimed_[static_cast<std::size_t>(peer)];
    if (std::count(claimed.begin(), claimed.end(), true) < lanes) missing.push_back(peer);
  }
  return missing;
}

void Mesh::wait(Deadline deadline) {
  const auto formed = [&] { return lanes_missing_ == 0 || core_.formation_error_; };
  std::unique_lock lock(core_.mutex_);
  // A long formation says whom it waits for (a peer not started yet, or a wrong address in the
  // table), at the pace of every other long wait.
  WaitProgress progress;
  const auto interval = progress.interval();
  while (!formed() && Clock::now() < deadline) {
    const Deadline next =
        interval.count() > 0 ? std::min(deadline, Clock::now() + interval) : deadline;
    if (core_.changed_.wait_until(lock, next, formed)) break;
    if (progress.due())
      logger().warn(
          "tcp transport: waited {:.1f} s for peers {} to connect ({} of {} "
          "connections missing; the formation gives up after {} ms)",
          progress.seconds(), fmt::join(missing_peers(), ", "), lanes_missing_,
          (core_.size_ - 1) * core_.lanes_per_peer_, to_ms(core_.connect_timeout_));
  }
  if (core_.formation_error_) std::rethrow_exception(core_.formation_error_);
  if (lanes_missing_ == 0) return;
  const std::vector<int> missing = missing_peers();
  ErrorContext context = core_.context_for(missing.empty() ? -1 : missing.front());
  context.ranks = missing;
  throw TimeoutError(
      fmt::format("tcp transport: could not connect to peers {} within {} ms ({} of {} "
                  "connections missing){}",
                  fmt::join(missing, ", "), to_ms(core_.connect_timeout_), lanes_missing_,
                  (core_.size_ - 1) * core_.lanes_per_peer_, refusals_.summary()),
      std::move(context));
}

void Mesh::close_listener() noexcept {
  if (listener_) listener_->close();
}

void Mesh::failed(std::exception_ptr error) {
  {
    const std::lock_guard lock(core_.mutex_);
    if (!core_.formation_error_) core_.formation_error_ = std::move(error);
  }
  core_.notify_waiters();
}

void Mesh::count_handshake(const HandshakeTraffic& traffic) noexcept {
  core_.wire_sent_ += traffic.bytes_sent;
  core_.wire_received_ += traffic.bytes_received;
}

std::string Mesh::admit(const Hello& hello, int& claimed_lane) {
  const int rank = core_.rank_;
  const int size = core_.size_;
  const int lanes = core_.lanes_per_peer_;
  if (hello.purpose != Purpose::data) return "this is a data listener, not a rendezvous";
  if (auto mismatch = group_mismatch(hello.group_id, core_.group_id_); !mismatch.empty())
    return mismatch;
  if (hello.world_size != static_cast<std::uint32_t>(size))
    return fmt::format("its world size {} differs from ours ({})", hello.world_size, size);
  if (hello.dst_rank != static_cast<std::uint32_t>(rank))
    return fmt::format("it wants rank {}, this is rank {}", hello.dst_rank, rank);
  if (hello.src_rank >= static_cast<std::uint32_t>(rank))
    return fmt::format("rank {} is connected to by this rank, it must not connect here",
                       hello.src_rank);
  if (hello.lanes != static_cast<std::uint16_t>(lanes) || hello.lane >= hello.lanes)
    return fmt::format("connection {} of {} does not match our {} connections per peer", hello.lane,
                       hello.lanes, lanes);
  const std::lock_guard lock(core_.mutex_);
  if (core_.closing_ || core_.aborted_) return "the transport is closing";
  if (lane_claimed_[hello.src_rank][hello.lane])
    return fmt::format("connection {} from rank {} already exists", hello.lane, hello.src_rank);
  lane_claimed_[hello.src_rank][hello.lane] = true;
  claimed_lane = hello.lane;
  return {};
}

asio::awaitable<void> Mesh::serve(PendingConnection connection) {
  const std::shared_ptr<Socket> socket = connection.socket();
  const std::string from = remote_description(*socket);
  apply_socket_options(*socket, core_.options_);
  int claimed_lane = -1;
  bool authenticated = false;
  try {
    LinkStream link(socket, core_.link_tls(*socket));
    const ServerHandshake result =
        co_await server_handshake(link, core_.options_.secret, [&](const Hello& hello) {
          authenticated = true;  // admit runs only once the client proved the secret
          return admit(hello, claimed_lane);
        });
    connection.handshake_done();
    count_handshake(result.traffic);
    if (!result.accepted) {
      refused_.fetch_add(1);
      const std::string refusal = fmt::format(
          "{} claiming rank {}: {}", from, result.hello.src_rank,
          authenticated ? result.refusal : std::string("failed authentication (wrong secret)"));
      connection.warn(fmt::format("tcp transport: rank {} refused {}", core_.rank_, refusal));
      // A process that holds the secret but belongs to another job shares this job's addresses:
      // the group must not form beside it (an older group of this job is only turned away).
      if (authenticated && job_of(result.hello.group_id) != job_of(core_.group_id_)) {
        failed(std::make_exception_ptr(
            ProtocolError(fmt::format("tcp transport: rank {} refused {}", core_.rank_, refusal),
                          core_.context_for(static_cast<int>(result.hello.src_rank)))));
      } else {
        const std::lock_guard lock(core_.mutex_);
        refusals_.add(refusal);
      }
      co_return;
    }
    install_lane(static_cast<int>(result.hello.src_rank), claimed_lane, std::move(link));
  } catch (const std::exception& error) {
    refused_.fetch_add(1);
    const std::string why = connection.failure(error);
    {
      const std::lock_guard lock(core_.mutex_);
      // TLS refuses a wrong key before any hello: the peer failed authentication.
      const bool refused_by_tls = dynamic_cast<const HandshakeRefused*>(&error) != nullptr;
      refusals_.add(refused_by_tls ? fmt::format("{} failed authentication ({})", from, why)
                                   : fmt::format("{} dropped during the handshake: {}", from, why));
    }
    connection.warn(
        fmt::format("tcp transport: rank {} dropped a connection from {} during the handshake: {}",
                    core_.rank_, from, why));
  }
}

asio::awaitable<void> Mesh::connect_lane(int peer, int lane, Deadline deadline) {
  const PeerAddress& address = core_.addresses_[static_cast<std::size_t>(peer)];
  const auto executor = co_await asio::this_coro::executor;
  auto backoff = std::chrono::milliseconds(10);
  std::string last_problem = "no attempt";
  for (;;) {
    {
      const std::lock_guard lock(core_.mutex_);
      if (core_.closing_ || core_.aborted_ || core_.formation_error_) co_return;
    }
    if (Clock::now() >= deadline) co_return;  // wait() reports the missing peers
    auto socket = std::make_shared<Socket>(executor);
    boost::system::error_code error;
    try {
      const auto endpoint = resolve_endpoint(core_.io_, address.host, address.port);
      socket->open(endpoint.protocol());
      apply_buffer_sizes(*socket, core_.options_);
      Watchdog watchdog(executor, deadline, [socket] {
        boost::system::error_code ignored;
        socket->close(ignored);
      });
      co_await socket->async_connect(endpoint, asio::redirect_error(asio::use_awaitable, error));
      if (error) last_problem = error.message();
    } catch (const std::exception& problem) {
      error = asio::error::host_not_found;
      last_problem = problem.what();
    }
    if (!error) {
      apply_socket_options(*socket, core_.options_);
      Hello hello;
      hello.purpose = Purpose::data;
      hello.src_rank = static_cast<std::uint32_t>(core_.rank_);
      hello.dst_rank = static_cast<std::uint32_t>(peer);
      hello.world_size = static_cast<std::uint32_t>(core_.size_);
      hello.lane = static_cast<std::uint16_t>(lane);
      hello.lanes = static_cast<std::uint16_t>(core_.lanes_per_peer_);
      hello.group_id = core_.group_id_;
      std::exception_ptr refusal;
      try {
        Watchdog watchdog(executor, deadline, [socket] {
          boost::system::error_code ignored;
          socket->close(ignored);
        });
        LinkStream link(socket, core_.link_tls(*socket));
        count_handshake(co_await client_handshake(link, hello, core_.options_.secret));
        install_lane(peer, lane, std::move(link));
        co_return;
      } catch (const HandshakeRefused& refused) {
        refusal = std::make_exception_ptr(
            ProtocolError(fmt::format("tcp transport: connection {} to peer {} at {}: {}", lane,
                                      peer, to_string(address), refused.message()),
                          core_.context_for(peer)));
      } catch (const std::exception& problem) {
        last_problem = problem.what();  // e.g. the peer dropped us during the handshake: retry
      }
      if (refusal) {
        failed(refusal);
        co_return;
      }
    }
    logger().debug("tcp transport: connection {} to peer {} at {} failed ({}); retrying", lane,
                   peer, to_string(address), last_problem);
    asio::steady_timer pause(executor);
    pause.expires_at(std::min(deadline, Clock::now() + backoff));
    boost::system::error_code ignored;
    co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
  }
}

void Mesh::install_lane(int peer_rank, int lane_index, LinkStream link) {
  Peer& peer = *core_.peers_[static_cast<std::size_t>(peer_rank)];
  asio::post(peer.strand, [this, &peer, peer_rank, lane_index,
                           link = std::make_shared<LinkStream>(std::move(link))] {
    Lane& lane = *peer.lanes[static_cast<std::size_t>(lane_index)];
    {
      const std::lock_guard lock(core_.mutex_);
      lane.link = std::move(*link);
      if (core_.closing_ || core_.aborted_ || peer.failure) {
        lane.link.close();
        lane.closed = true;
        return;
      }
      lane.connected = true;
      // Synchronous reads (the receiver's inline direct reads) must never block the strand.
      boost::system::error_code ignored;
      lane.link.socket().non_blocking(true, ignored);
      lane_claimed_[static_cast<std::size_t>(peer_rank)][static_cast<std::size_t>(lane_index)] =
          true;
      --lanes_missing_;
    }
    lane.last_read_progress = lane.last_write_progress = Clock::now();
    core_.notify_waiters();
    core_.receiver_.read_more(peer, lane);
    core_.sender_.pump(peer);
  });
}

}  // namespace pulseloco::transport::tcp
