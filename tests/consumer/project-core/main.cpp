// A CPU training loop on the `core` component: a group of one (no launcher, no environment),
// an engine over a plain float buffer, and windows that must commit and stay identical.
#include <pulseloco/pulseloco.h>

#include <cstdio>
#include <memory>
#include <vector>

int main() try {
  std::vector<float> weights(4096, 0.25f);
  std::vector<pulseloco::NamedTensor> parameters;
  parameters.push_back({.name = "w", .view = {.data = weights.data(), .numel = weights.size()}});
  pulseloco::EngineOptions options;
  options.steps_per_window = 2;
  auto transport = pulseloco::group::make_transport(pulseloco::group::from_environment());
  pulseloco::Engine engine(std::move(parameters), options, std::move(transport));
  int windows = 0;
  for (int step = 0; step < 6; ++step) {
    for (float& w : weights)
      w -= 1e-2f;  // the "optimizer step"
    if (auto report = engine.after_optimizer_step()) {
      if (!report->replicas_identical) return 3;
      ++windows;
    }
  }
  if (windows != 3 || engine.committed_windows() != 3) return 1;
  // Without the cuda component the state lives in host memory, and nothing offers a device.
  if (pulseloco::device_state_available() || engine.state_location() != "host") return 4;
  std::printf("consumer core ok: %d windows, world size %d\n", windows, engine.world_size());
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "consumer core: %s\n", error.what());
  return 2;
}
