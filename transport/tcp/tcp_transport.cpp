#include <pulseloco/transport/tcp/tcp_transport.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <latch>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/transport/tcp/asio_util.h>
#include <pulseloco/transport/tcp/frame.h>
#include <pulseloco/transport/tcp/handshake.h>
#include <pulseloco/transport/tcp/progress.h>
#include <pulseloco/transport/waiting.h>

namespace pulseloco::transport {

using tcp::Acceptor;
using tcp::EncodedHeader;
using tcp::FrameHeader;
using tcp::FrameKind;
using tcp::kFrameHeaderBytes;
using tcp::Socket;
namespace asio = boost::asio;

namespace {

// Receive staging buffer per connection: small frames are parsed out of it several at a time;
// payloads of at least kDirectReadBytes are read straight into their destination.
constexpr std::size_t kStagingBytes = 64 * 1024;
constexpr std::size_t kDirectReadBytes = 16 * 1024;
// A direct read takes at most this much, so that the payload checksum reads the bytes while the
// kernel's copy has left them in this core's L2 cache (2 MiB on the development machine).
// Uncapped, one read could take the rest of a 512 KiB frame, and the hash then found much of it
// evicted (by the next read, or by another process on the core): on the 2-core development
// machine that cost about 6% more CPU per 4 and 16 MiB all-gather (docs/benchmarks.md,
// session 12).
constexpr std::size_t kDirectReadMaxBytes = 128 * 1024;
// When a direct read completes, the next one is first tried at once (a non-blocking read on
// the strand) and its bytes hashed right after, at most this many times in a row before the
// lane goes back to Asio (fairness with the other connections, and a bounded stack). Through
// Asio, a completion handler runs behind whatever else is queued (other connections' reads and
// writes), and a probe of the 1 MiB all-gather found its hash running at about half its speed
// in cache: the bytes had left L1/L2 by then.
constexpr int kInlineDirectReads = 8;
// A write gathers queued frames up to this many payload bytes / frames into one system call.
constexpr std::size_t kBatchBytes = 256 * 1024;
constexpr std::size_t kBatchFrames = 32;
// Destruction waits at most this long for the peers to read what was sent to them.
constexpr auto kCloseTimeout = std::chrono::seconds(10);
// A connection attempt that has not completed the handshake after this long is dropped.
constexpr auto kAcceptHandshakeTimeout = std::chrono::seconds(10);

struct MessageKey {
  Tag tag = 0;
  std::uint64_t sequence = 0;
  friend bool operator==(const MessageKey&, const MessageKey&) = default;
};

struct MessageKeyHash {
  std::size_t operator()(const MessageKey& key) const noexcept {
    return std::hash<std::uint64_t>{}(key.tag * 0x9E3779B97F4A7C15ULL ^ key.sequence);
  }
};

}  // namespace

// ------------------------------------------------------------------------------------------------
// State. Everything below is guarded by Core::mutex_ unless it says otherwise; socket operations
// and the read-side fields of a Lane belong to the peer's strand.

// A received frame whose payload checksum matched: forwarding the same bytes may reuse it.
struct VerifiedFrame {
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  Digest checksum = 0;
};

// The payload checksums of one sent message, frame by frame, computed once by whichever write
// needs one first: sends of the same bytes to several peers (iforward of a send) share them,
// and a forwarded receive's frames start with the checksums verified on arrival.
//
// Why atomics and not std::call_once: glibc's pthread_once ends every first call with a
// futex_wake system call, whether or not anyone waits, which cost one system call per frame
// sent (most of this transport's futex calls in a profile of the 1 MiB all-gather). Writes to
// different peers run on different strands, so two threads may both find a cell unknown and
// both hash the frame: they store the same value (the digest of the same, unchanged bytes), so
// the race costs a duplicate hash and nothing else.
struct MessageChecksums {
  struct Cell {
    std::atomic<bool> known{false};
    std::atomic<Digest> value{0};
  };
  explicit MessageChecksums(std::size_t frames)
      : cells(std::make_unique<Cell[]>(frames)), count(frames) {}
  Digest get(std::size_t frame, std::span<const std::byte> payload) {
    Cell& cell = cells[frame];
    if (cell.known.load(std::memory_order_acquire))
      return cell.value.load(std::memory_order_relaxed);
    const Digest value = digest_bytes(payload);
    set_known(frame, value);
    return value;
  }
  void set_known(std::size_t frame, Digest value) {
    Cell& cell = cells[frame];
    cell.value.store(value, std::memory_order_relaxed);
    cell.known.store(true, std::memory_order_release);
  }
  std::unique_ptr<Cell[]> cells;
  std::size_t count;
};

// One isend or irecv.
struct Operation {
  bool is_send = false;
  int peer = 0;
  Tag tag = 0;
  std::uint64_t sequence = 0;
  std::uint64_t bytes = 0;
  Clock::time_point posted_at = Clock::now();
  bool done = false;
  std::exception_ptr error;
  // Sends.
  std::uint64_t chunks_left = 0;
  std::uint64_t bytes_written = 0;
  const std::byte* send_data = nullptr;
  std::shared_ptr<MessageChecksums> checksums;  // with payload checksums, to another rank
  // Receives.
  std::span<std::byte> recv_buffer;
  std::uint64_t bytes_arrived = 0;
  std::unique_ptr<std::byte[]> stash_to_copy;  // arrived early; the waiting thread copies it
  std::uint64_t stash_bytes = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> copy_ranges;  // [begin, end); none: all
  std::vector<VerifiedFrame> verified_frames;  // once complete: the frames checked on arrival
};

// One message from a peer, identified by (tag, sequence): an irecv posted before anything
// arrived, a message arriving, or a message that arrived before its irecv (kept in `stash`).
struct Slot {
  struct Range {
    std::uint64_t end = 0;
    bool stashed = false;  // went to the stash, not straight to the receive's buffer
  };
  std::shared_ptr<Operation> op;  // the irecv, once posted
  std::unique_ptr<std::byte[]> stash;
  std::uint64_t message_bytes = 0;
  std::uint64_t claimed = 0;              // bytes of chunks that have started arriving
  std::uint64_t received = 0;             // bytes of chunks that have arrived completely
  std::uint64_t stashed_bytes = 0;        // bytes of chunks that went to the stash
  std::map<std::uint64_t, Range> ranges;  // chunks of a striped message that started arriving
  bool announced = false;                 // a frame has arrived, so message_bytes is known
  bool discard = false;  // nobody wants it (size mismatch, abandoned): read and drop
  bool to_user = false;  // its irecv is posted: later chunks go straight to its buffer
  std::vector<VerifiedFrame> verified;  // frames whose checksum matched, in arrival order
  [[nodiscard]] bool complete() const noexcept { return announced && received == message_bytes; }
};

// A frame waiting to be written.
struct Chunk {
  std::shared_ptr<Operation> op;
  FrameHeader frame{};  // encoded (with the payload checksum) just before it is written
  EncodedHeader header{};
  std::span<const std::byte> payload;
  std::optional<FrameCorruption> corrupt;
  std::shared_ptr<MessageChecksums> checksums;  // with payload checksums: frame `index` of these
  std::size_t index = 0;
};

struct Lane {
  explicit Lane(asio::io_context& io) : socket(io) {}
  int index = 0;
  Socket socket;
  bool connected = false;
  bool closed = false;
  // Writing.
  bool writing = false;
  bool write_shut = false;  // we sent FIN
  bool shut_after_write = false;
  bool goodbye_wanted = false;
  std::vector<Chunk> batch;
  // Strand only:
  std::vector<asio::const_buffer> write_buffers;
  std::size_t write_first = 0;
  std::vector<EncodedHeader> corrupted_headers;
  std::vector<std::array<std::byte, 1>> corrupted_bytes;
  EncodedHeader control_header{};
  Clock::time_point last_write_progress{};
  // Reading (strand only, except `paused`, `key`, `goodbye_received` and `eof`).
  std::unique_ptr<std::byte[]> staging;
  std::size_t staging_begin = 0;
  std::size_t staging_end = 0;
  bool in_payload = false;
  FrameHeader frame{};
  MessageKey key{};
  std::byte* target = nullptr;  // where the rest of the payload goes; null: drop it
  bool hashing = false;         // the frame's payload checksum is being computed
  bool stashing = false;        // the payload goes to the stash (no irecv when the frame began)
  int inline_reads = 0;         // nested inline direct reads in progress (kInlineDirectReads)
  DigestStream payload_digest;
  std::uint64_t remaining = 0;
  std::string abort_reason;
  bool paused = false;  // too many early bytes: waiting for an irecv or for room
  bool goodbye_received = false;
  bool abort_received = false;
  bool eof = false;
  Clock::time_point last_read_progress{};
};

struct Peer {
  Peer(asio::io_context& io, int peer_rank) : rank(peer_rank), strand(asio::make_strand(io)) {}
  const int rank;
  asio::strand<asio::io_context::executor_type> strand;
  std::vector<std::unique_ptr<Lane>> lanes;
  std::unordered_map<Tag, std::uint64_t> next_send_sequence;
  std::unordered_map<Tag, std::uint64_t> next_recv_sequence;
  std::unordered_map<MessageKey, Slot, MessageKeyHash> slots;
  std::deque<Chunk> send_queue;
  std::exception_ptr failure;  // every pending and future operation with this peer fails
  std::string abort_reason;    // strand only: the peer sent an abort frame with this reason
  bool stalled = false;        // an operation with it timed out: closing does not wait for it
};

// ------------------------------------------------------------------------------------------------
// Core

class TcpTransport::Core : public std::enable_shared_from_this<TcpTransport::Core> {
 public:
  explicit Core(const TransportOptions& options);
  ~Core();
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  void bind_listener(const std::string& host, std::uint16_t port);
  void form_group(GroupTable table, Deadline deadline);
  void shutdown() noexcept;

  // `forwarded`: an earlier operation on the same bytes whose checksums may serve (iforward):
  // a completed receive (the checksums verified on arrival) or a send (its checksums, computed
  // once for both); or null.
  std::unique_ptr<Request> isend(int peer, Tag tag, std::span<const std::byte> data,
                                 const Operation* forwarded = nullptr);
  std::unique_ptr<Request> irecv(int peer, Tag tag, std::span<std::byte> data);
  void abort(std::string_view reason) noexcept;
  bool test(Operation& op);
  void wait(Operation& op, Deadline deadline);
  void abandon(const std::shared_ptr<Operation>& op) noexcept;

  TransportStats stats() const;
  void corrupt_outgoing_frame(CorruptFrame hook);
  // Wakes whoever waits on an operation or on the transport's state: threads blocked on
  // changed_, and callers driving the io_context (tcp/progress.h). Call without mutex_ held.
  void notify_waiters() {
    changed_.notify_all();
    progress_.completion_happened();
  }
  int callers_waiting() const noexcept { return progress_.drivers(); }
  void retire_tag(Tag tag) noexcept {
    const std::lock_guard lock(mutex_);
    for (auto& peer : peers_) {
      peer->next_send_sequence.erase(tag);
      peer->next_recv_sequence.erase(tag);
    }
  }
  std::size_t tag_counters() const {
    const std::lock_guard lock(mutex_);
    std::size_t count = 0;
    for (const auto& peer : peers_)
      count += peer->next_send_sequence.size() + peer->next_recv_sequence.size();
    return count;
  }
  std::uint64_t payload_bytes_copied() const noexcept { return payload_copied_.load(); }
  std::size_t unexpected_bytes() const {
    const std::lock_guard lock(mutex_);
    return unexpected_bytes_;
  }

  int rank_ = 0;
  int size_ = 1;
  std::uint16_t listen_port_ = 0;
  std::vector<PeerAddress> addresses_;
  std::atomic<int> refused_{0};

  // Formation.
  asio::awaitable<void> accept_loop();
  asio::awaitable<void> accept_one(std::shared_ptr<Socket> socket);
  asio::awaitable<void> connect_lane(int peer, int lane, Deadline deadline);
  std::string admit(const tcp::Hello& hello, int& claimed_lane);
  void install_lane(int peer, int lane, std::shared_ptr<Socket> socket);
  void formation_failed(std::exception_ptr error);
  void count_handshake(const tcp::HandshakeTraffic& traffic);

  // Writing (on the peer's strand).
  void pump_writes(Peer& peer);
  void start_write(Peer& peer, Lane& lane);
  void continue_write(Peer& peer, Lane& lane);
  void on_batch_written(Peer& peer, Lane& lane);
  void write_goodbye(Peer& peer, Lane& lane);
  void shut_write_side(Peer& peer, Lane& lane);

  // Reading (on the peer's strand).
  void read_more(Peer& peer, Lane& lane);
  void on_read(Peer& peer, Lane& lane, const boost::system::error_code& error, std::size_t n,
               bool direct);
  void process(Peer& peer, Lane& lane);
  bool begin_frame(Peer& peer, Lane& lane);  // false: stop reading (paused or failed)
  void read_rest_into_receive_if_posted(Peer& peer, Lane& lane);
  // Whether the irecv for message `key` from `peer` is posted.
  [[nodiscard]] bool receive_posted(Peer& peer, const MessageKey& key);
  // Returns true when the frame completed a posted receive.
  [[nodiscard]] bool finish_frame(Peer& peer, Lane& lane);
  void resume_lanes(Peer& peer);

  // Failures and closing.
  void on_lane_error(Peer& peer, Lane& lane, const boost::system::error_code& error,
                     std::string_view doing);
  void end_lane_after_abort(Peer& peer, Lane& lane);
  void protocol_violation(Peer& peer, const std::string& problem,
                          std::optional<std::uint64_t> offset = std::nullopt);
  void fail_peer_locked(Peer& peer, const std::exception_ptr& error, bool log);
  void fail_peer_on_strand(Peer& peer, const std::exception_ptr& error, bool log = true);
  void close_lanes_on_strand(Peer& peer, const std::exception_ptr& orphan_error);
  void tell_peer_why(Peer& peer, std::string_view reason);
  void graceful_close() noexcept;
  void check_progress();
  void run_on_every_strand_and_wait(const std::function<void(Peer&)>& work) noexcept;
  void fail_everything_locked(const std::exception_ptr& error);

  void deliver_locally(Operation& op, std::span<const std::byte> data);
  void complete_recv_locked(Operation& op);
  void release_unexpected_locked(std::uint64_t bytes);
  bool finish_if_ready(Operation& op, std::unique_lock<std::mutex>& lock);
  [[nodiscard]] ErrorContext context_for(int peer) const {
    return ErrorContext{.rank = rank_, .peer = peer};
  }
  [[nodiscard]] std::exception_ptr peer_lost(int peer, std::string_view message) const {
    return std::make_exception_ptr(PeerLostError(message, context_for(peer)));
  }
  [[nodiscard]] std::exception_ptr size_mismatch(int peer, Tag tag, std::uint64_t sent,
                                                 std::uint64_t expected) const {
    return std::make_exception_ptr(ProtocolError(
        fmt::format("peer {} sent {} bytes under tag {} but the matching receive expects {} "
                    "bytes",
                    peer, sent, tag, expected),
        context_for(peer)));
  }

  GroupId group_id_{};

 private:
  const TransportOptions options_;
  const int lanes_per_peer_;
  asio::io_context io_;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work_;
  // Runs io_: the I/O threads, or a caller busy-polling in wait() (tcp/progress.h).
  tcp::Progress progress_;
  // The listener and the progress timer live on this strand (there may be several I/O threads).
  asio::strand<asio::io_context::executor_type> control_;
  Acceptor acceptor_;
  std::optional<asio::steady_timer> progress_timer_;
  std::vector<std::unique_ptr<Peer>> peers_;  // by rank; our own entry holds self-messages

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::exception_ptr aborted_;
  bool closing_ = false;
  bool shut_down_ = false;
  bool formed_ = false;  // the whole mesh was connected
  int lanes_missing_ = 0;
  std::vector<std::vector<bool>> lane_claimed_;
  std::exception_ptr formation_error_;
  std::size_t unexpected_bytes_ = 0;
  int paused_lanes_ = 0;
  std::uint64_t data_frames_sent_ = 0;
  std::optional<std::uint64_t> corrupt_at_;
  FrameCorruption corrupt_target_ = FrameCorruption::payload;
  TransportStats stats_;  // the payload and message counters
  std::atomic<std::uint64_t> wire_sent_{0};
  std::atomic<std::uint64_t> wire_received_{0};
  std::atomic<std::uint64_t> payload_copied_{0};  // TcpTransport::payload_bytes_copied()
};

namespace {

class TcpRequest final : public Request {
 public:
  TcpRequest(std::shared_ptr<TcpTransport::Core> core, std::shared_ptr<Operation> op)
      : core_(std::move(core)), op_(std::move(op)) {}
  ~TcpRequest() override { core_->abandon(op_); }
  TcpRequest(const TcpRequest&) = delete;
  TcpRequest& operator=(const TcpRequest&) = delete;

  bool test() override { return core_->test(*op_); }
  void wait(Deadline deadline) override { core_->wait(*op_, deadline); }
  [[nodiscard]] const TcpTransport::Core* core() const noexcept { return core_.get(); }
  [[nodiscard]] const Operation& operation() const noexcept { return *op_; }

 private:
  std::shared_ptr<TcpTransport::Core> core_;
  std::shared_ptr<Operation> op_;
};

std::string what_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

TcpTransport::Core::Core(const TransportOptions& options)
    : options_(options),
      lanes_per_peer_(options.connections_per_peer),
      work_(asio::make_work_guard(io_)),
      progress_(io_, options.busy_poll),
      control_(asio::make_strand(io_)),
      acceptor_(control_) {
  if (options.corrupt_frame) {
    corrupt_at_ = options.corrupt_frame->frame_index;
    corrupt_target_ = options.corrupt_frame->target;
  }
}

TcpTransport::Core::~Core() {
  shutdown();
}

void TcpTransport::Core::bind_listener(const std::string& host, std::uint16_t port) {
  try {
    const auto address = asio::ip::make_address(host.empty() ? "0.0.0.0" : host);
    const tcp::Endpoint endpoint(address, port);
    acceptor_.open(endpoint.protocol());
    acceptor_.set_option(asio::socket_base::reuse_address(true));
    tcp::apply_buffer_sizes(acceptor_, options_);
    acceptor_.bind(endpoint);
    acceptor_.listen(asio::socket_base::max_listen_connections);
    listen_port_ = acceptor_.local_endpoint().port();
  } catch (const boost::system::system_error& error) {
    throw IoError(fmt::format("tcp transport: cannot listen on {}:{}: {}",
                              host.empty() ? "*" : host, port, error.code().message()));
  }
}

void TcpTransport::Core::count_handshake(const tcp::HandshakeTraffic& traffic) {
  wire_sent_ += traffic.bytes_sent;
  wire_received_ += traffic.bytes_received;
}

void TcpTransport::Core::form_group(GroupTable table, Deadline deadline) {
  rank_ = table.rank;
  size_ = table.size();
  group_id_ = table.group_id;
  addresses_ = table.peers;
  for (int peer = 0; peer < size_; ++peer) {
    peers_.push_back(std::make_unique<Peer>(io_, peer));
    if (peer == rank_) continue;
    for (int index = 0; index < lanes_per_peer_; ++index) {
      auto lane = std::make_unique<Lane>(io_);
      lane->index = index;
      lane->staging = std::make_unique_for_overwrite<std::byte[]>(kStagingBytes);
      peers_.back()->lanes.push_back(std::move(lane));
    }
  }
  lane_claimed_.assign(static_cast<std::size_t>(size_),
                       std::vector<bool>(static_cast<std::size_t>(lanes_per_peer_), false));
  lanes_missing_ = (size_ - 1) * lanes_per_peer_;
  if (options_.secret.empty() && size_ > 1 && rank_ == 0)
    logger().warn(
        "tcp transport: no shared secret (PULSELOCO_SECRET): connections are not authenticated");

  if (size_ > 1) {
    asio::co_spawn(control_, accept_loop(), asio::detached);
    for (int peer = rank_ + 1; peer < size_; ++peer)
      for (int lane = 0; lane < lanes_per_peer_; ++lane)
        asio::co_spawn(asio::make_strand(io_), connect_lane(peer, lane, deadline), asio::detached);
  }
  if (options_.io_timeout.count() > 0) {
    progress_timer_.emplace(control_);
    check_progress();
  }
  progress_.start_threads(std::max(1, options_.io_threads), [](const std::exception& error) {
    logger().error("tcp transport: unexpected error on the I/O thread: {}", error.what());
  });

  std::unique_lock lock(mutex_);
  changed_.wait_until(lock, deadline, [&] { return lanes_missing_ == 0 || formation_error_; });
  if (formation_error_) std::rethrow_exception(formation_error_);
  if (lanes_missing_ > 0) {
    std::vector<int> missing;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      const auto& claimed = lane_claimed_[static_cast<std::size_t>(peer)];
      if (std::count(claimed.begin(), claimed.end(), true) < lanes_per_peer_)
        missing.push_back(peer);
    }
    ErrorContext context = context_for(missing.empty() ? -1 : missing.front());
    context.ranks = missing;
    throw TimeoutError(
        fmt::format("tcp transport: could not connect to peers {} within {} ms ({} of {} "
                    "connections missing)",
                    fmt::join(missing, ", "), to_ms(options_.connect_timeout), lanes_missing_,
                    (size_ - 1) * lanes_per_peer_),
        std::move(context));
  }
  formed_ = true;
  logger().debug("tcp transport: rank {} of {} connected ({} connections per peer)", rank_, size_,
                 lanes_per_peer_);
}

void TcpTransport::Core::formation_failed(std::exception_ptr error) {
  {
    const std::lock_guard lock(mutex_);
    if (!formation_error_) formation_error_ = std::move(error);
  }
  notify_waiters();
}

asio::awaitable<void> TcpTransport::Core::accept_loop() {
  for (;;) {
    auto socket = std::make_shared<Socket>(asio::make_strand(io_));
    boost::system::error_code error;
    co_await acceptor_.async_accept(*socket, asio::redirect_error(asio::use_awaitable, error));
    if (error == asio::error::operation_aborted || !acceptor_.is_open()) co_return;
    if (error) {
      logger().warn("tcp transport: accept failed: {}", error.message());
      continue;
    }
    const auto executor = socket->get_executor();
    asio::co_spawn(executor, accept_one(std::move(socket)), asio::detached);
  }
}

std::string TcpTransport::Core::admit(const tcp::Hello& hello, int& claimed_lane) {
  if (hello.purpose != tcp::Purpose::data) return "this is a data listener, not a rendezvous";
  if (hello.group_id != group_id_) return "it belongs to another group (the group id differs)";
  if (hello.world_size != static_cast<std::uint32_t>(size_))
    return fmt::format("its world size {} differs from ours ({})", hello.world_size, size_);
  if (hello.dst_rank != static_cast<std::uint32_t>(rank_))
    return fmt::format("it wants rank {}, this is rank {}", hello.dst_rank, rank_);
  if (hello.src_rank >= static_cast<std::uint32_t>(rank_))
    return fmt::format("rank {} is connected to by this rank, it must not connect here",
                       hello.src_rank);
  if (hello.lanes != static_cast<std::uint16_t>(lanes_per_peer_) || hello.lane >= hello.lanes)
    return fmt::format("connection {} of {} does not match our {} connections per peer", hello.lane,
                       hello.lanes, lanes_per_peer_);
  const std::lock_guard lock(mutex_);
  if (closing_ || aborted_) return "the transport is closing";
  if (lane_claimed_[hello.src_rank][hello.lane])
    return fmt::format("connection {} from rank {} already exists", hello.lane, hello.src_rank);
  lane_claimed_[hello.src_rank][hello.lane] = true;
  claimed_lane = hello.lane;
  return {};
}

asio::awaitable<void> TcpTransport::Core::accept_one(std::shared_ptr<Socket> socket) {
  const std::string from = tcp::remote_description(*socket);
  tcp::apply_socket_options(*socket, options_);
  int claimed_lane = -1;
  try {
    tcp::ServerHandshake result;
    {
      tcp::Watchdog watchdog(socket->get_executor(), Clock::now() + kAcceptHandshakeTimeout,
                             [socket] {
                               boost::system::error_code ignored;
                               socket->close(ignored);
                             });
      result = co_await tcp::server_handshake(
          *socket, options_.secret,
          [&](const tcp::Hello& hello) { return admit(hello, claimed_lane); });
    }
    count_handshake(result.traffic);
    if (!result.accepted) {
      refused_.fetch_add(1);
      logger().warn("tcp transport: rank {} refused a connection from {} claiming rank {}: {}",
                    rank_, from, result.hello.src_rank, result.refusal);
      co_return;
    }
    install_lane(static_cast<int>(result.hello.src_rank), claimed_lane, std::move(socket));
  } catch (const std::exception& error) {
    refused_.fetch_add(1);
    logger().warn("tcp transport: rank {} dropped a connection from {} during the handshake: {}",
                  rank_, from, error.what());
  }
}

asio::awaitable<void> TcpTransport::Core::connect_lane(int peer, int lane, Deadline deadline) {
  const PeerAddress& address = addresses_[static_cast<std::size_t>(peer)];
  const auto executor = co_await asio::this_coro::executor;
  auto backoff = std::chrono::milliseconds(10);
  std::string last_problem = "no attempt";
  for (;;) {
    {
      const std::lock_guard lock(mutex_);
      if (closing_ || aborted_ || formation_error_) co_return;
    }
    if (Clock::now() >= deadline) co_return;  // form_group reports the missing peers
    auto socket = std::make_shared<Socket>(executor);
    boost::system::error_code error;
    try {
      const auto endpoint = tcp::resolve_endpoint(io_, address.host, address.port);
      socket->open(endpoint.protocol());
      tcp::apply_buffer_sizes(*socket, options_);
      tcp::Watchdog watchdog(executor, deadline, [socket] {
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
      tcp::apply_socket_options(*socket, options_);
      tcp::Hello hello;
      hello.purpose = tcp::Purpose::data;
      hello.src_rank = static_cast<std::uint32_t>(rank_);
      hello.dst_rank = static_cast<std::uint32_t>(peer);
      hello.world_size = static_cast<std::uint32_t>(size_);
      hello.lane = static_cast<std::uint16_t>(lane);
      hello.lanes = static_cast<std::uint16_t>(lanes_per_peer_);
      hello.group_id = group_id_;
      std::exception_ptr refusal;
      try {
        tcp::Watchdog watchdog(executor, deadline, [socket] {
          boost::system::error_code ignored;
          socket->close(ignored);
        });
        count_handshake(co_await tcp::client_handshake(*socket, hello, options_.secret));
        install_lane(peer, lane, std::move(socket));
        co_return;
      } catch (const tcp::HandshakeRefused& refused) {
        refusal = std::make_exception_ptr(
            ProtocolError(fmt::format("tcp transport: connection {} to peer {} at {}: {}", lane,
                                      peer, to_string(address), refused.message()),
                          context_for(peer)));
      } catch (const std::exception& problem) {
        last_problem = problem.what();  // e.g. the peer dropped us during the handshake: retry
      }
      if (refusal) {
        formation_failed(refusal);
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

void TcpTransport::Core::install_lane(int peer_rank, int lane_index,
                                      std::shared_ptr<Socket> socket) {
  Peer& peer = *peers_[static_cast<std::size_t>(peer_rank)];
  asio::post(peer.strand, [this, &peer, peer_rank, lane_index, socket = std::move(socket)] {
    Lane& lane = *peer.lanes[static_cast<std::size_t>(lane_index)];
    {
      const std::lock_guard lock(mutex_);
      lane.socket = std::move(*socket);
      if (closing_ || aborted_ || peer.failure) {
        boost::system::error_code ignored;
        lane.socket.close(ignored);
        lane.closed = true;
        return;
      }
      lane.connected = true;
      // Synchronous reads (read_more's inline direct reads) must never block the strand.
      boost::system::error_code ignored;
      lane.socket.non_blocking(true, ignored);
      lane_claimed_[static_cast<std::size_t>(peer_rank)][static_cast<std::size_t>(lane_index)] =
          true;
      --lanes_missing_;
    }
    lane.last_read_progress = lane.last_write_progress = Clock::now();
    notify_waiters();
    read_more(peer, lane);
    pump_writes(peer);
  });
}

// ------------------------------------------------------------------------------------------------
// Sending

std::unique_ptr<Request> TcpTransport::Core::isend(int peer_rank, Tag tag,
                                                   std::span<const std::byte> data,
                                                   const Operation* forwarded) {
  if (peer_rank < 0 || peer_rank >= size_)
    throw InvalidArgument(fmt::format("isend: peer {} is not in [0, {})", peer_rank, size_),
                          ErrorContext{.rank = rank_});
  auto op = std::make_shared<Operation>();
  op->is_send = true;
  op->peer = peer_rank;
  op->tag = tag;
  op->bytes = data.size();
  auto request = std::make_unique<TcpRequest>(shared_from_this(), op);
  if (peer_rank == rank_) {
    deliver_locally(*op, data);
    return request;
  }
  Peer& peer = *peers_[static_cast<std::size_t>(peer_rank)];
  const auto plan = tcp::plan_chunks(data.size(), lanes_per_peer_, options_.stripe_threshold_bytes,
                                     options_.stripe_chunk_bytes);
  {
    const std::lock_guard lock(mutex_);
    if (aborted_ || peer.failure) {
      op->error = aborted_ ? aborted_ : peer.failure;
      return request;
    }
    op->sequence = peer.next_send_sequence[tag]++;
    op->chunks_left = plan.count;
  }
  // The checksums verified when the forwarded bytes arrived, for frames cut the same way, or
  // those of an earlier send of the same bytes.
  std::vector<VerifiedFrame> verified;
  std::shared_ptr<MessageChecksums> checksums;
  if (forwarded != nullptr && options_.payload_checksums) {
    const std::lock_guard lock(mutex_);
    if (forwarded->is_send) {
      if (forwarded->send_data == data.data() && forwarded->bytes == data.size() &&
          forwarded->checksums && forwarded->checksums->count == plan.count)
        checksums = forwarded->checksums;
    } else if (forwarded->done && !forwarded->error &&
               forwarded->recv_buffer.data() == data.data() && forwarded->bytes == data.size()) {
      verified = forwarded->verified_frames;
    }
  }
  if (options_.payload_checksums && !checksums)
    checksums = std::make_shared<MessageChecksums>(plan.count);
  op->send_data = data.data();
  op->checksums = checksums;
  std::vector<Chunk> chunks(plan.count);
  for (std::uint64_t i = 0; i < plan.count; ++i) {
    const std::uint64_t offset = i * plan.chunk_bytes;
    const std::uint64_t length = std::min<std::uint64_t>(plan.chunk_bytes, data.size() - offset);
    Chunk& chunk = chunks[i];
    chunk.op = op;
    chunk.payload = data.subspan(offset, length);
    chunk.frame.kind = FrameKind::data;
    chunk.frame.tag = tag;
    chunk.frame.sequence = op->sequence;
    chunk.frame.message_bytes = data.size();
    chunk.frame.chunk_offset = offset;
    chunk.frame.chunk_bytes = length;
    chunk.frame.has_payload_checksum = options_.payload_checksums;
    chunk.checksums = checksums;
    chunk.index = i;
    for (const VerifiedFrame& frame : verified) {
      if (frame.offset == offset && frame.bytes == length) {
        checksums->set_known(i, frame.checksum);
        break;
      }
    }
  }
  bool kick = false;
  {
    const std::lock_guard lock(mutex_);
    if (aborted_ || peer.failure) {
      if (!op->done && !op->error) op->error = aborted_ ? aborted_ : peer.failure;
      return request;
    }
    for (auto& chunk : chunks)
      peer.send_queue.push_back(std::move(chunk));
    // A busy connection picks the new frames up when its current write completes.
    for (const auto& lane : peer.lanes)
      kick = kick || (lane->connected && !lane->closed && !lane->writing && !lane->write_shut);
  }
  if (kick) asio::post(peer.strand, [this, &peer] { pump_writes(peer); });
  return request;
}

void TcpTransport::Core::deliver_locally(Operation& op, std::span<const std::byte> data) {
  {
    const std::lock_guard lock(mutex_);
    if (aborted_) {
      op.error = aborted_;
      return;
    }
    Peer& self = *peers_[static_cast<std::size_t>(rank_)];
    op.sequence = self.next_send_sequence[op.tag]++;
    const MessageKey key{op.tag, op.sequence};
    auto it = self.slots.find(key);
    if (it != self.slots.end()) {
      // The irecv was posted first (or posted and abandoned): hand the bytes over now.
      auto recv = std::move(it->second.op);
      self.slots.erase(it);
      if (recv && recv->recv_buffer.size() != data.size()) {
        recv->error = size_mismatch(rank_, op.tag, data.size(), recv->recv_buffer.size());
      } else if (recv) {
        if (!data.empty()) std::memcpy(recv->recv_buffer.data(), data.data(), data.size());
        payload_copied_ += data.size();
        recv->bytes_arrived = data.size();
        complete_recv_locked(*recv);
      }
    } else {
      Slot slot;
      slot.announced = true;
      slot.message_bytes = slot.claimed = slot.received = data.size();
      if (!data.empty()) {
        slot.stash = std::make_unique_for_overwrite<std::byte[]>(data.size());
        std::memcpy(slot.stash.get(), data.data(), data.size());
        payload_copied_ += data.size();
        unexpected_bytes_ += data.size();
      }
      self.slots.emplace(key, std::move(slot));
    }
    op.done = true;
    stats_.payload_bytes_sent += data.size();
    ++stats_.messages_sent;
  }
  notify_waiters();
}

void TcpTransport::Core::pump_writes(Peer& peer) {
  for (auto& lane : peer.lanes)
    start_write(peer, *lane);
}

void TcpTransport::Core::start_write(Peer& peer, Lane& lane) {
  bool goodbye = false;
  bool shut = false;
  {
    const std::lock_guard lock(mutex_);
    if (lane.writing || lane.closed || lane.write_shut || !lane.connected || peer.failure) return;
    std::size_t bytes = 0;
    while (!peer.send_queue.empty() && lane.batch.size() < kBatchFrames) {
      Chunk& next = peer.send_queue.front();
      if (!lane.batch.empty() && bytes + next.payload.size() > kBatchBytes) break;
      bytes += next.payload.size();
      lane.batch.push_back(std::move(next));
      peer.send_queue.pop_front();
      if (corrupt_at_ && data_frames_sent_ == *corrupt_at_) {
        lane.batch.back().corrupt = corrupt_target_;
        corrupt_at_.reset();
      }
      ++data_frames_sent_;
    }
    if (lane.batch.empty()) {
      goodbye = lane.goodbye_wanted;
      shut = !goodbye && lane.shut_after_write;
      if (!goodbye && !shut) return;
    }
    lane.writing = true;
  }
  if (goodbye) {
    write_goodbye(peer, lane);
    return;
  }
  if (shut) {
    {
      const std::lock_guard lock(mutex_);
      lane.writing = false;
    }
    shut_write_side(peer, lane);
    return;
  }
  // One scatter-gather write: header, payload, header, payload, ... straight from the callers'
  // buffers. The test hook swaps in a corrupted copy of one header or one payload byte.
  lane.write_buffers.clear();
  lane.write_first = 0;
  lane.corrupted_headers.clear();
  lane.corrupted_bytes.clear();
  lane.corrupted_headers.reserve(lane.batch.size());
  lane.corrupted_bytes.reserve(lane.batch.size());
  for (Chunk& chunk : lane.batch) {
    // Checksummed right before the write, so that the kernel's copy finds the bytes in cache.
    if (chunk.frame.has_payload_checksum)
      chunk.frame.payload_checksum = chunk.checksums->get(chunk.index, chunk.payload);
    chunk.header = tcp::encode_header(chunk.frame);
  }
  for (const Chunk& chunk : lane.batch) {
    const auto& payload = chunk.payload;
    const bool corrupt_header =
        chunk.corrupt && (*chunk.corrupt == FrameCorruption::header || payload.empty());
    if (corrupt_header) {
      lane.corrupted_headers.push_back(chunk.header);
      lane.corrupted_headers.back()[20] ^= std::byte{0x01};  // a bit of the sequence number
      lane.write_buffers.emplace_back(asio::buffer(lane.corrupted_headers.back()));
    } else {
      lane.write_buffers.emplace_back(asio::buffer(chunk.header));
    }
    if (payload.empty()) continue;
    if (chunk.corrupt && !corrupt_header) {
      const std::size_t middle = payload.size() / 2;
      lane.corrupted_bytes.push_back({payload[middle] ^ std::byte{0x01}});
      if (middle > 0) lane.write_buffers.emplace_back(payload.data(), middle);
      lane.write_buffers.emplace_back(asio::buffer(lane.corrupted_bytes.back()));
      if (middle + 1 < payload.size())
        lane.write_buffers.emplace_back(payload.data() + middle + 1, payload.size() - middle - 1);
      logger().warn("tcp transport: test hook: corrupting a payload byte of a frame to peer {}",
                    peer.rank);
    } else {
      lane.write_buffers.emplace_back(payload.data(), payload.size());
    }
    if (corrupt_header)
      logger().warn("tcp transport: test hook: corrupting a frame header to peer {}", peer.rank);
  }
  continue_write(peer, lane);
}

void TcpTransport::Core::continue_write(Peer& peer, Lane& lane) {
  const std::span<const asio::const_buffer> rest(lane.write_buffers.data() + lane.write_first,
                                                 lane.write_buffers.size() - lane.write_first);
  lane.socket.async_write_some(
      rest,
      asio::bind_executor(peer.strand, [this, &peer, &lane](const boost::system::error_code& error,
                                                            std::size_t written) {
        if (error) {
          on_lane_error(peer, lane, error, "sending");
          return;
        }
        wire_sent_ += written;
        lane.last_write_progress = Clock::now();
        while (written > 0) {
          auto& buffer = lane.write_buffers[lane.write_first];
          if (written >= buffer.size()) {
            written -= buffer.size();
            ++lane.write_first;
          } else {
            buffer += written;
            written = 0;
          }
        }
        if (lane.write_first == lane.write_buffers.size()) {
          on_batch_written(peer, lane);
        } else {
          continue_write(peer, lane);
        }
      }));
}

void TcpTransport::Core::on_batch_written(Peer& peer, Lane& lane) {
  bool completed = false;
  {
    const std::lock_guard lock(mutex_);
    for (const Chunk& chunk : lane.batch) {
      Operation& op = *chunk.op;
      --op.chunks_left;
      op.bytes_written += chunk.payload.size();
      if (op.chunks_left == 0 && !op.done && !op.error) {
        op.done = true;
        stats_.payload_bytes_sent += op.bytes;
        ++stats_.messages_sent;
        completed = true;
      }
    }
    lane.batch.clear();
    lane.writing = false;
  }
  if (completed) notify_waiters();
  start_write(peer, lane);
}

void TcpTransport::Core::write_goodbye(Peer& peer, Lane& lane) {
  {
    const std::lock_guard lock(mutex_);
    lane.goodbye_wanted = false;
  }
  FrameHeader header;
  header.kind = FrameKind::goodbye;
  lane.control_header = tcp::encode_header(header);
  asio::async_write(
      lane.socket, asio::buffer(lane.control_header),
      asio::bind_executor(peer.strand, [this, &peer, &lane](const boost::system::error_code& error,
                                                            std::size_t written) {
        wire_sent_ += written;
        {
          const std::lock_guard lock(mutex_);
          lane.writing = false;
        }
        if (error) {
          on_lane_error(peer, lane, error, "saying goodbye");
          return;
        }
        shut_write_side(peer, lane);
      }));
}

void TcpTransport::Core::shut_write_side(Peer& peer, Lane& lane) {
  (void)peer;
  boost::system::error_code ignored;
  lane.socket.shutdown(Socket::shutdown_send, ignored);
  bool close_now = false;
  {
    const std::lock_guard lock(mutex_);
    lane.write_shut = true;
    close_now = lane.eof;
    if (close_now) lane.closed = true;
  }
  if (close_now) lane.socket.close(ignored);
  notify_waiters();
}

// ------------------------------------------------------------------------------------------------
// Receiving

std::unique_ptr<Request> TcpTransport::Core::irecv(int peer_rank, Tag tag,
                                                   std::span<std::byte> data) {
  if (peer_rank < 0 || peer_rank >= size_)
    throw InvalidArgument(fmt::format("irecv: peer {} is not in [0, {})", peer_rank, size_),
                          ErrorContext{.rank = rank_});
  auto op = std::make_shared<Operation>();
  op->peer = peer_rank;
  op->tag = tag;
  op->bytes = data.size();
  op->recv_buffer = data;
  auto request = std::make_unique<TcpRequest>(shared_from_this(), op);
  Peer& peer = *peers_[static_cast<std::size_t>(peer_rank)];
  bool resume = false;
  bool completed = false;
  {
    const std::lock_guard lock(mutex_);
    if (aborted_) {
      op->error = aborted_;
      return request;
    }
    op->sequence = peer.next_recv_sequence[tag]++;
    const MessageKey key{tag, op->sequence};
    auto it = peer.slots.find(key);
    if (it == peer.slots.end()) {
      if (peer.failure) {
        op->error = peer.failure;
        return request;
      }
      Slot slot;
      slot.op = op;
      peer.slots.emplace(key, std::move(slot));
      for (const auto& lane : peer.lanes)
        resume = resume || (lane->paused && lane->key == key);
    } else {
      Slot& slot = it->second;
      PULSELOCO_CHECK(slot.announced && !slot.op, "irecv matched a slot that is already posted");
      if (slot.message_bytes != data.size()) {
        op->error = size_mismatch(peer_rank, tag, slot.message_bytes, data.size());
        if (slot.complete()) {
          if (slot.stash) release_unexpected_locked(slot.message_bytes);
          peer.slots.erase(it);
        } else {
          slot.discard = true;
        }
      } else if (slot.complete()) {
        op->bytes_arrived = slot.message_bytes;
        op->verified_frames = std::move(slot.verified);
        if (slot.stash) {
          op->stash_to_copy = std::move(slot.stash);
          op->stash_bytes = slot.message_bytes;
        } else {
          complete_recv_locked(*op);
          completed = true;
        }
        peer.slots.erase(it);
      } else {
        // Still arriving: the chunks to come go straight into the caller's buffer, those that
        // went to the stash are copied over once the message is complete.
        slot.op = op;
        slot.to_user = true;
        op->bytes_arrived = slot.received;
      }
    }
  }
  if (completed) notify_waiters();
  if (resume) asio::post(peer.strand, [this, &peer] { resume_lanes(peer); });
  return request;
}

void TcpTransport::Core::complete_recv_locked(Operation& op) {
  op.done = true;
  stats_.payload_bytes_received += op.bytes;
  ++stats_.messages_received;
}

void TcpTransport::Core::release_unexpected_locked(std::uint64_t bytes) {
  unexpected_bytes_ -= bytes;
  if (paused_lanes_ == 0) return;
  for (auto& peer : peers_) {
    const bool has_paused = std::any_of(peer->lanes.begin(), peer->lanes.end(),
                                        [](const auto& lane) { return lane->paused; });
    if (has_paused) asio::post(peer->strand, [this, p = peer.get()] { resume_lanes(*p); });
  }
}

void TcpTransport::Core::read_more(Peer& peer, Lane& lane) {
  if (lane.closed || lane.paused) return;
  read_rest_into_receive_if_posted(peer, lane);
  if (lane.in_payload && lane.target != nullptr && lane.staging_begin == lane.staging_end &&
      lane.remaining >= kDirectReadBytes) {
    const auto destination = asio::buffer(
        lane.target,
        static_cast<std::size_t>(std::min<std::uint64_t>(lane.remaining, kDirectReadMaxBytes)));
    if (lane.inline_reads < kInlineDirectReads) {
      // What is waiting already is read now, so that its hash finds it in the cache.
      boost::system::error_code error;
      const std::size_t n = lane.socket.read_some(destination, error);
      if (error != asio::error::would_block && error != asio::error::try_again) {
        ++lane.inline_reads;
        on_read(peer, lane, error, n, true);
        --lane.inline_reads;
        return;
      }
    }
    // Straight into the destination (the caller's buffer when its irecv is posted).
    lane.socket.async_read_some(
        destination, asio::bind_executor(
                         peer.strand, [this, &peer, &lane](const boost::system::error_code& error,
                                                           std::size_t n) {
                           on_read(peer, lane, error, n, true);
                         }));
    return;
  }
  if (lane.staging_begin > 0) {
    const std::size_t kept = lane.staging_end - lane.staging_begin;
    std::memmove(lane.staging.get(), lane.staging.get() + lane.staging_begin, kept);
    lane.staging_begin = 0;
    lane.staging_end = kept;
  }
  // Reading as much as the staging buffer holds would take in up to 64 KiB of the next frame's
  // payload, to be copied out again; bounded, the rest of a large frame goes straight to its
  // destination while small frames still arrive whole with their header.
  const std::size_t rest_of_frame = lane.in_payload ? static_cast<std::size_t>(lane.remaining) : 0;
  const std::size_t room = std::min(kStagingBytes - lane.staging_end,
                                    rest_of_frame + kFrameHeaderBytes + kDirectReadBytes);
  lane.socket.async_read_some(
      asio::buffer(lane.staging.get() + lane.staging_end, room),
      asio::bind_executor(
          peer.strand, [this, &peer, &lane](const boost::system::error_code& error, std::size_t n) {
            on_read(peer, lane, error, n, false);
          }));
}

void TcpTransport::Core::on_read(Peer& peer, Lane& lane, const boost::system::error_code& error,
                                 std::size_t n, bool direct) {
  if (lane.closed) return;
  if (error) {
    on_lane_error(peer, lane, error, "receiving");
    return;
  }
  wire_received_ += n;
  lane.last_read_progress = Clock::now();
  if (direct) {
    const std::span<const std::byte> arrived(lane.target, n);
    lane.target += n;
    lane.remaining -= n;
    // Hashed before the next read is started: Asio performs that read at once when data is
    // waiting, and its copy would push these bytes out of the cache first. (The kernel reopens
    // the receive window when a read drains the socket, not when the next one is posted.)
    if (lane.hashing) lane.payload_digest.update(arrived);
  } else {
    lane.staging_end += n;
  }
  process(peer, lane);
}

void TcpTransport::Core::process(Peer& peer, Lane& lane) {
  bool completed_a_receive = false;  // by a frame this call finished
  while (!lane.closed) {
    if (!lane.in_payload) {
      if (lane.staging_end - lane.staging_begin < kFrameHeaderBytes) break;
      std::string problem;
      const auto header =
          tcp::decode_header(std::span<const std::byte, kFrameHeaderBytes>(
                                 lane.staging.get() + lane.staging_begin, kFrameHeaderBytes),
                             problem);
      if (!header) {
        protocol_violation(peer, fmt::format("{} on connection {}", problem, lane.index));
        return;
      }
      if (completed_a_receive && header->kind == FrameKind::data && header->message_bytes > 0 &&
          !receive_posted(peer, {header->tag, header->sequence})) {
        // This frame would go to the stash, and be copied out again later; but a receive
        // completed just now, and the caller waiting for it often posts this frame's receive
        // next (a collective's payload after its header). It runs first if this connection
        // goes on in a new handler (drive_until looks at its operation after every handler).
        asio::post(peer.strand, [this, &peer, &lane] { process(peer, lane); });
        return;
      }
      lane.staging_begin += kFrameHeaderBytes;
      lane.frame = *header;
      if (!begin_frame(peer, lane)) return;  // paused, or the peer failed
      continue;
    }
    const std::size_t available = lane.staging_end - lane.staging_begin;
    const auto take = static_cast<std::size_t>(std::min<std::uint64_t>(lane.remaining, available));
    if (take > 0) {
      read_rest_into_receive_if_posted(peer, lane);
      if (lane.target != nullptr) {
        std::memcpy(lane.target, lane.staging.get() + lane.staging_begin, take);
        payload_copied_ += take;
        if (lane.hashing) lane.payload_digest.update(std::span<const std::byte>(lane.target, take));
        lane.target += take;
      }
      lane.staging_begin += take;
      lane.remaining -= take;
    }
    if (lane.remaining > 0) break;
    if (finish_frame(peer, lane)) completed_a_receive = true;
  }
  read_more(peer, lane);
}

bool TcpTransport::Core::begin_frame(Peer& peer, Lane& lane) {
  const FrameHeader& frame = lane.frame;
  if (frame.kind == FrameKind::goodbye) {
    bool everyone = true;
    bool shut_now = false;
    {
      const std::lock_guard lock(mutex_);
      lane.goodbye_received = true;
      for (const auto& other : peer.lanes)
        everyone = everyone && other->goodbye_received;
      if (!lane.writing) {
        shut_now = !lane.write_shut;
      } else {
        lane.shut_after_write = true;
      }
    }
    if (everyone) {
      // The peer sent everything it will ever send; complete early arrivals stay receivable.
      fail_peer_on_strand(
          peer, peer_lost(peer.rank, fmt::format("peer {} closed its transport", peer.rank)),
          false);
      return false;
    }
    if (shut_now) shut_write_side(peer, lane);
    return !lane.closed;
  }
  if (frame.kind == FrameKind::abort) {
    lane.abort_reason.assign(frame.chunk_bytes, '\0');
    lane.target = reinterpret_cast<std::byte*>(lane.abort_reason.data());
    lane.hashing = false;
    lane.remaining = frame.chunk_bytes;
    lane.in_payload = true;
    return true;
  }

  std::unique_lock lock(mutex_);
  if (peer.failure) return false;
  const MessageKey key{frame.tag, frame.sequence};
  auto it = peer.slots.find(key);
  bool notify = false;
  if (it == peer.slots.end()) {
    // Arrived before its irecv: keep it, unless that would exceed the cap; then stop reading
    // this connection until a matching irecv is posted or room is made.
    if (frame.message_bytes > 0 &&
        unexpected_bytes_ + frame.message_bytes > options_.max_unexpected_bytes) {
      lane.paused = true;
      lane.key = key;
      ++paused_lanes_;
      logger().debug(
          "tcp transport: {} early bytes held; pausing connection {} from peer {} until a "
          "receive for tag {} is posted",
          unexpected_bytes_, lane.index, peer.rank, frame.tag);
      return false;
    }
    Slot slot;
    slot.announced = true;
    slot.message_bytes = frame.message_bytes;
    if (frame.message_bytes > 0) {
      slot.stash = std::make_unique_for_overwrite<std::byte[]>(frame.message_bytes);
      unexpected_bytes_ += frame.message_bytes;
    }
    it = peer.slots.emplace(key, std::move(slot)).first;
  } else if (!it->second.announced) {
    Slot& slot = it->second;
    slot.announced = true;
    slot.message_bytes = frame.message_bytes;
    if (slot.op && slot.op->recv_buffer.size() != frame.message_bytes) {
      slot.op->error =
          size_mismatch(peer.rank, frame.tag, frame.message_bytes, slot.op->recv_buffer.size());
      slot.op.reset();
      slot.discard = true;
      notify = true;
    }
  } else if (it->second.message_bytes != frame.message_bytes) {
    const auto announced = it->second.message_bytes;
    lock.unlock();
    protocol_violation(peer,
                       fmt::format("frames of message (tag {}, sequence {}) announce {} "
                                   "and {} bytes",
                                   frame.tag, frame.sequence, announced, frame.message_bytes));
    return false;
  }
  Slot& slot = it->second;
  std::byte* base = nullptr;
  bool stashed = false;
  if (!slot.discard) {
    if (slot.stash && !slot.to_user) {
      base = slot.stash.get();
      stashed = true;
    } else if (slot.op) {
      base = slot.op->recv_buffer.data();
    }
  }
  // Chunks must not overlap: together they cover the message exactly once.
  bool overlaps = slot.claimed + frame.chunk_bytes > slot.message_bytes;
  if (!overlaps && frame.chunk_bytes > 0 && frame.chunk_bytes < slot.message_bytes) {
    const std::uint64_t end = frame.chunk_offset + frame.chunk_bytes;
    auto next = slot.ranges.lower_bound(frame.chunk_offset);
    if (next != slot.ranges.end() && next->first < end) overlaps = true;
    if (next != slot.ranges.begin() && std::prev(next)->second.end > frame.chunk_offset)
      overlaps = true;
    if (!overlaps) slot.ranges.emplace(frame.chunk_offset, Slot::Range{end, stashed});
  }
  if (overlaps) {
    lock.unlock();
    protocol_violation(peer,
                       fmt::format("frame of message (tag {}, sequence {}) overlaps bytes "
                                   "already received",
                                   frame.tag, frame.sequence),
                       frame.chunk_offset);
    return false;
  }
  slot.claimed += frame.chunk_bytes;
  if (stashed) slot.stashed_bytes += frame.chunk_bytes;
  lane.key = key;
  lane.target = base == nullptr ? nullptr : base + frame.chunk_offset;
  lane.remaining = frame.chunk_bytes;
  lane.in_payload = true;
  // The checksum is computed piece by piece as the bytes arrive, while they are in the cache.
  lane.hashing = frame.has_payload_checksum && lane.target != nullptr && frame.chunk_bytes > 0;
  lane.stashing = stashed && frame.chunk_bytes > 0;
  if (lane.hashing) lane.payload_digest.reset();
  lock.unlock();
  if (notify) notify_waiters();
  return true;
}

bool TcpTransport::Core::receive_posted(Peer& peer, const MessageKey& key) {
  const std::lock_guard lock(mutex_);
  const auto it = peer.slots.find(key);
  return it != peer.slots.end() && it->second.op != nullptr;
}

void TcpTransport::Core::read_rest_into_receive_if_posted(Peer& peer, Lane& lane) {
  // A frame that began arriving before its irecv was posted goes to the stash; once the irecv
  // is posted, the rest of the frame goes straight into the receive's buffer, so that only what
  // had arrived is copied (a message sent before its receiver knew its size, as a collective's
  // first step may be, usually overtakes its receive by little).
  if (!lane.stashing || !lane.in_payload || lane.remaining == 0) return;
  const std::lock_guard lock(mutex_);
  const auto it = peer.slots.find(lane.key);
  if (it == peer.slots.end()) return;
  Slot& slot = it->second;
  if (!slot.to_user || !slot.op || slot.discard) return;
  const FrameHeader& frame = lane.frame;
  const std::uint64_t split = frame.chunk_offset + (frame.chunk_bytes - lane.remaining);
  const std::uint64_t end = frame.chunk_offset + frame.chunk_bytes;
  // The frame's arrived part stays in the stash, the rest does not (finish_frame copies the
  // stashed ranges).
  slot.stashed_bytes -= lane.remaining;
  if (split > frame.chunk_offset) {
    slot.ranges.insert_or_assign(frame.chunk_offset, Slot::Range{split, true});
    slot.ranges.insert_or_assign(split, Slot::Range{end, false});
  } else {
    slot.ranges.insert_or_assign(frame.chunk_offset, Slot::Range{end, false});
  }
  lane.target = slot.op->recv_buffer.data() + split;
  lane.stashing = false;
}

bool TcpTransport::Core::finish_frame(Peer& peer, Lane& lane) {
  lane.in_payload = false;
  lane.stashing = false;
  const FrameHeader& frame = lane.frame;
  if (frame.kind == FrameKind::abort) {
    lane.abort_received = true;
    if (peer.abort_reason.empty()) peer.abort_reason = lane.abort_reason;
    end_lane_after_abort(peer, lane);
    return false;
  }
  const bool verified = lane.hashing;
  if (lane.hashing) {
    lane.hashing = false;
    if (lane.payload_digest.finish() != frame.payload_checksum) {
      protocol_violation(peer,
                         fmt::format("payload checksum mismatch in message (tag {}, sequence {}) "
                                     "bytes [{}, {}) on connection {}: the frame was corrupted",
                                     frame.tag, frame.sequence, frame.chunk_offset,
                                     frame.chunk_offset + frame.chunk_bytes, lane.index),
                         frame.chunk_offset);
      return false;
    }
  }
  bool notify = false;
  {
    const std::lock_guard lock(mutex_);
    auto it = peer.slots.find(lane.key);
    if (it == peer.slots.end()) return false;  // the peer failed meanwhile
    Slot& slot = it->second;
    slot.received += frame.chunk_bytes;
    if (verified)
      slot.verified.push_back({frame.chunk_offset, frame.chunk_bytes, frame.payload_checksum});
    if (slot.op) slot.op->bytes_arrived = slot.received;
    if (slot.complete()) {
      if (slot.discard) {
        if (slot.stash) release_unexpected_locked(slot.message_bytes);
        peer.slots.erase(it);
      } else if (slot.op) {
        Operation& op = *slot.op;
        op.verified_frames = std::move(slot.verified);
        if (slot.stash && slot.stashed_bytes > 0) {
          op.stash_to_copy = std::move(slot.stash);
          op.stash_bytes = slot.message_bytes;
          if (slot.stashed_bytes < slot.message_bytes) {
            for (const auto& [offset, range] : slot.ranges)
              if (range.stashed) op.copy_ranges.emplace_back(offset, range.end);
            logger().debug(
                "tcp transport: message (tag {}, sequence {}) from peer {}: {} early bytes to "
                "copy, {} received in place",
                frame.tag, frame.sequence, peer.rank, slot.stashed_bytes,
                slot.message_bytes - slot.stashed_bytes);
          }
        } else {
          if (slot.stash) release_unexpected_locked(slot.message_bytes);  // nothing went there
          complete_recv_locked(op);
        }
        peer.slots.erase(it);
        notify = true;
      }
      // Otherwise it arrived before its irecv and waits for it.
    }
  }
  if (notify) notify_waiters();
  return notify;
}

void TcpTransport::Core::resume_lanes(Peer& peer) {
  for (auto& lane_ptr : peer.lanes) {
    Lane& lane = *lane_ptr;
    {
      const std::lock_guard lock(mutex_);
      if (!lane.paused || lane.closed) continue;
      lane.paused = false;
      --paused_lanes_;
    }
    if (begin_frame(peer, lane)) process(peer, lane);
  }
}

// ------------------------------------------------------------------------------------------------
// Completion

bool TcpTransport::Core::finish_if_ready(Operation& op, std::unique_lock<std::mutex>& lock) {
  if (op.error) std::rethrow_exception(op.error);
  if (op.done) return true;
  if (!op.stash_to_copy) return false;
  auto stash = std::move(op.stash_to_copy);
  const auto bytes = op.stash_bytes;
  const auto ranges = std::move(op.copy_ranges);
  lock.unlock();
  if (ranges.empty()) {
    std::memcpy(op.recv_buffer.data(), stash.get(), bytes);
    payload_copied_ += bytes;
  } else {
    for (const auto& [begin, end] : ranges) {
      std::memcpy(op.recv_buffer.data() + begin, stash.get() + begin, end - begin);
      payload_copied_ += end - begin;
    }
  }
  stash.reset();
  lock.lock();
  release_unexpected_locked(bytes);
  if (op.error) std::rethrow_exception(op.error);
  complete_recv_locked(op);
  return true;
}

bool TcpTransport::Core::test(Operation& op) {
  std::unique_lock lock(mutex_);
  return finish_if_ready(op, lock);
}

void TcpTransport::Core::wait(Operation& op, Deadline deadline) {
  const auto ready = [&] { return op.done || op.error || op.stash_to_copy != nullptr; };
  // This thread runs the io_context until the operation is done (tcp/progress.h).
  (void)progress_.drive_until(
      [&] {
        const std::lock_guard lock(mutex_);
        return ready();
      },
      deadline);
  std::unique_lock lock(mutex_);
  changed_.wait_until(lock, deadline, ready);
  if (finish_if_ready(op, lock)) return;
  peers_[static_cast<std::size_t>(op.peer)]->stalled = true;
  const auto waited =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - op.posted_at);
  if (op.is_send)
    throw TimeoutError(fmt::format("send to peer {} (tag {}, {} bytes) did not complete within "
                                   "{} ms: {} bytes written",
                                   op.peer, op.tag, op.bytes, to_ms(waited), op.bytes_written),
                       context_for(op.peer));
  throw TimeoutError(fmt::format("receive from peer {} (tag {}, {} bytes) did not complete "
                                 "within {} ms: {} bytes arrived",
                                 op.peer, op.tag, op.bytes, to_ms(waited), op.bytes_arrived),
                     context_for(op.peer));
}

void TcpTransport::Core::abandon(const std::shared_ptr<Operation>& op) noexcept {
  const std::lock_guard lock(mutex_);
  if (op->done || op->error || op->is_send) return;  // a send keeps going (see transport.h)
  if (op->stash_to_copy) {
    op->stash_to_copy.reset();
    release_unexpected_locked(op->stash_bytes);
    return;
  }
  if (peers_.empty()) return;
  Peer& peer = *peers_[static_cast<std::size_t>(op->peer)];
  auto it = peer.slots.find(MessageKey{op->tag, op->sequence});
  if (it != peer.slots.end() && it->second.op == op) {
    // Whatever still arrives for it is read and dropped.
    it->second.op.reset();
    it->second.discard = true;
  }
}

TransportStats TcpTransport::Core::stats() const {
  TransportStats result;
  {
    const std::lock_guard lock(mutex_);
    result = stats_;
  }
  result.wire_bytes_sent = wire_sent_.load();
  result.wire_bytes_received = wire_received_.load();
  return result;
}

void TcpTransport::Core::corrupt_outgoing_frame(CorruptFrame hook) {
  const std::lock_guard lock(mutex_);
  corrupt_at_ = data_frames_sent_ + hook.frame_index;
  corrupt_target_ = hook.target;
}

// ------------------------------------------------------------------------------------------------
// Failures and closing

void TcpTransport::Core::end_lane_after_abort(Peer& peer, Lane& lane) {
  // An aborting peer sends an abort frame on each idle connection and closes them all. Its
  // other connections may still hold frames it sent before (a collective's failure notice,
  // say): the peer fails only once every connection has ended, so that those are delivered.
  bool all_ended = true;
  {
    const std::lock_guard lock(mutex_);
    lane.closed = true;
    for (const auto& other : peer.lanes)
      all_ended = all_ended && (other->closed || other->abort_received || other->eof ||
                                other->paused || !other->connected);
  }
  boost::system::error_code ignored;
  lane.socket.close(ignored);
  if (all_ended)
    fail_peer_on_strand(peer, peer_lost(peer.rank, fmt::format("peer {} aborted: {}", peer.rank,
                                                               peer.abort_reason)));
}

void TcpTransport::Core::on_lane_error(Peer& peer, Lane& lane,
                                       const boost::system::error_code& error,
                                       std::string_view doing) {
  if (lane.closed || error == asio::error::operation_aborted) return;
  if (!peer.abort_reason.empty()) {
    // The peer announced its abort on another connection; this one has now ended too.
    end_lane_after_abort(peer, lane);
    return;
  }
  if (error == asio::error::eof) {
    bool orderly = false;
    bool close_now = false;
    {
      const std::lock_guard lock(mutex_);
      lane.eof = true;
      orderly = lane.goodbye_received || closing_;
      close_now = orderly && (lane.write_shut || closing_);
      if (close_now) lane.closed = true;
    }
    if (orderly) {
      if (close_now) {
        boost::system::error_code ignored;
        lane.socket.close(ignored);
      }
      notify_waiters();
      return;
    }
    fail_peer_on_strand(
        peer, peer_lost(peer.rank, fmt::format("connection {} to peer {} closed without a "
                                               "goodbye (the peer process died or was killed)",
                                               lane.index, peer.rank)));
    return;
  }
  fail_peer_on_strand(
      peer, peer_lost(peer.rank, fmt::format("connection {} to peer {} failed "
                                             "while {}: {}",
                                             lane.index, peer.rank, doing, error.message())));
}

void TcpTransport::Core::protocol_violation(Peer& peer, const std::string& problem,
                                            std::optional<std::uint64_t> offset) {
  ErrorContext context = context_for(peer.rank);
  context.byte_offset = offset;
  tell_peer_why(peer, fmt::format("rank {} rejected its frames: {}", rank_, problem));
  fail_peer_on_strand(
      peer, std::make_exception_ptr(
                ProtocolError(fmt::format("peer {} violated the protocol: {}", peer.rank, problem),
                              std::move(context))));
}

void TcpTransport::Core::fail_peer_locked(Peer& peer, const std::exception_ptr& error, bool log) {
  if (peer.failure) return;
  peer.failure = error;
  if (log && !closing_ && !aborted_)
    logger().warn("tcp transport: rank {}: {}", rank_, what_of(error));
  // Lost before the whole mesh is connected: the group cannot form. Waiting on for the other
  // connections until the connect deadline would only delay this rank's next try at forming
  // one (in an elastic run, possibly past the coordinator's regroup timeout).
  if (!formed_ && !formation_error_) formation_error_ = error;
  const auto fail = [&](const std::shared_ptr<Operation>& op) {
    if (op && !op->done && !op->error && !op->stash_to_copy) op->error = error;
  };
  for (const auto& chunk : peer.send_queue)
    fail(chunk.op);
  peer.send_queue.clear();
  for (const auto& lane : peer.lanes)
    for (const auto& chunk : lane->batch)
      fail(chunk.op);
  for (auto& [key, slot] : peer.slots)
    fail(slot.op);
}

void TcpTransport::Core::close_lanes_on_strand(Peer& peer, const std::exception_ptr& orphan_error) {
  for (auto& lane : peer.lanes) {
    boost::system::error_code ignored;
    lane->socket.close(ignored);
  }
  {
    const std::lock_guard lock(mutex_);
    for (auto& lane : peer.lanes) {
      lane->closed = true;
      if (lane->paused) {
        lane->paused = false;
        --paused_lanes_;
      }
    }
    // Messages that will never complete are dropped (their receives fail); complete ones stay
    // receivable.
    for (auto it = peer.slots.begin(); it != peer.slots.end();) {
      Slot& slot = it->second;
      if (slot.complete() && !slot.op && !slot.discard) {
        ++it;
        continue;
      }
      if (slot.op && !slot.op->done && !slot.op->error && !slot.op->stash_to_copy)
        slot.op->error = peer.failure ? peer.failure : orphan_error;
      if (slot.stash) release_unexpected_locked(slot.message_bytes);
      it = peer.slots.erase(it);
    }
  }
  notify_waiters();
}

void TcpTransport::Core::fail_peer_on_strand(Peer& peer, const std::exception_ptr& error,
                                             bool log) {
  // Close first: once the operations fail their buffers may be reused, and nothing may be read
  // into them any more.
  for (auto& lane : peer.lanes) {
    boost::system::error_code ignored;
    lane->socket.close(ignored);
  }
  {
    const std::lock_guard lock(mutex_);
    fail_peer_locked(peer, error, log);
  }
  close_lanes_on_strand(peer, error);
}

void TcpTransport::Core::fail_everything_locked(const std::exception_ptr& error) {
  for (auto& peer : peers_) {
    const auto fail = [&](const std::shared_ptr<Operation>& op) {
      if (op && !op->done && !op->error) op->error = error;
    };
    for (const auto& chunk : peer->send_queue)
      fail(chunk.op);
    peer->send_queue.clear();
    for (const auto& lane : peer->lanes)
      for (const auto& chunk : lane->batch)
        fail(chunk.op);
    for (auto& [key, slot] : peer->slots)
      fail(slot.op);
    if (!peer->failure) peer->failure = error;
  }
}

void TcpTransport::Core::run_on_every_strand_and_wait(
    const std::function<void(Peer&)>& work) noexcept {
  try {
    if (!progress_.has_threads()) {
      for (auto& peer : peers_)
        work(*peer);
      return;
    }
    std::latch done(static_cast<std::ptrdiff_t>(peers_.size()));
    for (auto& peer : peers_) {
      asio::post(peer->strand, [&work, &done, p = peer.get()] {
        try {
          work(*p);
        } catch (...) {
          // Closing is best effort; nothing here is allowed to stop the others.
        }
        done.count_down();
      });
    }
    done.wait();
  } catch (const std::exception& error) {
    logger().error("tcp transport: failed to reach the I/O threads: {}", error.what());
  }
}

void TcpTransport::Core::tell_peer_why(Peer& peer, std::string_view reason) {
  // An abort frame on every idle connection (never inside a frame being written), without
  // blocking: the peer then fails with our reason instead of a bare "connection closed".
  const std::string_view text = reason.substr(0, tcp::kMaxAbortReasonBytes);
  FrameHeader header;
  header.kind = FrameKind::abort;
  header.message_bytes = header.chunk_bytes = text.size();
  const EncodedHeader encoded = tcp::encode_header(header);
  const std::array<asio::const_buffer, 2> frame{asio::buffer(encoded),
                                                asio::buffer(text.data(), text.size())};
  for (auto& lane : peer.lanes) {
    {
      const std::lock_guard lock(mutex_);
      if (!lane->connected || lane->closed || lane->writing || lane->write_shut) continue;
    }
    boost::system::error_code ignored;
    lane->socket.non_blocking(true, ignored);
    wire_sent_ += lane->socket.send(frame, 0, ignored);
  }
}

void TcpTransport::Core::abort(std::string_view reason) noexcept {
  try {
    std::exception_ptr error;
    {
      const std::lock_guard lock(mutex_);
      if (aborted_ || shut_down_) return;
      aborted_ = std::make_exception_ptr(
          AbortedError(reason, ErrorContext{.rank = rank_}));
      error = aborted_;
    }
    logger().warn("tcp transport: rank {} aborting: {}", rank_, reason);
    run_on_every_strand_and_wait([&](Peer& peer) {
      tell_peer_why(peer, reason);
      close_lanes_on_strand(peer, error);
    });
    {
      const std::lock_guard lock(mutex_);
      fail_everything_locked(error);
    }
    notify_waiters();
  } catch (...) {
    // abort() must not throw; the operations have been failed as far as possible.
  }
}

void TcpTransport::Core::graceful_close() noexcept {
  try {
    const auto deadline = Clock::now() + kCloseTimeout;
    std::unique_lock lock(mutex_);
    closing_ = true;
    // 1. Let what is queued go out.
    changed_.wait_until(lock, deadline, [&] {
      return std::all_of(peers_.begin(), peers_.end(), [](const auto& peer) {
        return peer->failure || peer->stalled ||
               (peer->send_queue.empty() &&
                std::none_of(peer->lanes.begin(), peer->lanes.end(),
                             [](const auto& lane) { return lane->writing; }));
      });
    });
    lock.unlock();
    // 2. Say goodbye on every connection, then half-close it.
    for (auto& peer_ptr : peers_) {
      Peer& peer = *peer_ptr;
      if (peer.rank == rank_) continue;
      asio::post(peer.strand, [this, &peer] {
        for (auto& lane_ptr : peer.lanes) {
          Lane& lane = *lane_ptr;
          {
            const std::lock_guard guard(mutex_);
            if (!lane.connected || lane.closed || lane.write_shut || peer.failure) continue;
            lane.goodbye_wanted = true;
          }
          start_write(peer, lane);
        }
      });
    }
    // 3. Wait until every peer has read it all and closed its side.
    lock.lock();
    changed_.wait_until(lock, deadline, [&] {
      return std::all_of(peers_.begin(), peers_.end(), [](const auto& peer) {
        return peer->failure || peer->stalled ||
               std::all_of(peer->lanes.begin(), peer->lanes.end(), [](const auto& lane) {
                 return lane->closed || !lane->connected || (lane->write_shut && lane->eof);
               });
      });
    });
  } catch (...) {
    // Closing is best effort.
  }
}

void TcpTransport::Core::shutdown() noexcept {
  {
    const std::lock_guard lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  bool aborted = false;
  {
    const std::lock_guard lock(mutex_);
    aborted = aborted_ != nullptr;
  }
  bool formed = false;
  {
    const std::lock_guard lock(mutex_);
    formed = formed_;
  }
  // A group that never formed has no messages in flight to protect.
  if (!aborted && formed && size_ > 1 && progress_.has_threads()) graceful_close();
  {
    const std::lock_guard lock(mutex_);
    closing_ = true;
  }
  const auto destroyed = std::make_exception_ptr(
      PeerLostError("the transport was destroyed", ErrorContext{.rank = rank_}));
  run_on_every_strand_and_wait(
      [this, &destroyed](Peer& peer) { close_lanes_on_strand(peer, destroyed); });
  try {
    if (!progress_.has_threads()) {
      boost::system::error_code ignored;
      acceptor_.close(ignored);
    } else {
      std::promise<void> closed;
      asio::post(control_, [this, &closed] {
        boost::system::error_code ignored;
        acceptor_.close(ignored);
        if (progress_timer_) progress_timer_->cancel();
        closed.set_value();
      });
      closed.get_future().wait();
    }
  } catch (...) {
  }
  {
    const std::lock_guard lock(mutex_);
    fail_everything_locked(destroyed);
  }
  notify_waiters();
  work_.reset();
  io_.stop();
  progress_.join();
}

void TcpTransport::Core::check_progress() {
  const auto period =
      std::max<std::chrono::milliseconds>(options_.io_timeout / 4, std::chrono::milliseconds(10));
  progress_timer_->expires_after(period);
  progress_timer_->async_wait([this](const boost::system::error_code& error) {
    if (error) return;
    for (auto& peer_ptr : peers_) {
      Peer& peer = *peer_ptr;
      if (peer.rank == rank_) continue;
      asio::post(peer.strand, [this, &peer] {
        const auto now = Clock::now();
        for (auto& lane_ptr : peer.lanes) {
          const Lane& lane = *lane_ptr;
          if (lane.closed || !lane.connected || lane.paused) continue;
          const bool mid_frame = lane.in_payload || lane.staging_end > lane.staging_begin;
          std::string stalled;
          if (lane.writing && now - lane.last_write_progress > options_.io_timeout) {
            stalled = "sending";
          } else if (mid_frame && now - lane.last_read_progress > options_.io_timeout) {
            stalled = "receiving a frame";
          }
          if (stalled.empty()) continue;
          fail_peer_on_strand(
              peer, std::make_exception_ptr(TimeoutError(
                        fmt::format("connection {} to peer {} made no progress "
                                    "{} for {} ms (io_timeout)",
                                    lane.index, peer.rank, stalled, to_ms(options_.io_timeout)),
                        context_for(peer.rank))));
          return;
        }
      });
    }
    check_progress();
  });
}

// ------------------------------------------------------------------------------------------------
// TcpTransport

TcpTransport::TcpTransport(const TransportOptions& options)
    : core_(std::make_shared<Core>(options)) {
  validate(options);
  // One budget for the whole formation: rendezvous, connections and handshakes.
  const Deadline deadline = deadline_after(options.connect_timeout);
  GroupTable table;
  switch (resolve_rendezvous(options)) {
    case RendezvousMethod::peer_list:
      table = peer_list_rendezvous(options);
      core_->bind_listener(options.listen_addr,
                           table.peers[static_cast<std::size_t>(table.rank)].port);
      break;
    case RendezvousMethod::environment:
      core_->bind_listener(options.listen_addr, options.listen_port);
      table = environment_rendezvous(options, core_->listen_port_);
      break;
    case RendezvousMethod::mpi:
      core_->bind_listener(options.listen_addr, options.listen_port);
      table = mpi_rendezvous(options, core_->listen_port_);
      break;
    case RendezvousMethod::automatic:  // a group of one
      if (options.rank > 0)
        throw InvalidArgument(fmt::format("rank {} in a group of one", options.rank));
      table.rank = 0;
      table.peers.push_back(PeerAddress{"127.0.0.1", 0});
      break;
  }
  core_->form_group(std::move(table), deadline);
}

TcpTransport::~TcpTransport() {
  core_->shutdown();
}

int TcpTransport::rank() const noexcept {
  return core_->rank_;
}
int TcpTransport::size() const noexcept {
  return core_->size_;
}

std::unique_ptr<Request> TcpTransport::isend(int peer, Tag tag, std::span<const std::byte> data) {
  return core_->isend(peer, tag, data);
}

std::unique_ptr<Request> TcpTransport::irecv(int peer, Tag tag, std::span<std::byte> data) {
  return core_->irecv(peer, tag, data);
}

std::unique_ptr<Request> TcpTransport::iforward(int peer, Tag tag, std::span<const std::byte> data,
                                                const Request& earlier) {
  const auto* tcp = dynamic_cast<const TcpRequest*>(&earlier);
  const bool ours = tcp != nullptr && tcp->core() == core_.get();
  return core_->isend(peer, tag, data, ours ? &tcp->operation() : nullptr);
}

void TcpTransport::abort(std::string_view reason) noexcept {
  core_->abort(reason);
}

TransportStats TcpTransport::stats() const {
  return core_->stats();
}

std::uint16_t TcpTransport::listen_port() const noexcept {
  return core_->listen_port_;
}

const std::vector<PeerAddress>& TcpTransport::peer_addresses() const noexcept {
  return core_->addresses_;
}

GroupId TcpTransport::group_id() const noexcept {
  return core_->group_id_;
}

int TcpTransport::refused_connections() const noexcept {
  return core_->refused_.load();
}

std::size_t TcpTransport::unexpected_bytes() const {
  return core_->unexpected_bytes();
}

std::uint64_t TcpTransport::payload_bytes_copied() const noexcept {
  return core_->payload_bytes_copied();
}

int TcpTransport::callers_waiting() const noexcept {
  return core_->callers_waiting();
}

void TcpTransport::retire_tag(Tag tag) noexcept {
  core_->retire_tag(tag);
}

std::size_t TcpTransport::tag_counters() const {
  return core_->tag_counters();
}

void TcpTransport::corrupt_outgoing_frame(CorruptFrame hook) {
  core_->corrupt_outgoing_frame(hook);
}

}  // namespace pulseloco::transport
