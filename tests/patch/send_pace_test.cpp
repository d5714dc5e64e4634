// The push server's rules for dropping a subscriber that does not keep up (src/patch/send_pace.h),
// driven with times of the test's own: idle for the idle timeout, fewer bytes in a window than
// the minimum rate asks, and what keeps a subscriber: enough bytes in every window.
#include <gtest/gtest.h>

#include <chrono>

#include <pulseloco/patch/send_pace.h>

namespace pulseloco::patch {
namespace {

using namespace std::chrono_literals;
using Rule = PaceVerdict::Rule;
const SendPace::TimePoint kStart{1'000'000s};

TEST(SendPace, WithoutAMinimumRateOnlyAnIdleSubscriberIsDropped) {
  SendPace pace({.idle_timeout = 60s, .min_bytes_per_second = 0}, kStart);
  EXPECT_EQ(pace.deadline(), kStart + 60s);
  // One MiB a minute, taken a little every second, is never dropped by the idle rule alone.
  SendPace::TimePoint now = kStart;
  for (int second = 1; second <= 600; ++second) {
    now = kStart + std::chrono::seconds(second);
    ASSERT_FALSE(pace.verdict(now)) << second;
    pace.took((1 << 20) / 60, now);
  }
  EXPECT_EQ(pace.deadline(), now + 60s);
  EXPECT_FALSE(pace.verdict(now + 60s - 1ms));
  const auto idle = pace.verdict(now + 60s);
  ASSERT_TRUE(idle);
  EXPECT_EQ(idle->rule, Rule::idle);
  EXPECT_EQ(idle->reason, "it took no bytes for 60000 ms");
}

TEST(SendPace, OneMebibyteAMinuteIsBelowTheDefaultMinimum) {
  const PaceLimits defaults{.idle_timeout = 60s, .min_bytes_per_second = 128 << 10, .window = 60s};
  SendPace pace(defaults, kStart);
  pace.took(1 << 20, kStart + 30s);  // not idle, but 1 MiB where 7.5 MiB were due
  EXPECT_FALSE(pace.verdict(kStart + 60s - 1ms));
  EXPECT_EQ(pace.deadline(), kStart + 60s);
  const auto slow = pace.verdict(kStart + 60s);
  ASSERT_TRUE(slow);
  EXPECT_EQ(slow->rule, Rule::slow);
  EXPECT_EQ(slow->reason,
            "it took 1048576 bytes in 60000 ms (17476 bytes/s), below the minimum of 131072 "
            "bytes/s");
}

TEST(SendPace, EnoughBytesInEveryWindowKeepTheSubscriber) {
  SendPace pace({.idle_timeout = 10s, .min_bytes_per_second = 1000, .window = 1s}, kStart);
  pace.took(600, kStart + 200ms);
  EXPECT_EQ(pace.deadline(), kStart + 1s);  // 400 more bytes due by the window's end
  pace.took(400, kStart + 900ms);
  EXPECT_EQ(pace.deadline(), kStart + 2s);  // the next window starts empty
  for (int window = 1; window < 20; ++window) {
    const auto now = kStart + std::chrono::seconds(window) + 500ms;
    EXPECT_FALSE(pace.verdict(now)) << window;
    pace.took(1000, now);
  }
  EXPECT_FALSE(pace.verdict(kStart + 21s - 1ms));
  EXPECT_TRUE(pace.verdict(kStart + 21s));  // the window after the last bytes stayed empty
}

TEST(SendPace, AWriteThatCompletesAfterAShortWindowDropsTheSubscriberAtOnce) {
  SendPace pace({.idle_timeout = 10s, .min_bytes_per_second = 1000, .window = 1s}, kStart);
  pace.took(100, kStart + 100ms);
  // A write blocked across the window's end: its bytes count in the next window, too late.
  pace.took(5000, kStart + 1500ms);
  const auto slow = pace.verdict(kStart + 1500ms);
  ASSERT_TRUE(slow);
  EXPECT_EQ(slow->rule, Rule::slow);
  EXPECT_EQ(slow->reason,
            "it took 100 bytes in 1000 ms (100 bytes/s), below the minimum of 1000 bytes/s");
  EXPECT_LE(pace.deadline(), kStart + 1500ms);
}

TEST(SendPace, AnIdleSubscriberIsNamedIdleEvenWhenItsWindowIsShortToo) {
  SendPace pace({.idle_timeout = 2s, .min_bytes_per_second = 1000, .window = 2s}, kStart);
  EXPECT_EQ(pace.deadline(), kStart + 2s);
  const auto verdict = pace.verdict(kStart + 2s);
  ASSERT_TRUE(verdict);
  EXPECT_EQ(verdict->rule, Rule::idle);
}

TEST(SendPace, AWindowTooShortToAskForABytePerSecondStillAsksForOne) {
  SendPace pace({.idle_timeout = 10s, .min_bytes_per_second = 1, .window = 10ms}, kStart);
  EXPECT_EQ(pace.deadline(), kStart + 10ms);
  EXPECT_TRUE(pace.verdict(kStart + 10ms));
}

}  // namespace
}  // namespace pulseloco::patch
