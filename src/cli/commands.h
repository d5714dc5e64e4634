// Subcommands of the `pulseloco` command-line tool. Each adds itself to the app.
#pragma once

#include <CLI/CLI.hpp>

#include <exception>

namespace pulseloco::cli {

void add_coordinator_command(CLI::App& app);
void add_info_command(CLI::App& app);
void add_inspect_command(CLI::App& app);
void add_patch_command(CLI::App& app);
void add_replay_command(CLI::App& app);

// The exit status an exception escaping a subcommand maps to when it is not a plain failure
// (replay: 2 when a window did not reproduce); 0 when it is a plain failure (status 1).
[[nodiscard]] int replay_failure_status(const std::exception& error) noexcept;

}  // namespace pulseloco::cli
