// A publisher killed between a version's files and its manifest: a child process publishes
// versions 1-3 of PatchRun(7) into a directory or a bucket, then stops for good once version 4's
// files are in place, before its manifest; the parent waits for that event on a pipe and
// SIGKILLs it. Readers must then see version 3 as the newest.
#pragma once

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <string_view>

#include <pulseloco/patch/publisher.h>
#include "patch/patch_run.h"

namespace pulseloco::testing {

// How long the child may take to publish versions 1-3 and version 4's files.
inline constexpr int kPublishDeadlineMs = 120000;

// `in_child` runs first in the child (its environment, say).
inline void publish_and_kill_before_manifest(const std::string& location,
                                             const std::function<void()>& in_child = {}) {
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
    // The child never returns into the test: a failed publish ends it, closing the pipe.
    try {
      if (in_child) in_child();
      PatchRun run(7);
      std::uint64_t publishing = 0;
      patch::Publisher publisher(location,
                                 {.anchor_every = 3, .fault_hook = [&](std::string_view point) {
                                    if (publishing == 4 && point == "files written") {
                                      const char byte = 'k';
                                      (void)!::write(ready[1], &byte, 1);
                                      for (;;)
                                        ::pause();  // until SIGKILL
                                    }
                                  }});
      for (std::uint64_t v = 1; v <= 4; ++v) {
        if (v > 1) run.step();
        publishing = v;
        (void)publisher.publish(run.views(), v);
      }
    } catch (const std::exception& error) {
      std::fprintf(stderr, "the publisher child failed: %s\n", error.what());
    }
    ::_exit(3);
  }
  ::close(ready[1]);
  pollfd event{ready[0], POLLIN, 0};
  const int polled = ::poll(&event, 1, kPublishDeadlineMs);
  char byte = 0;
  const bool reached = polled == 1 && ::read(ready[0], &byte, 1) == 1;
  ::close(ready[0]);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  if (!reached) {
    ::waitpid(child, nullptr, 0);
    FAIL() << "the publisher child did not reach version 4's manifest within "
           << kPublishDeadlineMs << " ms (it ended or hung)";
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
}

}  // namespace pulseloco::testing
