#include <pulseloco/transport/mpi/mpi_transport.h>

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <mutex>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/transport/mpi/mpi_environment.h>
#include <pulseloco/transport/waiting.h>

namespace pulseloco::transport {
namespace {

// Native collectives split their buffers into parts of at most this many bytes.
constexpr std::uint64_t kMaxPartBytes = std::uint64_t{1} << 30;

}  // namespace

struct MpiOp {
  bool is_send = false;
  int peer = 0;
  Tag tag = 0;
  std::uint64_t bytes = 0;
  std::vector<MPI_Request> parts;
  std::vector<std::uint64_t> part_bytes;
  Clock::time_point posted_at = Clock::now();
  bool done = false;
  std::exception_ptr error;
};

struct MpiTransport::State {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  std::uint64_t tag_modulus = 32768;
  std::uint64_t part_bytes = kMaxPartBytes;  // point-to-point messages are split in such parts
  std::mutex mutex;  // guards everything below (MPI calls take mpi::call_mutex() as well)
  TransportStats stats;
  std::exception_ptr aborted;
  std::vector<std::weak_ptr<MpiOp>> pending;
  bool unclean = false;  // an operation is still pending inside MPI

  [[nodiscard]] ErrorContext context_for(int peer) const {
    return ErrorContext{.rank = rank, .peer = peer};
  }

  // Tags below half of MPI's tag space map to themselves; larger ones (e.g. the collectives',
  // which use the top bit) are hashed into the upper half, where two distinct tags meet with
  // probability 2^-30 (OpenMPI). Matching in MPI is by (source, tag), so such a pair must not
  // be in flight between the same two ranks at once; a message taken for another one shows up
  // as a size mismatch or in the collectives' own headers.
  int mpi_tag(Tag tag) const {
    const std::uint64_t half = tag_modulus / 2;
    if (tag < half) return static_cast<int>(tag);
    std::uint64_t z = tag + 0x9E3779B97F4A7C15ULL;  // splitmix64 finaliser
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return static_cast<int>(half + z % (tag_modulus - half));
  }

  // Tests an operation; returns true once complete. Throws its error. State::mutex held.
  bool test_locked(MpiOp& op) {
    if (op.error) std::rethrow_exception(op.error);
    if (op.done) return true;
    int flag = 0;
    std::vector<MPI_Status> statuses(op.parts.size());
    int code = MPI_SUCCESS;
    {
      const std::lock_guard lock(mpi::call_mutex());
      code =
          MPI_Testall(static_cast<int>(op.parts.size()), op.parts.data(), &flag, statuses.data());
    }
    if (code != MPI_SUCCESS && code != MPI_ERR_IN_STATUS) {
      op.error =
          std::make_exception_ptr(IoError(fmt::format("MPI_Testall ({} peer {}, tag {}): {}",
                                                      op.is_send ? "send to" : "receive from",
                                                      op.peer, op.tag, mpi::error_string(code)),
                                          context_for(op.peer)));
      std::rethrow_exception(op.error);
    }
    if (flag == 0) return false;
    for (std::size_t i = 0; i < statuses.size(); ++i) {
      const int part_error = code == MPI_ERR_IN_STATUS ? statuses[i].MPI_ERROR : MPI_SUCCESS;
      if (part_error != MPI_SUCCESS && part_error != MPI_ERR_PENDING) {
        int error_class = part_error;
        MPI_Error_class(part_error, &error_class);
        if (error_class == MPI_ERR_TRUNCATE) {
          op.error = std::make_exception_ptr(ProtocolError(
              fmt::format("peer {} sent more than the {} bytes the receive under tag {} expects",
                          op.peer, op.bytes, op.tag),
              context_for(op.peer)));
        } else {
          op.error = std::make_exception_ptr(
              PeerLostError(fmt::format("MPI {} peer {} (tag {}) failed: {}",
                                        op.is_send ? "send to" : "receive from", op.peer, op.tag,
                                        mpi::error_string(part_error)),
                            context_for(op.peer)));
        }
        std::rethrow_exception(op.error);
      }
      if (!op.is_send) {
        int count = 0;
        MPI_Get_count(&statuses[i], MPI_BYTE, &count);
        if (static_cast<std::uint64_t>(count) != op.part_bytes[i]) {
          op.error = std::make_exception_ptr(ProtocolError(
              fmt::format("peer {} sent a different size under tag {} than the receive expects "
                          "({} bytes): part {} has {} bytes instead of {}",
                          op.peer, op.tag, op.bytes, i, count, op.part_bytes[i]),
              context_for(op.peer)));
          std::rethrow_exception(op.error);
        }
      }
    }
    op.done = true;
    if (op.is_send) {
      stats.payload_bytes_sent += op.bytes;
      stats.wire_bytes_sent += op.bytes;
      ++stats.messages_sent;
    } else {
      stats.payload_bytes_received += op.bytes;
      stats.wire_bytes_received += op.bytes;
      ++stats.messages_received;
    }
    return true;
  }

  // Gives up interest in an unfinished operation: receives are cancelled, sends left to MPI.
  void release_locked(MpiOp& op) noexcept {
    const std::lock_guard lock(mpi::call_mutex());
    for (auto& part : op.parts) {
      if (part == MPI_REQUEST_NULL) continue;
      if (!op.is_send) MPI_Cancel(&part);
      MPI_Request_free(&part);
    }
    if (op.is_send) {
      unclean = true;
      mpi::mark_unclean();
    }
  }

  // Waits for a nonblocking collective.
  void wait_collective(MPI_Request& request, Deadline deadline, std::string_view what) {
    const auto start = Clock::now();
    const bool completed = poll_until(deadline, [&] {
      int flag = 0;
      const std::lock_guard lock(mpi::call_mutex());
      mpi::check(MPI_Test(&request, &flag, MPI_STATUS_IGNORE), what);
      return flag != 0;
    });
    if (completed) return;
    {
      const std::lock_guard lock(mutex);
      unclean = true;
      if (!aborted)
        aborted = std::make_exception_ptr(
            AbortedError(fmt::format("{} timed out", what), ErrorContext{.rank = rank}));
    }
    mpi::mark_unclean();
    throw TimeoutError(fmt::format("{} did not complete within {} ms (a rank is stalled or dead; "
                                   "MPI cannot tell which); the MPI transport is now unusable",
                                   what, to_ms(Clock::now() - start)),
                       ErrorContext{.rank = rank});
  }
};

namespace {

class MpiRequest final : public Request {
 public:
  MpiRequest(std::shared_ptr<MpiTransport::State> state, std::shared_ptr<MpiOp> op)
      : state_(std::move(state)), op_(std::move(op)) {}
  ~MpiRequest() override {
    const std::lock_guard lock(state_->mutex);
    if (!op_->done && !op_->error) state_->release_locked(*op_);
  }
  MpiRequest(const MpiRequest&) = delete;
  MpiRequest& operator=(const MpiRequest&) = delete;

  bool test() override {
    const std::lock_guard lock(state_->mutex);
    return state_->test_locked(*op_);
  }

  void wait(Deadline deadline) override {
    const bool completed = poll_until(deadline, [&] { return test(); });
    if (completed) return;
    const auto waited = to_ms(Clock::now() - op_->posted_at);
    throw TimeoutError(fmt::format("{} peer {} (tag {}, {} bytes) did not complete within {} ms",
                                   op_->is_send ? "send to" : "receive from", op_->peer, op_->tag,
                                   op_->bytes, waited),
                       state_->context_for(op_->peer));
  }

 private:
  std::shared_ptr<MpiTransport::State> state_;
  std::shared_ptr<MpiOp> op_;
};

}  // namespace

MpiTransport::MpiTransport(const MpiOptions& options) : state_(std::make_shared<State>()) {
  mpi::ensure_initialized();
  const std::lock_guard lock(mpi::call_mutex());
  mpi::check(MPI_Comm_dup(MPI_COMM_WORLD, &state_->comm), "MPI_Comm_dup");
  mpi::check(MPI_Comm_set_errhandler(state_->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  mpi::check(MPI_Comm_rank(state_->comm, &state_->rank), "MPI_Comm_rank");
  mpi::check(MPI_Comm_size(state_->comm, &state_->size), "MPI_Comm_size");
  int* tag_ub = nullptr;
  int found = 0;
  mpi::check(MPI_Comm_get_attr(state_->comm, MPI_TAG_UB, &tag_ub, &found), "MPI_Comm_get_attr");
  if (found != 0 && tag_ub != nullptr)
    state_->tag_modulus = static_cast<std::uint64_t>(*tag_ub) + 1;
  state_->part_bytes = options.part_bytes;
}

MpiTransport::~MpiTransport() {
  const std::lock_guard lock(state_->mutex);
  // Freeing a communicator with operations pending inside it could block; leave it to exit.
  if (state_->unclean) return;
  int finalized = 0;
  const std::lock_guard call(mpi::call_mutex());
  MPI_Finalized(&finalized);
  if (finalized == 0 && state_->comm != MPI_COMM_NULL) MPI_Comm_free(&state_->comm);
}

int MpiTransport::rank() const noexcept {
  return state_->rank;
}
int MpiTransport::size() const noexcept {
  return state_->size;
}

std::unique_ptr<Request> MpiTransport::isend(int peer, Tag tag, std::span<const std::byte> data) {
  // MPI's C API takes a non-const pointer on older versions; a send only reads the buffer.
  return post(true, peer, tag, const_cast<std::byte*>(data.data()), data.size());
}

std::unique_ptr<Request> MpiTransport::irecv(int peer, Tag tag, std::span<std::byte> data) {
  return post(false, peer, tag, data.data(), data.size());
}

std::unique_ptr<Request> MpiTransport::post(bool is_send, int peer, Tag tag, std::byte* data,
                                            std::size_t bytes) {
  const char* const what = is_send ? "isend" : "irecv";
  if (peer < 0 || peer >= state_->size)
    throw InvalidArgument(fmt::format("{}: peer {} is not in [0, {})", what, peer, state_->size),
                          ErrorContext{.rank = state_->rank});
  auto op = std::make_shared<MpiOp>();
  op->is_send = is_send;
  op->peer = peer;
  op->tag = tag;
  op->bytes = bytes;
  const std::lock_guard lock(state_->mutex);
  if (state_->aborted) {
    op->error = state_->aborted;
    return std::make_unique<MpiRequest>(state_, op);
  }
  // MPI counts are ints: a message travels as parts of at most part_bytes.
  const std::uint64_t part = state_->part_bytes;
  const std::uint64_t count = std::max<std::uint64_t>(1, (bytes + part - 1) / part);
  op->parts.assign(count, MPI_REQUEST_NULL);
  op->part_bytes.resize(count);
  const std::lock_guard call(mpi::call_mutex());
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t offset = i * part;
    op->part_bytes[i] = std::min<std::uint64_t>(part, bytes - offset);
    const int length = static_cast<int>(op->part_bytes[i]);
    const int code = is_send ? MPI_Isend(data + offset, length, MPI_BYTE, peer,
                                         state_->mpi_tag(tag), state_->comm, &op->parts[i])
                             : MPI_Irecv(data + offset, length, MPI_BYTE, peer,
                                         state_->mpi_tag(tag), state_->comm, &op->parts[i]);
    if (code != MPI_SUCCESS) {
      op->error = std::make_exception_ptr(IoError(
          fmt::format("{} peer {} (tag {}): {}", is_send ? "MPI_Isend to" : "MPI_Irecv from", peer,
                      tag, mpi::error_string(code)),
          state_->context_for(peer)));
      break;
    }
  }
  state_->pending.push_back(op);
  // Forget finished operations now and then.
  if (state_->pending.size() > 1024)
    std::erase_if(state_->pending, [](const std::weak_ptr<MpiOp>& weak) {
      const auto strong = weak.lock();
      return !strong || strong->done || strong->error;
    });
  return std::make_unique<MpiRequest>(state_, op);
}

void MpiTransport::abort(std::string_view reason) noexcept {
  try {
    const std::lock_guard lock(state_->mutex);
    if (state_->aborted) return;
    state_->aborted =
        std::make_exception_ptr(AbortedError(reason, ErrorContext{.rank = state_->rank}));
    logger().warn("mpi transport: rank {} aborting: {}", state_->rank, reason);
    const std::lock_guard call(mpi::call_mutex());
    for (auto& weak : state_->pending) {
      const auto op = weak.lock();
      if (!op || op->done || op->error) continue;
      op->error = state_->aborted;
      if (!op->is_send)
        for (auto& part : op->parts)
          if (part != MPI_REQUEST_NULL) MPI_Cancel(&part);
    }
    state_->pending.clear();
  } catch (...) {
    // abort() must not throw.
  }
}

TransportStats MpiTransport::stats() const {
  const std::lock_guard lock(state_->mutex);
  return state_->stats;
}

bool MpiTransport::allgatherv(std::span<const std::byte> mine,
                              std::span<const std::uint64_t> counts, std::span<std::byte> out,
                              Deadline deadline) {
  const int n = state_->size;
  if (counts.size() != static_cast<std::size_t>(n))
    throw InvalidArgument(fmt::format("allgatherv: {} counts for {} ranks", counts.size(), n),
                          ErrorContext{.rank = state_->rank});
  if (mine.size() != counts[static_cast<std::size_t>(state_->rank)])
    throw InvalidArgument(
        fmt::format("allgatherv: {} bytes contributed but counts[{}] = {}", mine.size(),
                    state_->rank, counts[static_cast<std::size_t>(state_->rank)]),
        ErrorContext{.rank = state_->rank});
  std::vector<int> int_counts(static_cast<std::size_t>(n));
  std::vector<int> displacements(static_cast<std::size_t>(n));
  std::uint64_t offset = 0;
  for (int r = 0; r < n; ++r) {
    const auto count = counts[static_cast<std::size_t>(r)];
    // MPI 3.1 counts and displacements are ints: larger exchanges go point-to-point.
    if (count > INT_MAX || offset > INT_MAX) return false;
    int_counts[static_cast<std::size_t>(r)] = static_cast<int>(count);
    displacements[static_cast<std::size_t>(r)] = static_cast<int>(offset);
    offset += count;
  }
  if (out.size() != offset)
    throw InvalidArgument(
        fmt::format("allgatherv: output has {} bytes, the counts add up to {}", out.size(), offset),
        ErrorContext{.rank = state_->rank});
  {
    const std::lock_guard lock(state_->mutex);
    if (state_->aborted) std::rethrow_exception(state_->aborted);
  }
  MPI_Request request = MPI_REQUEST_NULL;
  {
    const std::lock_guard call(mpi::call_mutex());
    mpi::check(
        MPI_Iallgatherv(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, out.data(),
                        int_counts.data(), displacements.data(), MPI_BYTE, state_->comm, &request),
        "MPI_Iallgatherv");
  }
  state_->wait_collective(request, deadline, "MPI_Iallgatherv");
  const std::lock_guard lock(state_->mutex);
  state_->stats.payload_bytes_sent += mine.size() * static_cast<std::uint64_t>(n - 1);
  state_->stats.wire_bytes_sent += mine.size() * static_cast<std::uint64_t>(n - 1);
  state_->stats.payload_bytes_received += offset - mine.size();
  state_->stats.wire_bytes_received += offset - mine.size();
  return true;
}

void MpiTransport::broadcast(int root, std::span<std::byte> data, Deadline deadline) {
  if (root < 0 || root >= state_->size)
    throw InvalidArgument(fmt::format("broadcast: root {} is not in [0, {})", root, state_->size),
                          ErrorContext{.rank = state_->rank});
  {
    const std::lock_guard lock(state_->mutex);
    if (state_->aborted) std::rethrow_exception(state_->aborted);
  }
  for (std::uint64_t offset = 0; offset < data.size() || offset == 0; offset += kMaxPartBytes) {
    const auto part = std::min<std::uint64_t>(kMaxPartBytes, data.size() - offset);
    MPI_Request request = MPI_REQUEST_NULL;
    {
      const std::lock_guard call(mpi::call_mutex());
      mpi::check(MPI_Ibcast(data.data() + offset, static_cast<int>(part), MPI_BYTE, root,
                            state_->comm, &request),
                 "MPI_Ibcast");
    }
    state_->wait_collective(request, deadline, "MPI_Ibcast");
    if (data.empty()) break;
  }
  const std::lock_guard lock(state_->mutex);
  if (state_->rank == root) {
    state_->stats.payload_bytes_sent += data.size();
    state_->stats.wire_bytes_sent += data.size();
  } else {
    state_->stats.payload_bytes_received += data.size();
    state_->stats.wire_bytes_received += data.size();
  }
}

void MpiTransport::barrier(Deadline deadline) {
  {
    const std::lock_guard lock(state_->mutex);
    if (state_->aborted) std::rethrow_exception(state_->aborted);
  }
  MPI_Request request = MPI_REQUEST_NULL;
  {
    const std::lock_guard call(mpi::call_mutex());
    mpi::check(MPI_Ibarrier(state_->comm, &request), "MPI_Ibarrier");
  }
  state_->wait_collective(request, deadline, "MPI_Ibarrier");
}

}  // namespace pulseloco::transport
