// The NCCL backend: ncclSend/ncclRecv between CUDA devices, and NCCL's own collectives as the
// native collectives (native_collectives.h) that carry the collectives' payloads.
//
//  - Buffers: memory of the transport's device (buffer_device() is cuda:N) goes to NCCL as it
//    is, with no host round trip. Host memory (cudaPointerGetAttributes tells them apart) is
//    staged: copied at posting into a pinned bounce buffer, then on the transport's stream into
//    a device buffer allocated there (cudaMallocAsync), and back the same way for a receive; at
//    most 1 GiB per operation, pinned buffers kept for reuse. The collectives' headers and
//    notices travel this way; memory of another device is refused (InvalidArgument).
//  - Bootstrap: rank 0 creates the NCCL unique id and hands it to the others over the side
//    channel the group layer gives (bootstrap.h): MPI_Bcast when launched by mpirun with the MPI
//    backend linked, else a TCP transport formed by the usual rendezvous (environment variables
//    or peer list; one connection per peer, closed after the id is delivered). The communicator is
//    non-blocking (ncclConfig_t::blocking = 0), so creation, launches and closing can all be
//    bounded by deadlines.
//  - isend/irecv only queue the operation. The first test() or wait() launches everything
//    queued so far as one ncclGroupStart/ncclGroupEnd group on the transport's stream, so that
//    the sends and receives of a collective step progress together (NCCL blocks a send until
//    its receive is posted). Completion is a cudaEvent recorded after the group. Variable sizes
//    are fine because irecv gives the exact size.
//  - NCCL matches messages between two ranks by order, not by tag (matches_by_order()): both
//    ranks must post their operations with each other in the same order. Sizes must match too
//    (NCCL cannot detect a mismatch). The collectives keep that order (collectives.h).
//  - Native collectives are queued behind every operation posted before them (those go first,
//    as a group of their own) and launched at once; the call waits for them with its deadline.
//  - Failures: asynchronous NCCL errors (ncclCommGetAsyncError) fail every operation; a peer
//    that stops makes waits end in TimeoutError, after which the caller must abort(), which
//    calls ncclCommAbort. One communicator cannot use the same GPU for two ranks (NCCL does not
//    support it), so a single-GPU machine runs world size 1 (sends to itself).
#pragma once

#include <memory>

#include <chrono>

#include <pulseloco/transport/bootstrap.h>
#include <pulseloco/transport/native_collectives.h>
#include <pulseloco/transport/nccl/nccl_options.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

struct NcclOp;

class NcclTransport final : public Transport, public NativeCollectives {
 public:
  // Sets up the device, then calls `form_bootstrap` (the group's side channel) to carry rank 0's
  // NCCL id to every rank, and creates the communicator; the bootstrap and the creation each
  // get `timeout`.
  NcclTransport(const NcclOptions& options, const FormBootstrap& form_bootstrap,
                std::chrono::milliseconds timeout);
  ~NcclTransport() override;
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  [[nodiscard]] int rank() const noexcept override;
  [[nodiscard]] int size() const noexcept override;
  [[nodiscard]] std::string_view backend() const noexcept override { return "nccl"; }
  [[nodiscard]] Device buffer_device() const noexcept override;
  [[nodiscard]] bool matches_by_order() const noexcept override { return true; }

  // `data` is memory of buffer_device() (used directly) or host memory (staged, at most 1 GiB
  // per operation).
  [[nodiscard]] std::unique_ptr<Request> isend(int peer, Tag tag,
                                               std::span<const std::byte> data) override;
  [[nodiscard]] std::unique_ptr<Request> irecv(int peer, Tag tag,
                                               std::span<std::byte> data) override;

  // Native collectives (native_collectives.h), on the same stream as the point-to-point
  // groups and after every operation posted before them. Buffers as for isend.
  [[nodiscard]] bool allgatherv(std::span<const std::byte> /*mine*/,
                                std::span<const std::uint64_t> /*counts*/,
                                std::span<std::byte> /*out*/, Deadline /*deadline*/) override {
    return false;  // the collectives use allgather_into here
  }
  [[nodiscard]] bool allgather_into(std::span<const std::byte> mine,
                                    std::span<const std::span<std::byte>> out,
                                    Deadline deadline) override;
  // ncclAllReduce: NCCL gives every rank of a communicator the same bytes, in its own
  // summation order (which depends on the world size and NCCL's algorithm choice).
  [[nodiscard]] bool allreduce_sum(std::span<const float> input, std::span<float> output,
                                   Deadline deadline) override;
  void broadcast(int root, std::span<std::byte> data, Deadline deadline) override;
  void barrier(Deadline deadline) override;
  void abort(std::string_view reason) noexcept override;
  [[nodiscard]] TransportStats stats() const override;

  // Launches every queued operation as one NCCL group now (test() and wait() do it too).
  void flush();

  struct State;

 private:
  [[nodiscard]] std::unique_ptr<Request> post(int peer, Tag tag, std::span<std::byte> data,
                                              bool is_send);
  // Queues `op` behind everything posted so far, launches it and waits for it.
  void run_collective(const std::shared_ptr<NcclOp>& op, Deadline deadline);

  std::shared_ptr<State> state_;
};

}  // namespace pulseloco::transport
