#include <pulseloco/transport/tcp/listener.h>

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <list>
#include <mutex>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/transport/tcp/log_throttle.h>

namespace pulseloco::transport::tcp {

// What the accept loop and the pending connections share (they may outlive the Listener).
struct PendingConnection::Shared {
  Shared(asio::io_context& context, const asio::any_io_executor& executor, std::string name)
      : io(context), acceptor(executor), room(executor), pause(executor), owner(std::move(name)) {}

  asio::io_context& io;
  Acceptor acceptor;
  asio::steady_timer room;   // the accept loop waits on it while every place is taken
  asio::steady_timer pause;  // the pause after a failed accept
  const std::string owner;
  LogThrottle accept_log{1};      // failed accepts: one line per interval
  LogThrottle connection_log{5};  // refused and dropped connections
  std::atomic<std::size_t> failures{0};
  bool closed = false;    // on the accept loop's executor
  bool borrowed = false;  // the acceptor holds a duplicate of the caller's listening socket
};

// One place for a connection in its handshake (or for an accept under way).
struct PendingConnection::Place {
  std::weak_ptr<Socket> socket;  // set once accepted
  asio::any_io_executor executor;
  std::list<std::shared_ptr<Place>>::iterator in_queue;
  bool queued = false;  // in the queue of droppable connections (under the registry's mutex)
  std::atomic<bool> dropped{false};
};

namespace {

// Closes the listening socket, or, for a borrowed one, deregisters and closes only the
// duplicate: closing a duplicate does not take the socket out of the reactor's epoll set, so
// release() must deregister it first, and the caller's socket stays bound and listening.
void close_acceptor(PendingConnection::Shared& shared) noexcept {
  boost::system::error_code ignored;
  if (!shared.borrowed) {
    shared.acceptor.close(ignored);
    return;
  }
  if (!shared.acceptor.is_open()) return;
  const int duplicate = shared.acceptor.release(ignored);
  if (ignored) {
    shared.acceptor.close(ignored);
  } else if (duplicate >= 0) {
    ::close(duplicate);
  }
}

using Place = PendingConnection::Place;
using Shared = PendingConnection::Shared;

// Every place of the process, over all listeners: the cap is process-wide, and a connection to
// one listener may drop the oldest stranger of another.
class Places {
 public:
  // A place for the next accept, or null (and `shared` is woken once one is given back).
  std::shared_ptr<Place> take_or_wait(const std::shared_ptr<Shared>& shared, std::size_t cap) {
    const std::lock_guard lock(mutex_);
    if (held_ < cap) {
      ++held_;
      return std::make_shared<Place>();
    }
    waiting_.push_back(shared);
    return nullptr;
  }

  // The accepted connection becomes the newest that may be dropped.
  void queue(const std::shared_ptr<Place>& place) {
    const std::lock_guard lock(mutex_);
    place->in_queue = queue_.insert(queue_.end(), place);
    place->queued = true;
  }

  // Closes the socket of the oldest queued connection, unless one is already being closed
  // (its place comes back when its server gives up on it).
  void drop_oldest() {
    std::shared_ptr<Place> oldest;
    {
      const std::lock_guard lock(mutex_);
      if (dropping_ > 0 || queue_.empty()) return;
      oldest = queue_.front();
      queue_.pop_front();
      oldest->queued = false;
      oldest->dropped = true;
      ++dropping_;
    }
    asio::post(oldest->executor, [weak = oldest->socket] {
      if (const auto socket = weak.lock()) {
        boost::system::error_code ignored;
        socket->close(ignored);
      }
    });
  }

  void give_back(Place& place) {
    std::vector<std::weak_ptr<Shared>> waiting;
    {
      const std::lock_guard lock(mutex_);
      if (place.queued) queue_.erase(place.in_queue);
      place.queued = false;
      if (place.dropped) --dropping_;
      --held_;
      waiting.swap(waiting_);
    }
    for (const auto& weak : waiting) {
      if (const auto shared = weak.lock()) {
        try {
          asio::post(shared->room.get_executor(), [shared] { shared->room.cancel(); });
        } catch (...) {
          // The io_context is gone: nobody accepts there any more.
        }
      }
    }
  }

  std::size_t held() {
    const std::lock_guard lock(mutex_);
    return held_;
  }

 private:
  std::mutex mutex_;
  std::size_t held_ = 0;
  std::size_t dropping_ = 0;
  std::list<std::shared_ptr<Place>> queue_;  // droppable connections, oldest first
  std::vector<std::weak_ptr<Shared>> waiting_;
};

Places& places() {
  static Places instance;
  return instance;
}

// The accept loop's place until a PendingConnection takes it over; given back when the loop ends
// (also when its frame is destroyed with the io_context).
class HeldPlace {
 public:
  HeldPlace() = default;
  explicit HeldPlace(std::shared_ptr<Place> place) : place_(std::move(place)) {}
  ~HeldPlace() {
    if (place_) places().give_back(*place_);
  }
  HeldPlace(const HeldPlace&) = delete;
  HeldPlace& operator=(const HeldPlace&) = delete;
  HeldPlace& operator=(HeldPlace&& other) noexcept {
    std::swap(place_, other.place_);
    return *this;
  }

  [[nodiscard]] Place* operator->() const noexcept { return place_.get(); }
  explicit operator bool() const noexcept { return place_ != nullptr; }
  [[nodiscard]] std::shared_ptr<Place> release() noexcept { return std::move(place_); }

 private:
  std::shared_ptr<Place> place_;
};

}  // namespace

DescriptorBudget descriptor_budget() {
  rlimit limit{};
  std::size_t soft = 1024;  // the usual limit, should getrlimit fail
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0)
    soft = limit.rlim_cur == RLIM_INFINITY ? std::size_t{1} << 20
                                           : static_cast<std::size_t>(limit.rlim_cur);
  DescriptorBudget budget;
  budget.limit = soft;
  budget.max_pending = std::clamp<std::size_t>(soft / 4, 1, kMaxPendingConnections);
  budget.reserve = soft / 8;
  return budget;
}

std::size_t pending_connections() {
  return places().held();
}

PendingConnection::PendingConnection(std::shared_ptr<Shared> listener,
                                     std::shared_ptr<Socket> socket, std::shared_ptr<Place> place)
    : listener_(std::move(listener)),
      socket_(std::move(socket)),
      place_(std::move(place)),
      deadline_(std::make_unique<Watchdog>(socket_->get_executor(),
                                           Clock::now() + kHandshakeTimeout, [socket = socket_] {
                                             boost::system::error_code ignored;
                                             socket->close(ignored);
                                           })) {}

PendingConnection::PendingConnection(PendingConnection&& other) noexcept = default;

PendingConnection::~PendingConnection() {
  handshake_done();
}

void PendingConnection::handshake_done() noexcept {
  if (deadline_) {
    timed_out_ = deadline_->fired();
    deadline_.reset();
  }
  if (place_) {
    dropped_ = place_->dropped;
    places().give_back(*place_);
    place_.reset();
  }
}

bool PendingConnection::timed_out() const noexcept {
  return deadline_ ? deadline_->fired() : timed_out_;
}

bool PendingConnection::dropped_for_room() const noexcept {
  return place_ ? place_->dropped.load() : dropped_;
}

std::string PendingConnection::failure(const std::exception& error) const {
  if (timed_out())
    return fmt::format("it did not finish its handshake within {} s", kHandshakeTimeout.count());
  if (dropped_for_room())
    return "it was dropped to make room for newer connections (every place for connections in "
           "their handshake was taken)";
  return error.what();
}

void PendingConnection::warn(const std::string& line) const {
  if (listener_) listener_->connection_log.warn(line);
}

Listener::Listener(asio::io_context& io, asio::any_io_executor executor, std::string owner,
                   const std::string& host, std::uint16_t port, const TcpOptions& buffers)
    : shared_(std::make_shared<Shared>(io, executor, std::move(owner))) {
  Acceptor& acceptor = shared_->acceptor;
  try {
    const Endpoint endpoint(asio::ip::make_address(host.empty() ? "0.0.0.0" : host), port);
    acceptor.open(endpoint.protocol());
    acceptor.set_option(asio::socket_base::reuse_address(true));
    apply_buffer_sizes(acceptor, buffers);
    acceptor.bind(endpoint);
    acceptor.listen(asio::socket_base::max_listen_connections);
    port_ = acceptor.local_endpoint().port();
    host_ = host;
  } catch (const boost::system::system_error& error) {
    throw IoError(fmt::format("{}: cannot listen on {}:{}: {}", shared_->owner,
                              host.empty() ? "*" : host, port, error.code().message()));
  }
}

Listener::Listener(asio::io_context& io, asio::any_io_executor executor, std::string owner,
                   int listening_socket, const TcpOptions& buffers)
    : shared_(std::make_shared<Shared>(io, executor, std::move(owner))) {
  const int duplicate = ::fcntl(listening_socket, F_DUPFD_CLOEXEC, 0);
  if (duplicate < 0) {
    throw IoError(fmt::format("{}: cannot use listening socket {}: {}", shared_->owner,
                              listening_socket, std::strerror(errno)));
  }
  Acceptor& acceptor = shared_->acceptor;
  try {
    acceptor.assign(asio::ip::tcp::v4(), duplicate);
    shared_->borrowed = true;
    apply_buffer_sizes(acceptor, buffers);
    const Endpoint bound = acceptor.local_endpoint();
    port_ = bound.port();
    if (!bound.address().is_unspecified()) host_ = bound.address().to_string();
  } catch (const boost::system::system_error& error) {
    if (!shared_->borrowed) ::close(duplicate);
    close_acceptor(*shared_);
    throw IoError(fmt::format("{}: cannot listen on socket {}: {}", shared_->owner,
                              listening_socket, error.code().message()));
  }
}

Listener::~Listener() {
  close_acceptor(*shared_);
}

std::size_t Listener::accept_failures() const noexcept {
  return shared_->failures.load();
}

void Listener::start(Serve serve) {
  asio::co_spawn(shared_->acceptor.get_executor(), accept_loop(shared_, std::move(serve)),
                 asio::detached);
}

void Listener::close() noexcept {
  auto& shared = *shared_;
  shared.closed = true;
  close_acceptor(shared);
  shared.room.cancel();
  shared.pause.cancel();
}

asio::awaitable<void> Listener::accept_loop(std::shared_ptr<Shared> shared, Serve serve) {
  auto& s = *shared;
  auto pause = kFirstAcceptPause;
  std::size_t failed_in_a_row = 0;
  for (;;) {
    // A place first: while every place is taken, the oldest pending connection is dropped and
    // the loop waits until its place is given back.
    HeldPlace place;
    while (!s.closed) {
      place = HeldPlace(places().take_or_wait(shared, descriptor_budget().max_pending));
      if (place) break;
      places().drop_oldest();
      s.room.expires_at(asio::steady_timer::time_point::max());
      boost::system::error_code ignored;
      co_await s.room.async_wait(asio::redirect_error(asio::use_awaitable, ignored));
    }
    if (s.closed) co_return;
    auto socket = std::make_shared<Socket>(asio::make_strand(s.io));
    boost::system::error_code error;
    co_await s.acceptor.async_accept(*socket, asio::redirect_error(asio::use_awaitable, error));
    if (s.closed || error == asio::error::operation_aborted || !s.acceptor.is_open()) co_return;
    std::string problem;
    if (error) {
      problem = fmt::format("accept failed: {}", error.message());
    } else {
      const DescriptorBudget budget = descriptor_budget();
      if (static_cast<std::size_t>(socket->native_handle()) + budget.reserve >= budget.limit) {
        problem = fmt::format("fewer than {} of {} file descriptors are free; closed {} at once",
                              budget.reserve, budget.limit, remote_description(*socket));
        socket->close(error);
      }
    }
    if (!problem.empty()) {
      place = HeldPlace();
      s.failures.fetch_add(1);
      ++failed_in_a_row;
      s.accept_log.warn(
          fmt::format("{}: {}; accepting again in {} ms", s.owner, problem, pause.count()));
      s.pause.expires_after(pause);
      pause = std::min(pause * 2, kMaxAcceptPause);
      co_await s.pause.async_wait(asio::redirect_error(asio::use_awaitable, error));
      continue;
    }
    if (failed_in_a_row > 0 && s.accept_log.suppressed() > 0)
      s.accept_log.warn(
          fmt::format("{}: accepting again after {} failed accepts", s.owner, failed_in_a_row));
    failed_in_a_row = 0;
    pause = kFirstAcceptPause;
    place->socket = socket;
    place->executor = socket->get_executor();
    std::shared_ptr<Place> taken = place.release();
    places().queue(taken);
    const auto executor = socket->get_executor();
    asio::co_spawn(executor, serve_one(shared, std::move(socket), std::move(taken), serve),
                   asio::detached);
  }
}

asio::awaitable<void> Listener::serve_one(std::shared_ptr<Shared> shared,
                                          std::shared_ptr<Socket> socket,
                                          std::shared_ptr<Place> place, Serve serve) {
  co_await serve(PendingConnection(std::move(shared), std::move(socket), std::move(place)));
}

}  // namespace pulseloco::transport::tcp
