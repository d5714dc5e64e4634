// A fixed pool of worker threads for chunk-parallel kernels, encoding and decoding.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace pulseloco {

class ThreadPool {
 public:
  // `threads` is the total parallelism including the calling thread: 1 runs everything inline
  // on the caller; 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(std::size_t threads = 1);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  [[nodiscard]] std::size_t parallelism() const noexcept { return workers_.size() + 1; }

  // Runs fn(i) for every i in [0, count) on the pool and the calling thread, and returns when all
  // have finished. If some calls throw, the exception of the lowest index is rethrown (so errors
  // are reported deterministically, whatever the scheduling). May be nested: a task running on
  // the pool can call parallel_for without risk of deadlock.
  void parallel_for(std::size_t count, const std::function<void(std::size_t)>& fn);

  // Runs fn on a pool thread (or inline when the pool has no workers).
  [[nodiscard]] std::future<void> submit(std::function<void()> fn);

 private:
  void worker_loop();
  void enqueue(std::function<void()> task);

  std::vector<std::jthread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
};

}  // namespace pulseloco
