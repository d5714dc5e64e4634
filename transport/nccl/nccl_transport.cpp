#include <pulseloco/transport/nccl/nccl_transport.h>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/transport/waiting.h>

namespace pulseloco::transport {
namespace {

// How long destruction lets queued operations finish and the communicator finalise.
constexpr auto kCloseTimeout = std::chrono::seconds(10);

void check_cuda(cudaError_t status, std::string_view what) {
  if (status != cudaSuccess)
    throw IoError(
        fmt::format("{}: {} ({})", what, cudaGetErrorString(status), cudaGetErrorName(status)));
}

std::string nccl_problem(ncclResult_t result, ncclComm_t comm) {
  const char* detail = ncclGetLastError(comm);
  return fmt::format("{}{}{}", ncclGetErrorString(result),
                     detail != nullptr && *detail != '\0' ? ": " : "",
                     detail != nullptr ? detail : "");
}

void check_nccl(ncclResult_t result, ncclComm_t comm, std::string_view what) {
  if (result != ncclSuccess && result != ncclInProgress)
    throw IoError(fmt::format("{}: {}", what, nccl_problem(result, comm)));
}

}  // namespace

struct NcclGroup;

struct NcclOp {
  bool is_send = false;
  int peer = 0;
  Tag tag = 0;
  std::uint64_t bytes = 0;
  void* data = nullptr;
  Clock::time_point posted_at = Clock::now();
  bool done = false;
  std::exception_ptr error;
};

// Operations launched together; complete when `event` (recorded after them) is.
struct NcclGroup {
  NcclGroup() = default;
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  ~NcclGroup() {
    if (event != nullptr) cudaEventDestroy(event);
  }
  cudaEvent_t event = nullptr;
  std::vector<std::shared_ptr<NcclOp>> ops;
};

struct NcclTransport::State {
  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    in_flight.clear();
    enqueuing.reset();
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  int device = 0;
  int rank = 0;
  int size = 1;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  std::mutex mutex;
  std::vector<std::shared_ptr<NcclOp>> queued;       // posted, not launched yet
  std::shared_ptr<NcclGroup> enqueuing;              // launched; NCCL still enqueuing it
  std::deque<std::shared_ptr<NcclGroup>> in_flight;  // on the stream, in launch order
  TransportStats stats;
  std::exception_ptr failure;  // abort or an asynchronous NCCL error: everything fails

  [[nodiscard]] ErrorContext context_for(int peer) const {
    return ErrorContext{.rank = rank, .peer = peer};
  }

  void fail_all_locked(const std::exception_ptr& error) {
    if (!failure) failure = error;
    const auto fail = [&](const std::shared_ptr<NcclOp>& op) {
      if (!op->done && !op->error) op->error = failure;
    };
    for (auto& op : queued)
      fail(op);
    queued.clear();
    if (enqueuing)
      for (auto& op : enqueuing->ops)
        fail(op);
    for (auto& group : in_flight)
      for (auto& op : group->ops)
        fail(op);
  }

  void complete_locked(NcclOp& op) {
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
  }

  // Launches the queued operations as one group.
  void launch_locked() {
    auto group = std::make_shared<NcclGroup>();
    for (auto& op : queued) {
      if (op->bytes == 0) {
        complete_locked(*op);  // nothing to move; NCCL is not involved
      } else {
        group->ops.push_back(op);
      }
    }
    queued.clear();
    if (group->ops.empty()) return;
    check_cuda(cudaEventCreateWithFlags(&group->event, cudaEventDisableTiming),
               "cudaEventCreateWithFlags");
    check_nccl(ncclGroupStart(), comm, "ncclGroupStart");
    for (auto& op : group->ops) {
      const ncclResult_t result =
          op->is_send ? ncclSend(op->data, op->bytes, ncclUint8, op->peer, comm, stream)
                      : ncclRecv(op->data, op->bytes, ncclUint8, op->peer, comm, stream);
      if (result != ncclSuccess && result != ncclInProgress) {
        (void)ncclGroupEnd();
        throw IoError(fmt::format("{} peer {} (tag {}, {} bytes): {}",
                                  op->is_send ? "ncclSend to" : "ncclRecv from", op->peer, op->tag,
                                  op->bytes, nccl_problem(result, comm)),
                      context_for(op->peer));
      }
    }
    const ncclResult_t ended = ncclGroupEnd();
    check_nccl(ended, comm, "ncclGroupEnd");
    if (ended == ncclInProgress) {
      enqueuing = std::move(group);  // the event is recorded once NCCL has enqueued it
      return;
    }
    check_cuda(cudaEventRecord(group->event, stream), "cudaEventRecord");
    in_flight.push_back(std::move(group));
  }

  // Advances everything: NCCL's asynchronous state, the launch of queued operations, and the
  // completion of launched groups. Errors fail every operation.
  void progress_locked() {
    if (failure) return;
    try {
      check_cuda(cudaSetDevice(device), "cudaSetDevice");
      ncclResult_t state = ncclSuccess;
      check_nccl(ncclCommGetAsyncError(comm, &state), comm, "ncclCommGetAsyncError");
      if (state != ncclSuccess && state != ncclInProgress)
        throw PeerLostError(fmt::format("NCCL reported an asynchronous error (a peer failed or "
                                        "the communicator broke): {}",
                                        nccl_problem(state, comm)),
                            ErrorContext{.rank = rank});
      if (enqueuing) {
        // While NCCL is still enqueuing a non-blocking group, no other NCCL call may be made.
        if (state == ncclInProgress) return;
        check_cuda(cudaEventRecord(enqueuing->event, stream), "cudaEventRecord");
        in_flight.push_back(std::move(enqueuing));
        enqueuing.reset();
      }
      if (!queued.empty()) launch_locked();
      while (!in_flight.empty()) {
        const cudaError_t status = cudaEventQuery(in_flight.front()->event);
        if (status == cudaErrorNotReady) break;
        check_cuda(status, "cudaEventQuery");
        for (auto& op : in_flight.front()->ops)
          if (!op->error) complete_locked(*op);
        in_flight.pop_front();
      }
    } catch (...) {
      fail_all_locked(std::current_exception());
    }
  }
};

namespace {

class NcclRequest final : public Request {
 public:
  NcclRequest(std::shared_ptr<NcclTransport::State> state, std::shared_ptr<NcclOp> op)
      : state_(std::move(state)), op_(std::move(op)) {}

  bool test() override {
    const std::lock_guard lock(state_->mutex);
    if (!op_->done && !op_->error) state_->progress_locked();
    if (op_->error) std::rethrow_exception(op_->error);
    return op_->done;
  }

  void wait(Deadline deadline) override {
    if (poll_until(deadline, [&] { return test(); })) return;
    throw TimeoutError(fmt::format("NCCL {} peer {} (tag {}, {} bytes) did not complete within "
                                   "{} ms; abort() the transport before reusing its buffers",
                                   op_->is_send ? "send to" : "receive from", op_->peer, op_->tag,
                                   op_->bytes, to_ms(Clock::now() - op_->posted_at)),
                       state_->context_for(op_->peer));
  }

 private:
  std::shared_ptr<NcclTransport::State> state_;
  std::shared_ptr<NcclOp> op_;
};

}  // namespace

NcclTransport::NcclTransport(const NcclOptions& options, const FormBootstrap& form_bootstrap,
                             std::chrono::milliseconds timeout)
    : state_(std::make_shared<State>()) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)
    throw IoError("nccl transport: no CUDA device is visible to this process");
  const int local_rank = options.local_rank >= 0 ? options.local_rank : 0;
  state_->device = options.cuda_device >= 0 ? options.cuda_device : local_rank % devices;
  if (state_->device >= devices)
    throw InvalidArgument(fmt::format("nccl transport: CUDA device {} does not exist ({} visible)",
                                      state_->device, devices));
  check_cuda(cudaSetDevice(state_->device), "cudaSetDevice");
  check_cuda(cudaStreamCreateWithFlags(&state_->stream, cudaStreamNonBlocking),
             "cudaStreamCreateWithFlags");

  // Rank 0 creates the NCCL id; the bootstrap carries it to the other ranks.
  ncclUniqueId id{};
  {
    const std::unique_ptr<Bootstrap> bootstrap = form_bootstrap();
    state_->rank = bootstrap->rank();
    state_->size = bootstrap->size();
    if (state_->rank == 0) check_nccl(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
    try {
      bootstrap->broadcast(0, std::as_writable_bytes(std::span(&id, 1)), deadline_after(timeout));
    } catch (const TimeoutError&) {
      throw TimeoutError(
          fmt::format("nccl transport: the NCCL id did not arrive within {} ms", timeout.count()),
          ErrorContext{.rank = state_->rank, .peer = 0});
    }
  }

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  check_nccl(ncclCommInitRankConfig(&state_->comm, state_->size, id, state_->rank, &config),
             state_->comm, "ncclCommInitRankConfig");
  const auto deadline = deadline_after(timeout);
  ncclResult_t status = ncclInProgress;
  const bool ready = poll_until(deadline, [&] {
    check_nccl(ncclCommGetAsyncError(state_->comm, &status), state_->comm, "ncclCommGetAsyncError");
    return status != ncclInProgress;
  });
  if (!ready || status != ncclSuccess) {
    const std::string problem = ready ? nccl_problem(status, state_->comm)
                                      : fmt::format("not ready within {} ms", timeout.count());
    ncclCommAbort(state_->comm);
    state_->comm = nullptr;
    const ErrorContext context{.rank = state_->rank};
    if (!ready)
      throw TimeoutError(
          fmt::format("nccl transport: communicator of {} ranks {}", state_->size, problem),
          context);
    throw IoError(fmt::format("nccl transport: creating the communicator failed: {}", problem),
                  context);
  }
  logger().debug("nccl transport: rank {} of {} on CUDA device {}", state_->rank, state_->size,
                 state_->device);
}

NcclTransport::~NcclTransport() {
  const std::lock_guard lock(state_->mutex);
  auto& s = *state_;
  if (s.comm == nullptr) return;
  bool clean = !s.failure;
  if (clean) {
    // Let launched operations finish, then finalise; abort when that does not happen in time.
    const auto deadline = Clock::now() + kCloseTimeout;
    s.queued.clear();
    clean = poll_until(deadline, [&] {
      s.progress_locked();
      return s.failure || (!s.enqueuing && s.in_flight.empty());
    });
    clean = clean && !s.failure && ncclCommFinalize(s.comm) != ncclSystemError;
    clean = clean && poll_until(deadline, [&] {
              ncclResult_t status = ncclSuccess;
              ncclCommGetAsyncError(s.comm, &status);
              return status != ncclInProgress;
            });
  }
  if (clean) {
    ncclCommDestroy(s.comm);
  } else {
    ncclCommAbort(s.comm);
  }
  s.comm = nullptr;
  s.fail_all_locked(std::make_exception_ptr(
      PeerLostError("the transport was destroyed", ErrorContext{.rank = s.rank})));
}

int NcclTransport::rank() const noexcept {
  return state_->rank;
}
int NcclTransport::size() const noexcept {
  return state_->size;
}

Device NcclTransport::buffer_device() const noexcept {
  return Device{DeviceKind::cuda, state_->device};
}

namespace {

void check_device_buffer(const void* data, std::size_t bytes, int device, int rank) {
  if (bytes == 0) return;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess ||
      (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged) ||
      attributes.device != device) {
    (void)cudaGetLastError();
    throw InvalidArgument(
        fmt::format("nccl transport: the buffer is not memory of CUDA device {}", device),
        ErrorContext{.rank = rank});
  }
}

}  // namespace

std::unique_ptr<Request> NcclTransport::isend(int peer, Tag tag, std::span<const std::byte> data) {
  if (peer < 0 || peer >= state_->size)
    throw InvalidArgument(fmt::format("isend: peer {} is not in [0, {})", peer, state_->size),
                          ErrorContext{.rank = state_->rank});
  check_device_buffer(data.data(), data.size(), state_->device, state_->rank);
  auto op = std::make_shared<NcclOp>();
  op->is_send = true;
  op->peer = peer;
  op->tag = tag;
  op->bytes = data.size();
  op->data = const_cast<std::byte*>(data.data());  // NCCL's API is const-correct; our op is not
  const std::lock_guard lock(state_->mutex);
  if (state_->failure) {
    op->error = state_->failure;
  } else {
    state_->queued.push_back(op);
  }
  return std::make_unique<NcclRequest>(state_, op);
}

std::unique_ptr<Request> NcclTransport::irecv(int peer, Tag tag, std::span<std::byte> data) {
  if (peer < 0 || peer >= state_->size)
    throw InvalidArgument(fmt::format("irecv: peer {} is not in [0, {})", peer, state_->size),
                          ErrorContext{.rank = state_->rank});
  check_device_buffer(data.data(), data.size(), state_->device, state_->rank);
  auto op = std::make_shared<NcclOp>();
  op->peer = peer;
  op->tag = tag;
  op->bytes = data.size();
  op->data = data.data();
  const std::lock_guard lock(state_->mutex);
  if (state_->failure) {
    op->error = state_->failure;
  } else {
    state_->queued.push_back(op);
  }
  return std::make_unique<NcclRequest>(state_, op);
}

void NcclTransport::flush() {
  const std::lock_guard lock(state_->mutex);
  state_->progress_locked();
  if (state_->failure) std::rethrow_exception(state_->failure);
}

void NcclTransport::abort(std::string_view reason) noexcept {
  try {
    const std::lock_guard lock(state_->mutex);
    if (state_->comm == nullptr) return;
    logger().warn("nccl transport: rank {} aborting: {}", state_->rank, reason);
    ncclCommAbort(state_->comm);  // ends the NCCL kernels; buffers are free afterwards
    state_->comm = nullptr;
    state_->failure = nullptr;
    state_->fail_all_locked(
        std::make_exception_ptr(AbortedError(reason, ErrorContext{.rank = state_->rank})));
  } catch (...) {
    // abort() must not throw.
  }
}

TransportStats NcclTransport::stats() const {
  const std::lock_guard lock(state_->mutex);
  return state_->stats;
}

}  // namespace pulseloco::transport
