// `pulseloco`: the command-line tool (build information, message inspection, trace replay, the
// elastic membership coordinator).
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include <pulseloco/base/errors.h>
#include <pulseloco/build_config.h>
#include <pulseloco/cli/commands.h>

int main(int argc, char** argv) {
  CLI::App app{"pulseloco " PULSELOCO_VERSION_STRING
               ": sparse, bit-identical DiLoCo-style synchronisation",
               "pulseloco"};
  app.set_version_flag("--version", PULSELOCO_VERSION_STRING);
  app.require_subcommand(1);
  pulseloco::cli::add_coordinator_command(app);
  pulseloco::cli::add_info_command(app);
  pulseloco::cli::add_inspect_command(app);
  pulseloco::cli::add_patch_command(app);
  pulseloco::cli::add_replay_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const pulseloco::Error& e) {
    std::fprintf(stderr, "pulseloco: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    if (const int status = pulseloco::cli::replay_failure_status(e); status != 0) {
      std::fprintf(stderr, "pulseloco: %s\n", e.what());
      return status;
    }
    std::fprintf(stderr, "pulseloco: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
