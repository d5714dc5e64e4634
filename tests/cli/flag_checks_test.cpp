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

}  // namespace
}  // namespace pulseloco::flags
