#include <pulseloco/transport/nccl/nccl_transport.h>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
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

// Host memory one operation may stage through the device (nccl_transport.h).
constexpr std::size_t kMaxStagedBytes = std::size_t{1} << 30;

// Whether `data` is memory NCCL can use directly: memory of `device` (or managed memory).
// Memory of another device is refused; anything else is host memory, staged.
bool is_device_memory(const void* data, int device, int rank) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
    (void)cudaGetLastError();  // plain host memory, on CUDA versions that call it an error
    return false;
  }
  if (attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged)
    return false;
  if (attributes.type == cudaMemoryTypeDevice && attributes.device != device)
    throw InvalidArgument(fmt::format("nccl transport: the buffer is memory of CUDA device {}, "
                                      "not of this transport's device {}",
                                      attributes.device, device),
                          ErrorContext{.rank = rank});
  return true;
}

}  // namespace

// Host memory that an operation reads or writes, staged through device memory the transport
// owns: a pinned bounce buffer (so that both copies are asynchronous on the transport's stream)
// and a device buffer that NCCL uses.
struct Stage {
  std::byte* user = nullptr;  // the caller's host bytes
  std::byte* pinned = nullptr;
  std::byte* device = nullptr;
  std::size_t bytes = 0;
  bool to_device = false;  // an input: copied in before the launch
  bool to_host = false;    // an output: copied out after it
};

struct NcclOp {
  enum class Kind : std::uint8_t { send, receive, collective };
  Kind kind = Kind::send;
  int peer = -1;  // -1 for a collective
  Tag tag = 0;
  std::uint64_t bytes = 0;           // sent (a collective: its input)
  std::uint64_t bytes_received = 0;  // a collective's output
  void* data = nullptr;              // device memory NCCL uses (send and receive)
  // A collective: enqueues its NCCL calls (inside the group launch_locked opens).
  std::function<ncclResult_t(ncclComm_t, cudaStream_t)> collective;
  std::string what;  // a collective, for errors
  std::vector<Stage> stages;
  Clock::time_point posted_at = Clock::now();
  bool done = false;
  std::exception_ptr error;

  [[nodiscard]] std::string describe() const {
    if (kind == Kind::collective) return what;
    return fmt::format("{} peer {} (tag {}, {} bytes)",
                       kind == Kind::send ? "send to" : "receive from", peer, tag, bytes);
  }
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
    if (stream != nullptr) cudaStreamSynchronize(stream);
    for (void* device_bytes : orphaned_device)
      cudaFree(device_bytes);
    for (std::byte* pinned : all_pinned)
      cudaFreeHost(pinned);
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
  // Staging: pinned bounce buffers are kept for reuse (by capacity); the staging of failed
  // operations is never reused (NCCL or a copy may still write into it until the abort
  // completes) and is freed with the transport.
  std::multimap<std::size_t, std::byte*> free_pinned;
  std::map<std::byte*, std::size_t> pinned_capacity;
  std::vector<std::byte*> all_pinned;
  std::vector<void*> orphaned_device;

  [[nodiscard]] ErrorContext context_for(int peer) const {
    return peer >= 0 ? ErrorContext{.rank = rank, .peer = peer} : ErrorContext{.rank = rank};
  }

  // The device memory an operation gives NCCL for `span`: the span itself when it is memory of
  // the transport's device, else a staging buffer (host memory).
  std::byte* device_view_locked(NcclOp& op, std::span<std::byte> span, bool to_device,
                                bool to_host) {
    if (span.empty()) return span.data();
    if (is_device_memory(span.data(), device, rank)) return span.data();
    if (span.size() > kMaxStagedBytes)
      throw InvalidArgument(fmt::format("nccl transport: {} bytes of host memory in one operation; "
                                        "at most {} are staged (pass device memory instead)",
                                        span.size(), kMaxStagedBytes),
                            ErrorContext{.rank = rank});
    check_cuda(cudaSetDevice(device), "cudaSetDevice");
    Stage stage{.user = span.data(),
                .pinned = take_pinned_locked(span.size()),
                .bytes = span.size(),
                .to_device = to_device,
                .to_host = to_host};
    void* device_bytes = nullptr;
    try {
      check_cuda(cudaMallocAsync(&device_bytes, span.size(), stream), "cudaMallocAsync");
    } catch (...) {
      free_pinned.emplace(pinned_capacity.at(stage.pinned), stage.pinned);
      throw;
    }
    stage.device = static_cast<std::byte*>(device_bytes);
    if (to_device) std::memcpy(stage.pinned, span.data(), span.size());
    op.stages.push_back(stage);
    return stage.device;
  }

  std::byte* take_pinned_locked(std::size_t bytes) {
    if (const auto fit = free_pinned.lower_bound(bytes); fit != free_pinned.end()) {
      std::byte* pinned = fit->second;
      free_pinned.erase(fit);
      return pinned;
    }
    std::size_t capacity = 4096;
    while (capacity < bytes)
      capacity *= 2;
    void* pinned = nullptr;
    check_cuda(cudaMallocHost(&pinned, capacity), "cudaMallocHost");
    all_pinned.push_back(static_cast<std::byte*>(pinned));
    pinned_capacity[static_cast<std::byte*>(pinned)] = capacity;
    return static_cast<std::byte*>(pinned);
  }

  // Runs `stage`, which stages several buffers of `op`: when one of them fails, those staged
  // before go back for reuse (the operation never launched, so nothing writes into them).
  template <class Staging>
  void stage_all_locked(NcclOp& op, Staging&& staging) {
    try {
      staging();
    } catch (...) {
      release_stages_locked(op, true);
      throw;
    }
  }

  // Returns an operation's staging: for reuse after a success, to the orphans after a failure.
  void release_stages_locked(NcclOp& op, bool reusable) noexcept {
    for (const Stage& stage : op.stages) {
      if (reusable) {
        (void)cudaFreeAsync(stage.device, stream);
        free_pinned.emplace(pinned_capacity[stage.pinned], stage.pinned);
      } else {
        orphaned_device.push_back(stage.device);
      }
    }
    op.stages.clear();
  }

  void fail_all_locked(const std::exception_ptr& error) {
    if (!failure) failure = error;
    const auto fail = [&](const std::shared_ptr<NcclOp>& op) {
      if (!op->done && !op->error) {
        op->error = failure;
        release_stages_locked(*op, false);
      }
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
    for (const Stage& stage : op.stages)
      if (stage.to_host) std::memcpy(stage.user, stage.pinned, stage.bytes);
    release_stages_locked(op, true);
    op.done = true;
    if (op.kind == NcclOp::Kind::collective) {
      stats.payload_bytes_sent += op.bytes;
      stats.wire_bytes_sent += op.bytes;
      stats.payload_bytes_received += op.bytes_received;
      stats.wire_bytes_received += op.bytes_received;
    } else if (op.kind == NcclOp::Kind::send) {
      stats.payload_bytes_sent += op.bytes;
      stats.wire_bytes_sent += op.bytes;
      ++stats.messages_sent;
    } else {
      stats.payload_bytes_received += op.bytes;
      stats.wire_bytes_received += op.bytes;
      ++stats.messages_received;
    }
  }

  // Launches the queued operations as one group: the staged inputs' copies to the device, the
  // NCCL calls, then (once NCCL has enqueued them) the staged outputs' copies and the event.
  void launch_locked() {
    auto group = std::make_shared<NcclGroup>();
    for (auto& op : queued) {
      if (op->kind != NcclOp::Kind::collective && op->bytes == 0) {
        complete_locked(*op);  // nothing to move; NCCL is not involved
      } else {
        group->ops.push_back(op);
      }
    }
    queued.clear();
    if (group->ops.empty()) return;
    try {
      check_cuda(cudaEventCreateWithFlags(&group->event, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags");
      for (auto& op : group->ops)
        for (const Stage& stage : op->stages)
          if (stage.to_device)
            check_cuda(cudaMemcpyAsync(stage.device, stage.pinned, stage.bytes,
                                       cudaMemcpyHostToDevice, stream),
                       "cudaMemcpyAsync to the staging buffer");
      check_nccl(ncclGroupStart(), comm, "ncclGroupStart");
      for (auto& op : group->ops) {
        ncclResult_t result = ncclSuccess;
        switch (op->kind) {
          case NcclOp::Kind::send:
            result = ncclSend(op->data, op->bytes, ncclUint8, op->peer, comm, stream);
            break;
          case NcclOp::Kind::receive:
            result = ncclRecv(op->data, op->bytes, ncclUint8, op->peer, comm, stream);
            break;
          case NcclOp::Kind::collective:
            result = op->collective(comm, stream);
            break;
        }
        if (result != ncclSuccess && result != ncclInProgress) {
          (void)ncclGroupEnd();
          throw IoError(fmt::format("NCCL {}: {}", op->describe(), nccl_problem(result, comm)),
                        context_for(op->peer));
        }
      }
      const ncclResult_t ended = ncclGroupEnd();
      check_nccl(ended, comm, "ncclGroupEnd");
      if (ended == ncclInProgress) {
        enqueuing = std::move(group);  // finished once NCCL has enqueued it
        return;
      }
      finish_launch_locked(group);
    } catch (...) {
      // The group's operations are in no list any more: fail them here, the rest in the caller.
      for (auto& op : group->ops)
        if (!op->error) op->error = std::current_exception();
      throw;
    }
  }

  // In the list first, so that a failure below fails its operations with every other.
  void finish_launch_locked(const std::shared_ptr<NcclGroup>& group) {
    in_flight.push_back(group);
    for (auto& op : group->ops)
      for (const Stage& stage : op->stages)
        if (stage.to_host)
          check_cuda(cudaMemcpyAsync(stage.pinned, stage.device, stage.bytes,
                                     cudaMemcpyDeviceToHost, stream),
                     "cudaMemcpyAsync from the staging buffer");
    check_cuda(cudaEventRecord(group->event, stream), "cudaEventRecord");
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
        const std::shared_ptr<NcclGroup> enqueued = std::move(enqueuing);
        enqueuing.reset();
        finish_launch_locked(enqueued);
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
    throw TimeoutError(fmt::format("NCCL {} did not complete within {} ms; abort() the transport "
                                   "before reusing its buffers",
                                   op_->describe(), to_ms(Clock::now() - op_->posted_at)),
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
    // Never launched: nobody waits for them any more (their staging is freed with the state).
    for (auto& op : s.queued)
      s.release_stages_locked(*op, false);
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

std::unique_ptr<Request> NcclTransport::post(int peer, Tag tag, std::span<std::byte> data,
                                             bool is_send) {
  if (peer < 0 || peer >= state_->size)
    throw InvalidArgument(fmt::format("{}: peer {} is not in [0, {})", is_send ? "isend" : "irecv",
                                      peer, state_->size),
                          ErrorContext{.rank = state_->rank});
  auto op = std::make_shared<NcclOp>();
  op->kind = is_send ? NcclOp::Kind::send : NcclOp::Kind::receive;
  op->peer = peer;
  op->tag = tag;
  op->bytes = data.size();
  const std::lock_guard lock(state_->mutex);
  if (state_->failure) {
    op->error = state_->failure;
  } else {
    op->data = state_->device_view_locked(*op, data, is_send, !is_send);
    state_->queued.push_back(op);
  }
  return std::make_unique<NcclRequest>(state_, op);
}

std::unique_ptr<Request> NcclTransport::isend(int peer, Tag tag, std::span<const std::byte> data) {
  // NCCL's API is const-correct; the operation is not: a send's buffer is only read.
  return post(peer, tag, {const_cast<std::byte*>(data.data()), data.size()}, true);
}

std::unique_ptr<Request> NcclTransport::irecv(int peer, Tag tag, std::span<std::byte> data) {
  return post(peer, tag, data, false);
}

void NcclTransport::run_collective(const std::shared_ptr<NcclOp>& op, Deadline deadline) {
  {
    const std::lock_guard lock(state_->mutex);
    if (state_->failure) std::rethrow_exception(state_->failure);
    // Point-to-point operations posted before go first, as a group of their own: every rank
    // issues its NCCL calls in the same order.
    state_->progress_locked();
    if (state_->failure) std::rethrow_exception(state_->failure);
    state_->queued.push_back(op);
    state_->progress_locked();
  }
  NcclRequest(state_, op).wait(deadline);
}

bool NcclTransport::allgather_into(std::span<const std::byte> mine,
                                   std::span<const std::span<std::byte>> out, Deadline deadline) {
  if (out.size() != static_cast<std::size_t>(state_->size) ||
      out[static_cast<std::size_t>(state_->rank)].size() != mine.size())
    throw InvalidArgument("nccl allgather_into: one buffer per rank, this rank's of its size",
                          ErrorContext{.rank = state_->rank});
  auto op = std::make_shared<NcclOp>();
  op->kind = NcclOp::Kind::collective;
  op->bytes = mine.size();
  op->what = fmt::format("all-gather of {} ranks' messages (ncclBroadcast per rank)", out.size());
  {
    const std::lock_guard lock(state_->mutex);
    if (state_->failure) std::rethrow_exception(state_->failure);
    // One broadcast per non-empty message, rooted at its owner; the owner's goes from `mine`
    // into its own slot (a device copy NCCL makes).
    std::byte* mine_device = nullptr;
    std::vector<std::pair<std::byte*, std::size_t>> slots;
    state_->stage_all_locked(*op, [&] {
      mine_device = state_->device_view_locked(
          *op, {const_cast<std::byte*>(mine.data()), mine.size()}, true, false);
      for (const std::span<std::byte> slot : out) {
        slots.emplace_back(state_->device_view_locked(*op, slot, false, true), slot.size());
        op->bytes_received += slot.size();
      }
    });
    op->collective = [slots, mine_device, rank = state_->rank](ncclComm_t comm,
                                                               cudaStream_t stream) {
      for (std::size_t root = 0; root < slots.size(); ++root) {
        const auto [slot, bytes] = slots[root];
        if (bytes == 0) continue;
        const void* source = static_cast<int>(root) == rank ? mine_device : slot;
        const ncclResult_t result =
            ncclBroadcast(source, slot, bytes, ncclUint8, static_cast<int>(root), comm, stream);
        if (result != ncclSuccess && result != ncclInProgress) return result;
      }
      return ncclSuccess;
    };
  }
  run_collective(op, deadline);
  return true;
}

bool NcclTransport::allreduce_sum(std::span<const float> input, std::span<float> output,
                                  Deadline deadline) {
  if (input.size() != output.size())
    throw InvalidArgument("nccl allreduce_sum: input and output differ in length",
                          ErrorContext{.rank = state_->rank});
  if (input.empty()) return true;
  auto op = std::make_shared<NcclOp>();
  op->kind = NcclOp::Kind::collective;
  op->bytes = op->bytes_received = input.size_bytes();
  op->what = fmt::format("ncclAllReduce of {} floats", input.size());
  {
    const std::lock_guard lock(state_->mutex);
    if (state_->failure) std::rethrow_exception(state_->failure);
    const std::byte* in = nullptr;
    std::byte* out = nullptr;
    state_->stage_all_locked(*op, [&] {
      in = state_->device_view_locked(
          *op, {const_cast<std::byte*>(std::as_bytes(input).data()), input.size_bytes()}, true,
          false);
      out = state_->device_view_locked(*op, std::as_writable_bytes(output), false, true);
    });
    op->collective = [in, out, count = input.size()](ncclComm_t comm, cudaStream_t stream) {
      return ncclAllReduce(in, out, count, ncclFloat32, ncclSum, comm, stream);
    };
  }
  run_collective(op, deadline);
  return true;
}

void NcclTransport::broadcast(int root, std::span<std::byte> data, Deadline deadline) {
  if (root < 0 || root >= state_->size)
    throw InvalidArgument(fmt::format("nccl broadcast: root {} is not a rank", root),
                          ErrorContext{.rank = state_->rank});
  if (data.empty()) return;
  auto op = std::make_shared<NcclOp>();
  op->kind = NcclOp::Kind::collective;
  op->bytes = op->bytes_received = data.size();
  op->what = fmt::format("ncclBroadcast of {} bytes from rank {}", data.size(), root);
  {
    const std::lock_guard lock(state_->mutex);
    if (state_->failure) std::rethrow_exception(state_->failure);
    const bool is_root = root == state_->rank;
    std::byte* device_data = state_->device_view_locked(*op, data, is_root, !is_root);
    op->collective = [device_data, bytes = data.size(), root](ncclComm_t comm,
                                                              cudaStream_t stream) {
      return ncclBroadcast(device_data, device_data, bytes, ncclUint8, root, comm, stream);
    };
  }
  run_collective(op, deadline);
}

void NcclTransport::barrier(Deadline deadline) {
  // An all-reduce of one float: NCCL has no barrier of its own.
  float token = 0.0F;
  (void)allreduce_sum(std::span(&token, 1), std::span(&token, 1), deadline);
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
