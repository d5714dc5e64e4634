// Test helper: a worker process started with fork/execve, with a pipe for its report lines (its
// fd 3, or its stdout) and a pipe as its stdin; read under a deadline, killed when destroyed.
// Multi-process tests act on the reported lines, never on sleeps.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

extern char** environ;

namespace pulseloco::testing {

using ChildClock = std::chrono::steady_clock;

// A worker process with a pipe for its reports (its fd 3) and a pipe as its stdin.
class Child {
 public:
  Child(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
        bool report_to_stdout = false) {
    // Everything the child needs is prepared before fork(): after it only async-signal-safe
    // calls are made.
    std::vector<std::string> env_strings;
    for (char** entry = environ; *entry != nullptr; ++entry) {
      const std::string_view text = *entry;
      const auto name = text.substr(0, text.find('='));
      if (env.count(std::string(name)) == 0) env_strings.emplace_back(text);
    }
    for (const auto& [name, value] : env)
      env_strings.push_back(name + "=" + value);
    std::vector<char*> envp;
    for (auto& s : env_strings)
      envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_strings = args;
    std::vector<char*> argv;
    for (auto& s : argv_strings)
      argv.push_back(s.data());
    argv.push_back(nullptr);

    int report[2];
    int input[2];
    if (::pipe2(report, O_CLOEXEC) != 0 || ::pipe2(input, O_CLOEXEC) != 0)
      throw std::runtime_error("pipe2 failed");
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::dup2(input[0], STDIN_FILENO);
      ::dup2(report[1], report_to_stdout ? STDOUT_FILENO : 3);
      ::execve(argv[0], argv.data(), envp.data());
      ::_exit(127);
    }
    ::close(report[1]);
    ::close(input[0]);
    report_fd_ = report[0];
    stdin_fd_ = input[1];
  }

  ~Child() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (report_fd_ >= 0) ::close(report_fd_);
    if (stdin_fd_ >= 0) ::close(stdin_fd_);
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  [[nodiscard]] pid_t pid() const { return pid_; }

  // The next reported line, or nullopt at end of file (the child exited) or at the deadline.
  std::optional<std::string> next_line(ChildClock::time_point deadline) {
    for (;;) {
      if (const auto newline = buffer_.find('\n'); newline != std::string::npos) {
        std::string line = buffer_.substr(0, newline);
        buffer_.erase(0, newline + 1);
        lines_.push_back(line);
        return line;
      }
      if (eof_) return std::nullopt;
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - ChildClock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{report_fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char chunk[4096];
      const auto n = ::read(report_fd_, chunk, sizeof chunk);
      if (n <= 0) {
        eof_ = true;
      } else {
        buffer_.append(chunk, static_cast<std::size_t>(n));
      }
    }
  }

  // Reads lines until one starts with `prefix`; returns it, or "" at end of file or deadline.
  std::string expect(const std::string& prefix, ChildClock::time_point deadline) {
    while (auto line = next_line(deadline))
      if (line->rfind(prefix, 0) == 0) return *line;
    return {};
  }

  // Like expect(), but a line read already (by start_group, say) counts too.
  std::string seen_or_expect(const std::string& prefix, ChildClock::time_point deadline) {
    for (const auto& line : lines_)
      if (line.rfind(prefix, 0) == 0) return line;
    return expect(prefix, deadline);
  }

  // Waits for the exit (the report pipe closes when the child dies) and returns the status.
  int wait_exit(ChildClock::time_point deadline) {
    while (next_line(deadline)) {
    }
    if (!eof_) {
      ::kill(pid_, SIGKILL);
      ADD_FAILURE() << "worker " << pid_ << " did not exit in time; killed";
    }
    int status = 0;
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    return status;
  }

  void signal(int sig) const { ::kill(pid_, sig); }
  // Writes `line` and a newline to the child's stdin; false when the child has closed it.
  bool write_line(const std::string& line) {
    const std::string text = line + "\n";
    std::size_t done = 0;
    while (done < text.size()) {
      const auto n = ::write(stdin_fd_, text.data() + done, text.size() - done);
      if (n <= 0) return false;
      done += static_cast<std::size_t>(n);
    }
    return true;
  }
  // Closes the child's stdin: it sees end of input.
  void close_stdin() {
    if (stdin_fd_ >= 0) ::close(stdin_fd_);
    stdin_fd_ = -1;
  }
  [[nodiscard]] const std::vector<std::string>& lines() const { return lines_; }

 private:
  pid_t pid_ = -1;
  int report_fd_ = -1;
  int stdin_fd_ = -1;
  std::string buffer_;
  std::vector<std::string> lines_;
  bool eof_ = false;
  bool reaped_ = false;
};

}  // namespace pulseloco::testing
