// `pulseloco info [--json]`: the version and what this build contains.
#include <fmt/format.h>

#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include <pulseloco/base/cpu_features.h>
#include <pulseloco/build_config.h>
#include <pulseloco/cli/commands.h>
#include <pulseloco/engine/options.h>
#if PULSELOCO_HAS_CUDA
#include <pulseloco/kernels/gpu_runtime.h>
#endif

namespace pulseloco::cli {
namespace {

nlohmann::json build_info() {
  nlohmann::json info;
  info["version"] = PULSELOCO_VERSION_STRING;
  info["build_type"] = PULSELOCO_BUILD_TYPE;
  info["compiler"] = PULSELOCO_CXX_COMPILER;
  info["features"] = {
      {"cuda", PULSELOCO_HAS_CUDA == 1},
      {"nccl", PULSELOCO_HAS_NCCL == 1},
      {"mpi", PULSELOCO_HAS_MPI == 1},
      {"torch", PULSELOCO_HAS_TORCH == 1},
  };
  // Whether an engine in this program can keep θ_g, m and e on a CUDA device.
  info["device_state"] = device_state_available();
  nlohmann::json versions = nlohmann::json::object();
  info["cuda_devices"] = nlohmann::json::array();
#if PULSELOCO_HAS_CUDA
  versions["cuda_compiler"] = PULSELOCO_CUDA_COMPILER_VERSION;
  versions["cuda_architectures"] = PULSELOCO_CUDA_ARCHITECTURES;
  versions["cuda_runtime"] = kernels::cuda_runtime_version();
  for (int d = 0; d < kernels::cuda_device_count(); ++d) {
    info["cuda_devices"].push_back(kernels::cuda_device_description(d));
  }
#endif
  if (PULSELOCO_HAS_NCCL) versions["nccl"] = PULSELOCO_NCCL_VERSION;
  if (PULSELOCO_HAS_MPI) versions["mpi"] = PULSELOCO_MPI_VERSION;
  if (PULSELOCO_HAS_TORCH) versions["torch"] = PULSELOCO_TORCH_VERSION;
  info["versions"] = versions;
  info["cpu_isa"] = std::string(cpu_isa_name(detected_cpu_isa()));
  return info;
}

void print_text(const nlohmann::json& info) {
  fmt::print("pulseloco {} ({}, {})\n", info["version"].get<std::string>(),
             info["build_type"].get<std::string>(), info["compiler"].get<std::string>());
  const auto& versions = info["versions"];
  auto line = [&](const char* label, const char* feature, const char* version_key) {
    const bool built = info["features"][feature].get<bool>();
    std::string detail;
    if (built && versions.contains(version_key)) {
      detail = " " + versions[version_key].get<std::string>();
    }
    fmt::print("  {:<8} {}{}\n", label, built ? "yes" : "no", detail);
  };
  line("CUDA", "cuda", "cuda_compiler");
  line("NCCL", "nccl", "nccl");
  line("MPI", "mpi", "mpi");
  line("libtorch", "torch", "torch");
  fmt::print("  state    {}\n", info["device_state"].get<bool>()
                                    ? "on the parameters' CUDA device, or in host memory"
                                    : "in host memory (no device state in this build)");
  fmt::print("  CPU ISA  {}\n", info["cpu_isa"].get<std::string>());
  const auto& devices = info["cuda_devices"];
  if (devices.empty()) {
    fmt::print("  GPUs     none visible\n");
  } else {
    for (std::size_t d = 0; d < devices.size(); ++d) {
      fmt::print("  GPU {}    {}\n", d, devices[d].get<std::string>());
    }
  }
}

}  // namespace

void add_info_command(CLI::App& app) {
  auto* command = app.add_subcommand("info", "Show the version and what this build contains");
  auto json = std::make_shared<bool>(false);
  command->add_flag("--json", *json, "Print machine-readable JSON");
  command->callback([json] {
    const nlohmann::json info = build_info();
    if (*json) {
      std::cout << info.dump(2) << '\n';
    } else {
      print_text(info);
    }
  });
}

}  // namespace pulseloco::cli
