// Internal: the process-wide MPI environment shared by the MPI transport and MPI_COMM_WORLD's
// bootstrap (mpi_world.h) (internal header of pulseloco_transport_mpi).
#pragma once

#include <mpi.h>

#include <mutex>
#include <string>
#include <string_view>

namespace pulseloco::transport::mpi {

// Initialises MPI with MPI_Init_thread (asking for MPI_THREAD_MULTIPLE) unless the program
// already did; in that case it is also finalised at process exit. Throws IoError when MPI
// cannot be initialised or was already finalised.
void ensure_initialized();

// Every MPI call of pulseloco holds this lock, so that MPI_THREAD_SERIALIZED suffices.
[[nodiscard]] std::mutex& call_mutex() noexcept;

// Marks MPI as unusable for a clean finalize (an operation timed out and is still pending in
// MPI); MPI_Finalize is then skipped at exit because it could block forever.
void mark_unclean() noexcept;

// MPI_Error_string of `code`.
[[nodiscard]] std::string error_string(int code);

// Throws IoError "<what>: <MPI error string>" unless code == MPI_SUCCESS.
void check(int code, std::string_view what);

}  // namespace pulseloco::transport::mpi
