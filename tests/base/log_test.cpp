#include <pulseloco/base/log.h>

#include <gtest/gtest.h>

namespace pulseloco {
namespace {

TEST(Log, ParsesEveryLevelName) {
  EXPECT_EQ(parse_log_level("trace"), spdlog::level::trace);
  EXPECT_EQ(parse_log_level("debug"), spdlog::level::debug);
  EXPECT_EQ(parse_log_level("info"), spdlog::level::info);
  EXPECT_EQ(parse_log_level("warning"), spdlog::level::warn);
  EXPECT_EQ(parse_log_level("warn"), spdlog::level::warn);
  EXPECT_EQ(parse_log_level("error"), spdlog::level::err);
  EXPECT_EQ(parse_log_level("critical"), spdlog::level::critical);
  EXPECT_EQ(parse_log_level("off"), spdlog::level::off);
  EXPECT_FALSE(parse_log_level("loud").has_value());
  EXPECT_FALSE(parse_log_level("").has_value());
}

}  // namespace
}  // namespace pulseloco
