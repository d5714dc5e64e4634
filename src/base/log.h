// Logging through spdlog. The level comes from PULSELOCO_LOG_LEVEL (trace, debug, info, warn,
// error, critical, off; default info) the first time the logger is used.
#pragma once

#include <spdlog/spdlog.h>

#include <optional>
#include <string_view>

namespace pulseloco {

// The shared "pulseloco" logger (stderr, thread-safe).
[[nodiscard]] spdlog::logger& logger();

// Parses a level name; nullopt when it is not one of spdlog's names.
[[nodiscard]] std::optional<spdlog::level::level_enum> parse_log_level(std::string_view name);

// Prefixes every following log line with "[rank N]" (call once the rank is known).
void set_log_rank(int rank);

}  // namespace pulseloco
