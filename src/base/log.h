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

// The rank tag: every log line after it names the process's rank ("[rank N]").
//
// Group formation (group::make_transport) sets it to this process's rank in the group each
// time a group forms. A program that calls set_log_rank() chooses the tag itself: group
// formation leaves it alone from then on.
void set_log_rank(int rank);
// What group formation calls once a group has formed: tags the log lines with `rank` unless the
// program called set_log_rank().
void tag_log_with_group_rank(int rank);
// The rank the log lines name; nullopt while they name none.
[[nodiscard]] std::optional<int> log_rank();

}  // namespace pulseloco
