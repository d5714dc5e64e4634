#include "collective_thread.h"

#include <chrono>

#include <unistd.h>

#include <pulseloco/base/thread_name.h>

namespace pulseloco::python {
namespace {

// How often a thread waiting for a collective call checks for signals (Ctrl-C).
constexpr auto kSignalPoll = std::chrono::milliseconds(50);

}  // namespace

std::optional<nb::python_error> CollectiveThread::run_job(const std::function<void()>& job,
                                                          const std::function<void()>& interrupt) {
  std::optional<nb::python_error> interrupted;  // destroyed with the GIL held again
  const nb::gil_scoped_release release;
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !busy_; });
  busy_ = true;
  forget_thread_of_another_process();
  if (!thread_) {
    stopping_ = false;
    thread_ = std::make_unique<std::thread>([this] { loop(); });
    set_thread_name(thread_->native_handle(), "pl-collective");
    thread_process_ = ::getpid();
  }
  job_ = &job;
  job_done_ = false;
  changed_.notify_all();
  while (!changed_.wait_for(lock, kSignalPoll, [&] { return job_done_; })) {
    if (interrupted) continue;  // aborted: wait for the job to return
    lock.unlock();
    {
      const nb::gil_scoped_acquire acquire;
      if (PyErr_CheckSignals() != 0) interrupted.emplace();  // fetches the raised error
    }
    if (interrupted) interrupt();
    lock.lock();
  }
  job_ = nullptr;
  busy_ = false;
  changed_.notify_all();
  return interrupted;
}

void CollectiveThread::loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || (job_ != nullptr && !job_done_); });
    if (job_ == nullptr || job_done_) return;  // stopping, no job pending
    const std::function<void()>* job = job_;
    lock.unlock();
    (*job)();
    lock.lock();
    job_done_ = true;
    changed_.notify_all();
  }
}

void CollectiveThread::stop() noexcept {
  const nb::gil_scoped_release release;  // a call of another thread may need it to finish
  std::unique_ptr<std::thread> ending;
  {
    std::unique_lock lock(mutex_);
    forget_thread_of_another_process();
    changed_.wait(lock, [&] { return !busy_; });
    if (!thread_) return;
    stopping_ = true;
    changed_.notify_all();
    ending = std::move(thread_);
  }
  ending->join();
}

void CollectiveThread::forget_thread_of_another_process() {
  if (thread_ && thread_process_ != ::getpid()) {
    (void)thread_.release();  // leaked on purpose: neither joinable nor destructible here
  }
}

}  // namespace pulseloco::python
