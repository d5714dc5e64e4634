#include <pulseloco/transport/mpi/mpi_environment.h>

#include <fmt/format.h>

#include <atomic>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>

namespace pulseloco::transport::mpi {
namespace {

std::atomic<bool> g_unclean{false};

// Finalises MPI at exit when pulseloco initialised it.
struct Lifetime {
  bool we_initialised = false;
  ~Lifetime() {
    if (!we_initialised) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized != 0) return;
    if (g_unclean.load()) {
      logger().warn("skipping MPI_Finalize: an MPI operation timed out and is still pending");
      return;
    }
    MPI_Finalize();
  }
};

Lifetime& lifetime() {
  static Lifetime instance;
  return instance;
}

}  // namespace

std::mutex& call_mutex() noexcept {
  static std::mutex mutex;
  return mutex;
}

void mark_unclean() noexcept {
  g_unclean.store(true);
}

std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS)
    return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<std::size_t>(length));
}

void check(int code, std::string_view what) {
  if (code != MPI_SUCCESS) throw IoError(fmt::format("{}: {}", what, error_string(code)));
}

void ensure_initialized() {
  const std::lock_guard lock(call_mutex());
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) throw IoError("MPI was already finalised; it cannot be used again");
  int initialised = 0;
  MPI_Initialized(&initialised);
  if (initialised != 0) {
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_SERIALIZED)
      logger().warn(
          "MPI was initialised with thread level {} (below MPI_THREAD_SERIALIZED); pulseloco "
          "serialises its MPI calls but they may come from more than one thread",
          provided);
    return;
  }
  (void)logger();  // constructed before Lifetime, so it outlives Lifetime's destructor
  int provided = MPI_THREAD_SINGLE;
  check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  lifetime().we_initialised = true;
  if (provided < MPI_THREAD_SERIALIZED)
    logger().warn("MPI provides only thread level {}; pulseloco serialises its MPI calls",
                  provided);
}

}  // namespace pulseloco::transport::mpi
