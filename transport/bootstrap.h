// A side channel among the ranks of a group, for what a backend must agree on before it can carry
// messages (the NCCL unique id) or what a rendezvous exchanges (the TCP data addresses under
// mpirun): MPI_COMM_WORLD (the MPI backend's mpi/mpi_world.h), or a transport already formed
// (TransportBootstrap). Small messages only; every call has a deadline.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <span>

#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;

  [[nodiscard]] virtual int rank() const noexcept = 0;
  [[nodiscard]] virtual int size() const noexcept = 0;
  // Every rank contributes mine.size() bytes (the same size on every rank); `all` (size() times
  // that) receives the contributions in rank order. TimeoutError when not every rank took part
  // by `deadline`.
  virtual void allgather(std::span<const std::byte> mine, std::span<std::byte> all,
                         Deadline deadline) = 0;
  // Copies root's `data` into every rank's `data` (the same size everywhere).
  virtual void broadcast(int root, std::span<std::byte> data, Deadline deadline) = 0;
};

// Forms a bootstrap when called (a backend calls it once it is ready to use one).
using FormBootstrap = std::function<std::unique_ptr<Bootstrap>()>;

// A bootstrap over the point-to-point messages of a transport it owns.
class TransportBootstrap final : public Bootstrap {
 public:
  explicit TransportBootstrap(std::unique_ptr<Transport> transport);

  [[nodiscard]] int rank() const noexcept override { return transport_->rank(); }
  [[nodiscard]] int size() const noexcept override { return transport_->size(); }
  void allgather(std::span<const std::byte> mine, std::span<std::byte> all,
                 Deadline deadline) override;
  void broadcast(int root, std::span<std::byte> data, Deadline deadline) override;

 private:
  std::unique_ptr<Transport> transport_;
};

}  // namespace pulseloco::transport
