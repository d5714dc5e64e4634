// Internal: the thread a Python synchroniser runs its collective calls on. One per synchroniser,
// started on first use and ended by stop() (close(), or the synchroniser's destruction): mode ddp
// averages gradients at every optimizer step, which must not cost a thread each.
#pragma once

#include <nanobind/nanobind.h>

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>

#include <sys/types.h>

namespace pulseloco::python {

namespace nb = nanobind;

class CollectiveThread {
 public:
  CollectiveThread() = default;
  ~CollectiveThread() { stop(); }
  CollectiveThread(const CollectiveThread&) = delete;
  CollectiveThread& operator=(const CollectiveThread&) = delete;

  // Runs `work` on the thread with the GIL released and waits for it, checking for signals
  // meanwhile. When a signal handler raises (KeyboardInterrupt), `interrupt` is called (it must
  // make `work` return soon: it aborts the group), and once `work` has returned the handler's
  // exception is raised instead of whatever `work` returned or threw. Calls from several Python
  // threads run one after another. Call with the GIL held.
  template <class Work, class Interrupt>
  auto run(Work&& work, Interrupt&& interrupt) -> decltype(work()) {
    using Result = decltype(work());
    std::optional<std::conditional_t<std::is_void_v<Result>, bool, Result>> result;
    std::exception_ptr error;
    const std::function<void()> job = [&] {
      try {
        if constexpr (std::is_void_v<Result>) {
          work();
        } else {
          result.emplace(work());
        }
      } catch (...) {
        error = std::current_exception();
      }
    };
    if (std::optional<nb::python_error> interrupted = run_job(job, interrupt)) {
      throw std::move(*interrupted);
    }
    if (error) std::rethrow_exception(error);
    if constexpr (!std::is_void_v<Result>) return std::move(*result);
  }

  // Lets the thread end and joins it, after any call in progress (a later run() starts another
  // thread). Call with the GIL held; it is released meanwhile.
  void stop() noexcept;

 private:
  // Hands `job` (which does not throw) to the thread and waits until it has run; returns the
  // error a signal handler raised meanwhile.
  std::optional<nb::python_error> run_job(const std::function<void()>& job,
                                          const std::function<void()>& interrupt);
  void loop();
  // Forgets a thread this process does not have: the parent's, in a child it forked (a
  // DataLoader worker), which can neither run it nor join it. Under mutex_.
  void forget_thread_of_another_process();

  std::mutex mutex_;
  std::condition_variable changed_;
  std::unique_ptr<std::thread> thread_;
  pid_t thread_process_ = 0;                    // the process thread_ runs in
  bool busy_ = false;                           // a call owns the thread
  const std::function<void()>* job_ = nullptr;  // the call's job, until it has run
  bool job_done_ = false;
  bool stopping_ = false;
};

}  // namespace pulseloco::python
