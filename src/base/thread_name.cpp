#include <pulseloco/base/thread_name.h>

#include <pthread.h>

#include <algorithm>
#include <array>

namespace pulseloco {

void set_thread_name(std::thread::native_handle_type thread, std::string_view name) noexcept {
  std::array<char, kMaxThreadNameBytes + 1> buffer{};
  const std::size_t length = std::min(name.size(), kMaxThreadNameBytes);
  std::copy_n(name.data(), length, buffer.data());
  (void)pthread_setname_np(thread, buffer.data());
}

void set_this_thread_name(std::string_view name) noexcept {
  set_thread_name(pthread_self(), name);
}

std::string this_thread_name() {
  std::array<char, kMaxThreadNameBytes + 1> buffer{};
  if (pthread_getname_np(pthread_self(), buffer.data(), buffer.size()) != 0) return {};
  return std::string(buffer.data());
}

}  // namespace pulseloco
