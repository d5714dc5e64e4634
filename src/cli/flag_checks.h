// Range and choice checks for command-line flags (CLI11 validators) whose errors name the rule
// in words: "--steps-per-window: must be at least 1, got 0". Used by the `pulseloco` tool, the
// examples and the benchmarks, so that every flag is checked the same way before anything runs.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

namespace pulseloco::flags {

namespace detail {

// The flag's value as a decimal number, or nullopt when it is not one. CLI11 converts integers
// as strtoll does with base 0, where "010" is 8 and "0x10" 16, and a check cannot rewrite the
// text it converts: a checked flag must be plain decimal, without leading zeros.
[[nodiscard]] inline std::optional<double> decimal(const std::string& text) {
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (error != std::errc{} || stop != end) return std::nullopt;
  const std::size_t first = !text.empty() && text[0] == '-' ? 1 : 0;
  if (first + 1 < text.size() && text[first] == '0' && text[first + 1] >= '0' &&
      text[first + 1] <= '9')
    return std::nullopt;
  return value;
}

// Whether `text` (already accepted by decimal()) is an integer beyond the 64-bit signed range.
// CLI11 converts integers with strtoll or strtoull, which saturate there without an error, so
// "--join-every 99999999999999999999" would run with 2^64 - 1. A check cannot see the option's
// type; narrower types are refused by CLI11's own conversion, and refusing above 2^63 - 1 also
// covers signed 64-bit options (no checked flag needs more).
[[nodiscard]] inline bool integer_out_of_range(const std::string& text) {
  const std::size_t first = !text.empty() && text[0] == '-' ? 1 : 0;
  if (first == text.size()) return false;
  for (std::size_t i = first; i < text.size(); ++i) {
    if (text[i] < '0' || text[i] > '9') return false;  // a fraction or exponent: a real number
  }
  std::int64_t value = 0;
  return std::from_chars(text.data(), text.data() + text.size(), value).ec ==
         std::errc::result_out_of_range;
}

template <typename Accept>
[[nodiscard]] CLI::Validator check(std::string rule, std::string description, Accept accept) {
  return CLI::Validator(
      [rule, accept](const std::string& text) -> std::string {
        const auto value = decimal(text);
        if (!value)
          return fmt::format("must be a decimal number without leading zeros, got {}", text);
        // from_chars reads "inf" and "nan" too; NaN fails every rule below, infinity would not.
        if (std::isinf(*value)) return fmt::format("must be a finite number, got {}", text);
        if (integer_out_of_range(text))
          return fmt::format("must fit a 64-bit signed integer, got {}", text);
        if (!accept(*value)) return fmt::format("must be {}, got {}", rule, text);
        return {};
      },
      std::move(description));
}

}  // namespace detail

// value >= min
template <typename T>
[[nodiscard]] CLI::Validator at_least(T min) {
  return detail::check(fmt::format("at least {}", min), fmt::format(">= {}", min),
                       [min](double value) { return value >= static_cast<double>(min); });
}

// value > min (for real-valued flags such as learning rates)
template <typename T>
[[nodiscard]] CLI::Validator above(T min) {
  return detail::check(fmt::format("greater than {}", min), fmt::format("> {}", min),
                       [min](double value) { return value > static_cast<double>(min); });
}

// lo <= value <= hi
template <typename T>
[[nodiscard]] CLI::Validator between(T lo, T hi) {
  return detail::check(fmt::format("between {} and {}", lo, hi), fmt::format("in [{}, {}]", lo, hi),
                       [lo, hi](double value) {
                         return value >= static_cast<double>(lo) &&
                                value <= static_cast<double>(hi);
                       });
}

// lo <= value < hi (for momenta and fractions that must stay below 1)
template <typename T>
[[nodiscard]] CLI::Validator at_least_and_below(T lo, T hi) {
  return detail::check(fmt::format("at least {} and below {}", lo, hi),
                       fmt::format("in [{}, {})", lo, hi), [lo, hi](double value) {
                         return value >= static_cast<double>(lo) && value < static_cast<double>(hi);
                       });
}

// value is one of `choices` (names such as fp32, bf16)
[[nodiscard]] inline CLI::Validator one_of(std::vector<std::string> choices) {
  const std::string listed = fmt::format("{}", fmt::join(choices, ", "));
  return CLI::Validator(
      [choices, listed](std::string& text) -> std::string {
        for (const std::string& choice : choices) {
          if (text == choice) return {};
        }
        return fmt::format("must be one of {}, got {}", listed, text);
      },
      fmt::format("one of {}", listed));
}

}  // namespace pulseloco::flags
