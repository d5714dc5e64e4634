#include <pulseloco/cli/flag_checks.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace pulseloco::flags {
namespace {

// Parses `--value <text>` with `check`; returns CLI11's error message ("" when accepted).
template <typename T>
std::string parse(const std::string& text, const CLI::Validator& check) {
  CLI::App app;
  T value{};
  app.add_option("--value", value)->check(check);
  std::vector<std::string> args{text, "--value"};  // CLI11 parses a reversed vector
  try {
    app.parse(args);
    return "";
  } catch (const CLI::ParseError& error) {
    return error.what();
  }
}

TEST(FlagChecks, AtLeastNamesTheRuleAndTheValue) {
  EXPECT_EQ(parse<int>("0", at_least(1)), "--value: must be at least 1, got 0");
  EXPECT_EQ(parse<int>("1", at_least(1)), "");
  EXPECT_EQ(parse<std::uint64_t>("-3", at_least(0)), "--value: must be at least 0, got -3");
}

TEST(FlagChecks, AboveRejectsTheBoundAndNotANumber) {
  EXPECT_EQ(parse<double>("0", above(0)), "--value: must be greater than 0, got 0");
  EXPECT_EQ(parse<double>("nan", above(0)), "--value: must be greater than 0, got nan");
  EXPECT_EQ(parse<double>("inf", above(0)), "--value: must be a finite number, got inf");
  EXPECT_EQ(parse<double>("-infinity", at_least(-1.0)),
            "--value: must be a finite number, got -infinity");
  EXPECT_EQ(parse<double>("3e-6", above(0)), "");
}

TEST(FlagChecks, BetweenIncludesBothEnds) {
  const auto check = between(std::uint64_t{4096}, std::uint64_t{1} << 30);
  EXPECT_EQ(parse<std::uint64_t>("4096", check), "");
  EXPECT_EQ(parse<std::uint64_t>("1073741824", check), "");
  EXPECT_EQ(parse<std::uint64_t>("5", check),
            "--value: must be between 4096 and 1073741824, got 5");
}

TEST(FlagChecks, AtLeastAndBelowExcludesTheUpperEnd) {
  EXPECT_EQ(parse<float>("0", at_least_and_below(0, 1)), "");
  EXPECT_EQ(parse<float>("1", at_least_and_below(0, 1)),
            "--value: must be at least 0 and below 1, got 1");
}

TEST(FlagChecks, OneOfNamesTheChoices) {
  const auto check = one_of({"fp32", "bf16"});
  EXPECT_EQ(parse<std::string>("bf16", check), "");
  EXPECT_EQ(parse<std::string>("fp16", check), "--value: must be one of fp32, bf16, got fp16");
}

TEST(FlagChecks, ANonNumberIsRefusedNamingTheValue) {
  EXPECT_EQ(parse<double>("abc", above(0)),
            "--value: must be a decimal number without leading zeros, got abc");
}

// CLI11 alone would read "010" as octal (8), "0x10" as hex, and "-1" into an unsigned as
// 2^64 - 1.
TEST(FlagChecks, OnlyPlainDecimalNumbersPass) {
  for (const char* text : {"010", "-007", "0x10", "0x0", "0b1", "1'000"}) {
    EXPECT_EQ(parse<std::int64_t>(text, at_least(-10)),
              std::string("--value: must be a decimal number without leading zeros, got ") + text);
  }
  EXPECT_EQ(parse<std::uint64_t>("-1", at_least(0)), "--value: must be at least 0, got -1");
  EXPECT_EQ(parse<int>("0", at_least(0)), "");
  EXPECT_EQ(parse<int>("-0", at_least(0)), "");
  EXPECT_EQ(parse<double>("0.5", above(0)), "");
  EXPECT_EQ(parse<double>("1e-6", above(0)), "");
}

// CLI11 converts with strtoll or strtoull, which saturate beyond 64 bits without an error: such
// a value would run as 2^64 - 1 or 2^63 - 1 instead of being refused.
TEST(FlagChecks, AnIntegerBeyondSixtyFourBitsIsRefusedInsteadOfSaturating) {
  EXPECT_EQ(parse<std::uint64_t>("99999999999999999999", at_least(1)),
            "--value: must fit a 64-bit signed integer, got 99999999999999999999");
  EXPECT_EQ(parse<std::int64_t>("9223372036854775808", at_least(1)),
            "--value: must fit a 64-bit signed integer, got 9223372036854775808");
  EXPECT_EQ(parse<std::int64_t>("-9223372036854775809", at_least(-10)),
            "--value: must fit a 64-bit signed integer, got -9223372036854775809");
  EXPECT_EQ(parse<std::int64_t>("9223372036854775807", at_least(1)), "");
  EXPECT_EQ(parse<std::uint64_t>("9223372036854775807", at_least(1)), "");
  // A real number may be larger, written either way.
  EXPECT_EQ(parse<double>("1e30", above(0)), "");
  EXPECT_EQ(parse<double>("100000000000000000000.5", above(0)), "");
}

// A value within 64 bits but beyond a narrower option is refused by CLI11's own conversion,
// which names the flag and the value.
TEST(FlagChecks, AValueBeyondANarrowerTypeIsRefusedNamingTheFlagAndTheValue) {
  EXPECT_EQ(parse<int>("2147483648", at_least(1)), "Could not convert: --value = 2147483648");
  EXPECT_EQ(parse<std::uint32_t>("4294967296", at_least(1)),
            "Could not convert: --value = 4294967296");
  EXPECT_EQ(parse<int>("2147483647", at_least(1)), "");
}

// `pulseloco coordinator --regroup-timeout-ms` is bounded so that the regroup deadline (now +
// timeout) cannot overflow into the past.
TEST(FlagChecks, TheRegroupTimeoutIsAtMostAWeek) {
  const auto check = between(std::int64_t{1}, std::int64_t{604'800'000});
  EXPECT_EQ(parse<std::int64_t>("604800000", check), "");
  EXPECT_EQ(parse<std::int64_t>("604800001", check),
            "--value: must be between 1 and 604800000, got 604800001");
  EXPECT_EQ(parse<std::int64_t>("9223372036854775807", check),
            "--value: must be between 1 and 604800000, got 9223372036854775807");
  EXPECT_EQ(parse<std::int64_t>("0", check), "--value: must be between 1 and 604800000, got 0");
}

}  // namespace
}  // namespace pulseloco::flags
