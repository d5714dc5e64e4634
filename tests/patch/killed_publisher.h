// A publisher killed between a version's files and its manifest: a child process publishes
// versions 1-3 of PatchRun(7) into a directory or a bucket, then stops for good once version 4's
// files are in place, before its manifest; the parent waits for that event on a pipe and
// SIGKILLs it. Readers must then see version 3 as the newest.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include <pulseloco/patch/publisher.h>
#include "patch/patch_run.h"

namespace pulseloco::testing {

// `in_child` runs first in the child (its environment, say).
inline void publish_and_kill_before_manifest(const std::string& location,
                                             const std::function<void()>& in_child = {}) {
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(ready[0]);
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
    ::_exit(3);  // not reached
  }
  ::close(ready[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status));
}

}  // namespace pulseloco::testing
