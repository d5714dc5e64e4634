// One rank of engine_device_process_test: joins the group the environment names (RANK,
// WORLD_SIZE, MASTER_ADDR, MASTER_PORT: group::from_environment), keeps its state on cuda:0
// (--location device) or in host memory (--location host), trains a test model and runs
// --windows windows. Reports on stdout, one line each:
//   ready location=<where the state lives>
//   window=<w> digest=<hex>
//   done
//   error <what>          (then exits 1)
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <string>

#include <pulseloco/engine/engine.h>
#include <pulseloco/group/make_transport.h>
#include "gpu/device_model.h"

int main(int argc, char** argv) {
  using namespace pulseloco;
  CLI::App app("one rank of the device-state process test");
  std::string location = "device";
  std::string mode = "pulse";
  std::string dtype = "f32";
  int windows = 5;
  app.add_option("--location", location, "device or host")->required();
  app.add_option("--mode", mode, "pulse or diloco");
  app.add_option("--dtype", dtype, "f32 or bf16");
  app.add_option("--windows", windows, "windows to run");
  CLI11_PARSE(app, argc, argv);
  auto report = [](const std::string& line) {
    std::fputs((line + "\n").c_str(), stdout);
    std::fflush(stdout);
  };
  try {
    auto transport = group::make_transport(group::from_environment());
    const int rank = transport->rank();
    EngineOptions options = testing::small_options(parse_mode(mode));
    options.timeout = std::chrono::milliseconds(60'000);
    options.state_location = location == "device" ? StateLocation::device : StateLocation::host;
    const DType local = dtype == "bf16" ? DType::bfloat16 : DType::float32;
    testing::TestRank me(
        testing::make_model({2500, 1, 3000}, local, 11 + static_cast<std::uint32_t>(rank)),
        location == "device");
    Engine engine(me.views(), options, std::move(transport));
    me.after_window();
    report(fmt::format("ready location={}", engine.state_location()));
    for (int w = 0; w < windows; ++w) {
      me.train(1e-3f, 4,
               1000 * static_cast<std::uint32_t>(w + 1) + static_cast<std::uint32_t>(rank));
      const WindowReport window = engine.run_window();
      me.after_window();
      report(fmt::format("window={} digest={}", window.window, digest_hex(window.digest)));
    }
    report("done");
    return 0;
  } catch (const std::exception& e) {
    report(fmt::format("error {}", e.what()));
    return 1;
  }
}
