#include <pulseloco/transport/mpi/mpi_world.h>

#include <fmt/format.h>

#include <mutex>
#include <string_view>
#include <thread>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/mpi/mpi_environment.h>

namespace pulseloco::transport::mpi {
namespace {

// Polls `request` until it completes; at `deadline` marks MPI unclean and throws TimeoutError
// naming `what`.
void complete_by(MPI_Request& request, Deadline deadline, std::string_view what, int rank) {
  for (int done = 0; done == 0;) {
    {
      const std::lock_guard lock(call_mutex());
      check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), fmt::format("MPI_Test ({})", what));
    }
    if (done != 0) break;
    if (Clock::now() >= deadline) {
      mark_unclean();
      throw TimeoutError(
          fmt::format("{} over MPI_COMM_WORLD: not every rank took part before the deadline", what),
          ErrorContext{.rank = rank});
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // MPI progress polling
  }
}

}  // namespace

WorldBootstrap::WorldBootstrap() {
  ensure_initialized();
  const std::lock_guard lock(call_mutex());
  check(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank");
  check(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size");
}

void WorldBootstrap::allgather(std::span<const std::byte> mine, std::span<std::byte> all,
                               Deadline deadline) {
  PULSELOCO_CHECK(all.size() == mine.size() * static_cast<std::size_t>(size_),
                  "MPI allgather: the output must hold every rank's contribution");
  MPI_Request request = MPI_REQUEST_NULL;
  {
    const std::lock_guard lock(call_mutex());
    // MPI's C API takes a non-const pointer on older versions; the send buffer is only read.
    check(MPI_Iallgather(const_cast<std::byte*>(mine.data()), static_cast<int>(mine.size()),
                         MPI_BYTE, all.data(), static_cast<int>(mine.size()), MPI_BYTE,
                         MPI_COMM_WORLD, &request),
          "MPI_Iallgather");
  }
  complete_by(request, deadline, "MPI_Iallgather", rank_);
}

void WorldBootstrap::broadcast(int root, std::span<std::byte> data, Deadline deadline) {
  MPI_Request request = MPI_REQUEST_NULL;
  {
    const std::lock_guard lock(call_mutex());
    check(MPI_Ibcast(data.data(), static_cast<int>(data.size()), MPI_BYTE, root, MPI_COMM_WORLD,
                     &request),
          "MPI_Ibcast");
  }
  complete_by(request, deadline, "MPI_Ibcast", rank_);
}

}  // namespace pulseloco::transport::mpi
