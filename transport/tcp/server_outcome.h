// Internal: how a TCP server that runs on a thread of its own (the rendezvous server, the elastic
// coordinator) reports how it ended: complete() once, from its thread; wait() from any other.
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>

namespace pulseloco::transport::tcp {

class ServerOutcome {
 public:
  // The server is done, with `failure` or without (null). Only the first call counts.
  void complete(std::exception_ptr failure) {
    {
      const std::lock_guard lock(mutex_);
      if (done_) return;
      done_ = true;
      failure_ = std::move(failure);
    }
    changed_.notify_all();
  }

  // The failure once complete() has been called with one; null otherwise. Does not block.
  [[nodiscard]] std::exception_ptr failure() {
    const std::lock_guard lock(mutex_);
    return failure_;
  }

  // Blocks until complete(); rethrows its failure.
  void wait() {
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return done_; });
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool done_ = false;
  std::exception_ptr failure_;
};

}  // namespace pulseloco::transport::tcp
