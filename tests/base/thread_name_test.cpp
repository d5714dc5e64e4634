#include <pulseloco/base/thread_name.h>

#include <gtest/gtest.h>

#include <pthread.h>

#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <thread>

#include <pulseloco/base/thread_pool.h>

namespace pulseloco {
namespace {

// Runs fn on a new thread and returns what it returned.
template <typename Fn>
std::string on_new_thread(Fn fn) {
  std::string result;
  std::thread thread([&] { result = fn(); });
  thread.join();
  return result;
}

TEST(ThreadName, NamesTheCallingThreadOnly) {
  const std::string before = this_thread_name();
  const std::string named = on_new_thread([] {
    set_this_thread_name("pl-test");
    return this_thread_name();
  });
  EXPECT_EQ(named, "pl-test");
  EXPECT_EQ(this_thread_name(), before);
}

TEST(ThreadName, CutsALongNameToWhatLinuxKeeps) {
  const std::string named = on_new_thread([] {
    set_this_thread_name("pl-a-name-longer-than-fifteen-bytes");
    return this_thread_name();
  });
  EXPECT_EQ(named,
            std::string("pl-a-name-longer-than-fifteen-bytes").substr(0, kMaxThreadNameBytes));
}

// The name another thread holds (pthread_getname_np reads it from /proc).
std::string name_of(std::thread::native_handle_type thread) {
  char buffer[kMaxThreadNameBytes + 1] = {};
  if (pthread_getname_np(thread, buffer, sizeof buffer) != 0) return {};
  return buffer;
}

// The threads of this process that bear `name`.
int threads_named(const std::string& name) {
  int count = 0;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++count;
  }
  return count;
}

// Named by its creator, a thread bears the name before it has run at all.
TEST(ThreadName, AThreadNamedByItsCreatorHoldsTheNameBeforeItRuns) {
  std::promise<void> go;
  std::thread thread([ready = go.get_future()]() mutable { ready.wait(); });
  set_thread_name(thread.native_handle(), "pl-early");
  EXPECT_EQ(name_of(thread.native_handle()), "pl-early");
  go.set_value();
  thread.join();
}

// The pool names its workers as it starts them, so none bears its creator's name.
TEST(ThreadName, ThePoolsWorkersAreNamedAsSoonAsItIsBuilt) {
  const int before = threads_named("pl-pool");
  ThreadPool pool(3);  // the caller and two workers
  EXPECT_EQ(threads_named("pl-pool") - before, 2);
}

TEST(ThreadName, ThePoolsWorkersAreNamed) {
  ThreadPool pool(2);  // the caller and one worker
  std::string name;
  pool.submit([&] { name = this_thread_name(); }).get();
  EXPECT_EQ(name, "pl-pool");
}

}  // namespace
}  // namespace pulseloco
