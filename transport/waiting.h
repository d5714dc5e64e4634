// Small helpers the transport backends share for their deadlines.
#pragma once

#include <algorithm>
#include <chrono>
#include <thread>

#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

// Whole milliseconds of a duration, for error messages; never negative.
[[nodiscard]] inline long long to_ms(Clock::duration duration) noexcept {
  return std::max<long long>(
      0, std::chrono::duration_cast<std::chrono::milliseconds>(duration).count());
}

// Polls `ready` until it says true or `deadline` passes (for libraries whose requests are only
// tested, not waited on: MPI_Test, ncclCommGetAsyncError). Spins briefly first, then sleeps a
// little between polls so that a long wait does not burn a core. Returns false on timeout.
template <typename Ready>
[[nodiscard]] bool poll_until(Deadline deadline, Ready&& ready) {
  for (int spins = 0;; ++spins) {
    if (ready()) return true;
    if (Clock::now() >= deadline) return false;
    if (spins < 100) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 1000 ? 20 : 200));
    }
  }
}

}  // namespace pulseloco::transport
