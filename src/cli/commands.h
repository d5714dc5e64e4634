// Subcommands of the `pulseloco` command-line tool. Each adds itself to the app.
#pragma once

#include <CLI/CLI.hpp>

namespace pulseloco::cli {

void add_info_command(CLI::App& app);
void add_inspect_command(CLI::App& app);

}  // namespace pulseloco::cli
