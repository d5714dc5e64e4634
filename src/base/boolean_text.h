// Internal: the boolean spellings every PULSELOCO_* variable accepts (docs/operations.md,
// "Environment variables"): 1/0, true/false, yes/no, on/off, in any case.
#pragma once

#include <algorithm>
#include <cctype>
#include <optional>
#include <string>
#include <string_view>

namespace pulseloco {

[[nodiscard]] inline std::optional<bool> parse_boolean_text(std::string_view text) {
  std::string value(text);
  std::transform(value.begin(), value.end(), value.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (value == "1" || value == "true" || value == "yes" || value == "on") return true;
  if (value == "0" || value == "false" || value == "no" || value == "off") return false;
  return std::nullopt;
}

}  // namespace pulseloco
