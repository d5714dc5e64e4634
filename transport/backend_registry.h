// The backends a program can create. TCP is always there; MPI and NCCL live in libraries of
// their own (pulseloco_transport_mpi, pulseloco_transport_nccl), so that a program using only
// TCP needs neither MPI nor CUDA to configure or link. Each of those libraries registers its
// backend here from a static initializer, and its CMake target makes every program linked with
// it keep that object (a linker option naming the object's symbol), so linking the library is
// all it takes. The group layer (<pulseloco/group/make_transport.h>) creates backends through
// this registry.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include <pulseloco/transport/bootstrap.h>
#include <pulseloco/transport/mpi/mpi_options.h>
#include <pulseloco/transport/nccl/nccl_options.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

enum class Backend : std::uint8_t {
  tcp,   // Boost.Asio sockets, full mesh, any network
  mpi,   // OpenMPI point-to-point (plus native collectives, see native_collectives.h)
  nccl,  // NCCL send/receive between CUDA devices
};

[[nodiscard]] std::string_view backend_name(Backend backend) noexcept;
[[nodiscard]] std::optional<Backend> parse_backend(std::string_view name) noexcept;

// What pulseloco_transport_mpi provides.
struct MpiBackend {
  // An MPI transport on a duplicate of MPI_COMM_WORLD (initialises MPI when needed).
  std::unique_ptr<Transport> (*make_transport)(const MpiOptions& options);
  // MPI_COMM_WORLD as a bootstrap (initialises MPI when needed).
  std::unique_ptr<Bootstrap> (*world)();
};

// What pulseloco_transport_nccl provides.
struct NcclBackend {
  // An NCCL transport; it calls `form_bootstrap` once its device is set up, to agree on the
  // NCCL id, and gives creating the communicator `timeout`.
  std::unique_ptr<Transport> (*make_transport)(const NcclOptions& options,
                                               const FormBootstrap& form_bootstrap,
                                               std::chrono::milliseconds timeout);
};

// Called by the optional libraries' registration objects (before main()).
void register_backend(const MpiBackend& backend) noexcept;
void register_backend(const NcclBackend& backend) noexcept;

// The registered backend, or null when its library is not linked into this program.
[[nodiscard]] const MpiBackend* linked_mpi_backend() noexcept;
[[nodiscard]] const NcclBackend* linked_nccl_backend() noexcept;

// Whether this program can create `backend` (TCP always; MPI and NCCL when linked).
[[nodiscard]] bool backend_available(Backend backend) noexcept;

}  // namespace pulseloco::transport
