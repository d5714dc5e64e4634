// The MPI backend: MPI point-to-point on a duplicate of MPI_COMM_WORLD, plus MPI's own
// allgatherv, broadcast and barrier as NativeCollectives.
//
//  - MPI is initialised with MPI_Init_thread(MPI_THREAD_MULTIPLE) unless the program did it,
//    and then finalised at exit; every MPI call of pulseloco is serialised.
//  - isend/irecv are MPI_Isend/MPI_Irecv (messages above 1 GiB are split in parts, matched in
//    order); waits poll MPI_Test against the deadline. The received size is checked
//    (MPI_Get_count, truncation): a mismatch is a ProtocolError naming the peer.
//  - Tags: MPI tags are ints (up to MPI_TAG_UB, 2^31 - 1 with OpenMPI). Tags below half of that
//    are used as they are; larger 64-bit tags are hashed into the upper half, where two distinct
//    tags coincide with probability 2^-30. Two coinciding tags in flight between the same pair
//    of ranks at once could be matched crosswise (a size check or the collectives' headers then
//    fail).
//  - What MPI cannot do: it does not report a dead peer. A rank that dies usually makes mpirun
//    end the whole job; a stalled or silently dead peer shows as TimeoutError at the deadline.
//    abort() cancels pending receives and fails every operation, but a receive that MPI has
//    already matched may still complete into its buffer.
//  - TransportStats: wire bytes equal payload bytes (MPI's own headers are not visible).
#pragma once

#include <memory>

#include <pulseloco/transport/mpi/mpi_options.h>
#include <pulseloco/transport/native_collectives.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

class MpiTransport final : public Transport, public NativeCollectives {
 public:
  // Joins MPI_COMM_WORLD (its rank and size), initialising MPI when needed.
  explicit MpiTransport(const MpiOptions& options);
  ~MpiTransport() override;
  MpiTransport(const MpiTransport&) = delete;
  MpiTransport& operator=(const MpiTransport&) = delete;

  [[nodiscard]] int rank() const noexcept override;
  [[nodiscard]] int size() const noexcept override;
  [[nodiscard]] std::string_view backend() const noexcept override { return "mpi"; }

  [[nodiscard]] std::unique_ptr<Request> isend(int peer, Tag tag,
                                               std::span<const std::byte> data) override;
  [[nodiscard]] std::unique_ptr<Request> irecv(int peer, Tag tag,
                                               std::span<std::byte> data) override;
  void abort(std::string_view reason) noexcept override;
  [[nodiscard]] TransportStats stats() const override;

  [[nodiscard]] bool allgatherv(std::span<const std::byte> mine,
                                std::span<const std::uint64_t> counts, std::span<std::byte> out,
                                Deadline deadline) override;
  void broadcast(int root, std::span<std::byte> data, Deadline deadline) override;
  void barrier(Deadline deadline) override;

  struct State;

 private:
  // isend and irecv: posts the message as MPI parts (MPI counts are ints) and tracks them.
  [[nodiscard]] std::unique_ptr<Request> post(bool is_send, int peer, Tag tag, std::byte* data,
                                              std::size_t bytes);

  std::shared_ptr<State> state_;
};

}  // namespace pulseloco::transport
