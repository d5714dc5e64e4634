#include <pulseloco/transport/backend_registry.h>

namespace pulseloco::transport {
namespace {

// Constant-initialised, so that registration from another object's static initializer finds
// them ready whatever the order of initialisation.
constinit const MpiBackend* g_mpi = nullptr;
constinit const NcclBackend* g_nccl = nullptr;

}  // namespace

std::string_view backend_name(Backend backend) noexcept {
  switch (backend) {
    case Backend::tcp:
      return "tcp";
    case Backend::mpi:
      return "mpi";
    case Backend::nccl:
      return "nccl";
  }
  return "unknown";
}

std::optional<Backend> parse_backend(std::string_view name) noexcept {
  if (name == "tcp") return Backend::tcp;
  if (name == "mpi") return Backend::mpi;
  if (name == "nccl") return Backend::nccl;
  return std::nullopt;
}

void register_backend(const MpiBackend& backend) noexcept {
  g_mpi = &backend;
}

void register_backend(const NcclBackend& backend) noexcept {
  g_nccl = &backend;
}

const MpiBackend* linked_mpi_backend() noexcept {
  return g_mpi;
}

const NcclBackend* linked_nccl_backend() noexcept {
  return g_nccl;
}

bool backend_available(Backend backend) noexcept {
  switch (backend) {
    case Backend::tcp:
      return true;
    case Backend::mpi:
      return g_mpi != nullptr;
    case Backend::nccl:
      return g_nccl != nullptr;
  }
  return false;
}

}  // namespace pulseloco::transport
