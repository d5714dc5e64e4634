#include <pulseloco/base/thread_pool.h>

#include <atomic>
#include <exception>
#include <limits>
#include <memory>

#include <pulseloco/base/thread_name.h>

namespace pulseloco {

ThreadPool::ThreadPool(std::size_t threads) {
  if (threads == 0) threads = std::max<std::size_t>(1, std::thread::hardware_concurrency());
  workers_.reserve(threads - 1);
  for (std::size_t i = 1; i < threads; ++i) {
    workers_.emplace_back([this] { worker_loop(); });
    set_thread_name(workers_.back().native_handle(), "pl-pool");
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  workers_.clear();  // joins
}

void ThreadPool::worker_loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

std::future<void> ThreadPool::submit(std::function<void()> fn) {
  auto task = std::make_shared<std::packaged_task<void()>>(std::move(fn));
  std::future<void> result = task->get_future();
  if (workers_.empty()) {
    (*task)();
    return result;
  }
  enqueue([task] { (*task)(); });
  return result;
}

void ThreadPool::enqueue(std::function<void()> task) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(task));
  }
  wake_.notify_one();
}

void ThreadPool::parallel_for(std::size_t count, const std::function<void(std::size_t)>& fn) {
  if (count == 0) return;

  // Completion is counted per index, not per helper: the caller drains indices itself, so the
  // call finishes even when every worker is busy (e.g. a parallel_for nested in a pool task).
  // Helpers that start late find no index left and return without touching `fn`.
  struct Shared {
    std::atomic<std::size_t> next{0};
    std::size_t completed = 0;  // guarded by mutex
    std::mutex mutex;
    std::condition_variable all_done;
    std::size_t error_index = std::numeric_limits<std::size_t>::max();
    std::exception_ptr error;
  };
  auto shared = std::make_shared<Shared>();
  const std::function<void(std::size_t)>* body = &fn;
  auto drain = [shared, count, body] {
    for (std::size_t i = shared->next.fetch_add(1); i < count; i = shared->next.fetch_add(1)) {
      std::exception_ptr error;
      try {
        (*body)(i);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard lock(shared->mutex);
      if (error && i < shared->error_index) {
        shared->error_index = i;
        shared->error = error;
      }
      if (++shared->completed == count) shared->all_done.notify_all();
    }
  };

  const std::size_t helpers = std::min(workers_.size(), count - 1);
  for (std::size_t h = 0; h < helpers; ++h)
    enqueue(drain);
  drain();
  std::unique_lock lock(shared->mutex);
  shared->all_done.wait(lock, [&] { return shared->completed == count; });
  if (shared->error) std::rethrow_exception(shared->error);
}

}  // namespace pulseloco
