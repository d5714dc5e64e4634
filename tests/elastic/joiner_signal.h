// The event the members of an in-process elastic test hold for before a boundary that must admit
// a joiner: the joiner has registered and asked to be admitted.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <pulseloco/elastic/coordinator.h>

namespace pulseloco::testing {

class JoinerSignal {
 public:
  const elastic::Coordinator* coordinator = nullptr;

  // The joiner's ElasticOptions::on_registered.
  void registered() {
    const std::lock_guard lock(mutex_);
    registered_ = true;
    changed_.notify_all();
  }

  // Until the coordinator counts the joiner as waiting; false after 120 s. A worker registers
  // first and asks to be admitted right after: holding only until it has registered let the
  // boundary that should admit it pass before its request arrived (seen once in 978 tests).
  [[nodiscard]] bool wait_until_waiting() {
    {
      std::unique_lock lock(mutex_);
      if (!changed_.wait_for(lock, std::chrono::seconds(120), [&] { return registered_; }))
        return false;
    }
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (coordinator->waiting_workers() == 0) {
      if (std::chrono::steady_clock::now() >= give_up) return false;
      std::this_thread::yield();
    }
    return true;
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool registered_ = false;
};

}  // namespace pulseloco::testing
