// Helpers for tests that run every rank of a group as a thread of the test process.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::testing {

// The latest a survivor of a fault may throw after it, in a collective of this timeout: its own
// wait, timeout / 2 following the suspicion chain and timeout / 4 letting its notices out
// (docs/collectives.md), plus slack for a loaded machine. It still tells a survivor that fails on
// this fault from one that hangs or waits out deadline after deadline.
constexpr std::chrono::milliseconds fails_within(std::chrono::milliseconds timeout) {
  return timeout * 7 / 4 + std::chrono::seconds(5);
}

struct RankOutcome {
  std::exception_ptr error;  // what the rank's body threw, if anything
  transport::Clock::time_point finished;
};

// Runs body(transport) for every rank on its own thread and returns when all have returned.
// Collectives bound every wait, so a broken implementation fails by the deadline (and ctest's
// timeout bounds the rest).
inline std::vector<RankOutcome> run_ranks(
    const std::vector<std::unique_ptr<transport::Transport>>& transports,
    const std::function<void(transport::Transport&)>& body) {
  std::vector<RankOutcome> outcomes(transports.size());
  {
    std::vector<std::jthread> threads;
    threads.reserve(transports.size());
    for (std::size_t rank = 0; rank < transports.size(); ++rank) {
      threads.emplace_back([&, rank] {
        try {
          body(*transports[rank]);
        } catch (...) {
          outcomes[rank].error = std::current_exception();
        }
        outcomes[rank].finished = transport::Clock::now();
      });
    }
  }
  return outcomes;
}

// The pulseloco::Error a rank threw (nullopt when it threw nothing or something else).
struct CaughtError {
  ErrorKind kind;
  ErrorContext context;
  std::string what;
};
inline std::optional<CaughtError> caught_error(const RankOutcome& outcome) {
  if (!outcome.error) return std::nullopt;
  try {
    std::rethrow_exception(outcome.error);
  } catch (const Error& error) {
    return CaughtError{error.kind(), error.context(), error.what()};
  } catch (...) {
    return std::nullopt;
  }
}

inline std::string describe(const RankOutcome& outcome) {
  if (!outcome.error) return "no error";
  try {
    std::rethrow_exception(outcome.error);
  } catch (const std::exception& error) {
    return error.what();
  } catch (...) {
    return "a non-standard exception";
  }
}

// Deterministic pseudo-random bytes for (rank, seed): splitmix64.
inline std::vector<std::byte> pattern_bytes(std::size_t size, int rank, std::uint64_t seed = 0) {
  std::vector<std::byte> bytes(size);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ULL + static_cast<std::uint64_t>(rank) + 1;
  std::size_t i = 0;
  while (i < size) {
    state += 0x9E3779B97F4A7C15ULL;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    for (int b = 0; b < 8 && i < size; ++b, ++i) {
      bytes[i] = static_cast<std::byte>(z >> (8 * b));
    }
  }
  return bytes;
}

}  // namespace pulseloco::testing
