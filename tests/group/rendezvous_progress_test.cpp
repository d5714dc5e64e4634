// A long rendezvous says that it goes on and whom it waits for (PULSELOCO_WAIT_LOG_SECONDS): the
// server names the ranks that have not registered, a waiting rank says since when it waits and
// where. The test moves on when a line appears, never after a sleep.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>

#include <fmt/format.h>

#include <pulseloco/group/rendezvous.h>
#include <pulseloco/group/rendezvous_server.h>
#include "base/log_capture.h"
#include "transport/loopback_group.h"

namespace pulseloco::group {
namespace {

using namespace std::chrono_literals;

constexpr auto kBound = 120s;  // how long the test waits for a line, on a busy machine

TEST(RendezvousProgress, TheServerNamesTheMissingRanksAndAWaitingRankSaysWhereItWaits) {
  ::setenv("PULSELOCO_WAIT_LOG_SECONDS", "0.1", 1);
  const testing::LogCapture log(spdlog::level::warn);
  RendezvousServer server("127.0.0.1", 0, 2, transport::TcpOptions{},
                          transport::deadline_after(kBound), "");
  const auto rank_options = [&](int rank) {
    TransportOptions options = transport::testing::loopback_options({}, rank, 2, server.port());
    options.connect_timeout = kBound;
    return options;
  };
  std::exception_ptr rank_1_error;
  std::thread rank_1([&] {
    try {
      (void)environment_rendezvous(rank_options(1), 4001);
    } catch (...) {
      rank_1_error = std::current_exception();
    }
  });
  const bool server_named_rank_0 =
      log.wait_for("for rank 0 to register (1 of 2 registered)", kBound);
  const bool rank_1_said_it_waits = log.wait_for("rendezvous: rank 1 has waited", kBound);
  // Rank 0 arrives only now, so that rank 1 is let go whatever the lines said.
  std::exception_ptr rank_0_error;
  try {
    (void)environment_rendezvous(rank_options(0), 4000);
  } catch (...) {
    rank_0_error = std::current_exception();
  }
  rank_1.join();
  server.wait();
  ::unsetenv("PULSELOCO_WAIT_LOG_SECONDS");
  EXPECT_TRUE(server_named_rank_0) << log.text();
  EXPECT_TRUE(rank_1_said_it_waits) << log.text();
  EXPECT_NE(log.text().find(fmt::format("to form at 127.0.0.1:{}", server.port())),
            std::string::npos)
      << log.text();
  if (rank_0_error) std::rethrow_exception(rank_0_error);
  if (rank_1_error) std::rethrow_exception(rank_1_error);
}

}  // namespace
}  // namespace pulseloco::group
