// Names for the threads pulseloco starts, so that `top -H`, `ps -L`, gdb and `perf report
// --sort comm` tell them apart from the application's threads (a TCP transport's I/O thread
// from the training loop that drives it, say).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <thread>

namespace pulseloco {

// Linux keeps at most this many bytes of a thread's name (16 with the terminating NUL).
inline constexpr std::size_t kMaxThreadNameBytes = 15;

// Names the calling thread. A longer name is cut to kMaxThreadNameBytes; failing to name a
// thread is not an error worth stopping for, so nothing is reported.
void set_this_thread_name(std::string_view name) noexcept;

// Names another thread, from the thread that started it. A new thread bears its creator's name
// until it names itself, which on a busy machine may be long after it was started: naming it
// from the creator makes the name hold as soon as this returns.
void set_thread_name(std::thread::native_handle_type thread, std::string_view name) noexcept;

// The calling thread's name as the system holds it (empty where it cannot be read).
[[nodiscard]] std::string this_thread_name();

}  // namespace pulseloco
