// Options of the MPI backend (mpi_transport.h). The group layer carries them as
// group::TransportOptions::mpi (PULSELOCO_MPI_PART_BYTES).
#pragma once

#include <cstddef>

namespace pulseloco::transport {

struct MpiOptions {
  // Messages above this size travel as several MPI messages (MPI counts are ints).
  std::size_t part_bytes = std::size_t{1} << 30;
};

}  // namespace pulseloco::transport
