#include <pulseloco/base/thread_name.h>

#include <gtest/gtest.h>

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

TEST(ThreadName, ThePoolsWorkersAreNamed) {
  ThreadPool pool(2);  // the caller and one worker
  std::string name;
  pool.submit([&] { name = this_thread_name(); }).get();
  EXPECT_EQ(name, "pl-pool");
}

}  // namespace
}  // namespace pulseloco
