// The window calls of a training loop, whoever runs them: an Engine over a fixed group, or an
// ElasticEngine that re-forms its group and retries (elastic/elastic_engine.h). The adapters hold
// one of these instead of asking which of the two they have at every call.
#pragma once

#include <optional>

#include <pulseloco/engine/report.h>

namespace pulseloco {

class Engine;

class WindowRunner {
 public:
  virtual ~WindowRunner() = default;

  // Call after every inner optimizer step; every H-th call runs a window (collective) and
  // returns its report.
  [[nodiscard]] virtual std::optional<WindowReport> after_optimizer_step() = 0;
  // Runs a window now (collective), regardless of the step count.
  [[nodiscard]] virtual WindowReport run_window() = 0;
  // Overlapped windows: applies the window in flight without starting another (collective);
  // nothing when none is in flight.
  [[nodiscard]] virtual std::optional<WindowReport> complete_in_flight() = 0;
  // The engine that holds the state (itself, or the elastic run's).
  [[nodiscard]] virtual Engine& engine() noexcept = 0;

 protected:
  WindowRunner() = default;
  WindowRunner(const WindowRunner&) = default;
  WindowRunner& operator=(const WindowRunner&) = default;
};

}  // namespace pulseloco
