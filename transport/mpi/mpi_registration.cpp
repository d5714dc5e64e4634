// Registers the MPI backend (backend_registry.h) before main() in every program linked with
// pulseloco_transport_mpi: the library's CMake target asks the linker for the symbol below, so
// this object is always taken from the archive.
#include <memory>

#include <pulseloco/transport/backend_registry.h>
#include <pulseloco/transport/mpi/mpi_transport.h>
#include <pulseloco/transport/mpi/mpi_world.h>

namespace pulseloco::transport::mpi {
namespace {

std::unique_ptr<Transport> make_mpi_transport(const MpiOptions& options) {
  return std::make_unique<MpiTransport>(options);
}

std::unique_ptr<Bootstrap> make_world_bootstrap() {
  return std::make_unique<WorldBootstrap>();
}

constexpr MpiBackend kMpiBackend{&make_mpi_transport, &make_world_bootstrap};

}  // namespace
}  // namespace pulseloco::transport::mpi

extern "C" {
extern const bool pulseloco_transport_mpi_registered;
const bool pulseloco_transport_mpi_registered =
    (pulseloco::transport::register_backend(pulseloco::transport::mpi::kMpiBackend), true);
}
