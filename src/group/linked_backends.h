// The optional backends as group formation needs them (internal header of the group layer):
// the registered backend, or InvalidArgument saying what to link or to configure.
#pragma once

#include <string_view>

#include <pulseloco/transport/backend_registry.h>

namespace pulseloco::group {

// `purpose` starts the error message ("MPI rendezvous", "transport 'mpi'").
[[nodiscard]] const transport::MpiBackend& require_mpi_backend(std::string_view purpose);
[[nodiscard]] const transport::NcclBackend& require_nccl_backend(std::string_view purpose);

}  // namespace pulseloco::group
