// Internal: MPI_COMM_WORLD as a Bootstrap (bootstrap.h): the MPI rendezvous exchanges the ranks'
// TCP data addresses over it, and the NCCL backend its unique id. Every call is non-blocking MPI
// polled against the deadline; a call that misses it leaves MPI unfit for a clean finalize
// (mpi::mark_unclean).
#pragma once

#include <pulseloco/transport/bootstrap.h>

namespace pulseloco::transport::mpi {

class WorldBootstrap final : public Bootstrap {
 public:
  // Initialises MPI when needed.
  WorldBootstrap();

  [[nodiscard]] int rank() const noexcept override { return rank_; }
  [[nodiscard]] int size() const noexcept override { return size_; }
  void allgather(std::span<const std::byte> mine, std::span<std::byte> all,
                 Deadline deadline) override;
  void broadcast(int root, std::span<std::byte> data, Deadline deadline) override;

 private:
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace pulseloco::transport::mpi
