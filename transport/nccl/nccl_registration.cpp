// Registers the NCCL backend (backend_registry.h) before main() in every program linked with
// pulseloco_transport_nccl: the library's CMake target asks the linker for the symbol below, so
// this object is always taken from the archive.
#include <memory>

#include <pulseloco/transport/backend_registry.h>
#include <pulseloco/transport/nccl/nccl_transport.h>

namespace pulseloco::transport {
namespace {

std::unique_ptr<Transport> make_nccl_transport(const NcclOptions& options,
                                               const FormBootstrap& form_bootstrap,
                                               std::chrono::milliseconds timeout) {
  return std::make_unique<NcclTransport>(options, form_bootstrap, timeout);
}

constexpr NcclBackend kNcclBackend{&make_nccl_transport};

}  // namespace
}  // namespace pulseloco::transport

extern "C" {
extern const bool pulseloco_transport_nccl_registered;
const bool pulseloco_transport_nccl_registered =
    (pulseloco::transport::register_backend(pulseloco::transport::kNcclBackend), true);
}
