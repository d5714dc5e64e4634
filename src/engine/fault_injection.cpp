#include <pulseloco/engine/fault_injection.h>

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>

namespace pulseloco {
namespace {

std::string_view trim(std::string_view text) {
  while (!text.empty() && text.front() == ' ')
    text.remove_prefix(1);
  while (!text.empty() && text.back() == ' ')
    text.remove_suffix(1);
  return text;
}

std::uint64_t parse_number(std::string_view key, std::string_view value) {
  std::uint64_t number = 0;
  const auto [end, error] = std::from_chars(value.data(), value.data() + value.size(), number);
  if (error != std::errc{} || end != value.data() + value.size()) {
    throw InvalidArgument(
        fmt::format("PULSELOCO_FAULT: {}='{}' is not a non-negative integer", key, value));
  }
  return number;
}

// The enumerator of `all` whose name (fault_phase_name, fault_action_name) is `value`: the
// names are spelled in one place, for parsing and for printing.
template <typename Enum, std::size_t N>
Enum parse_named(std::string_view key, std::string_view value, const std::array<Enum, N>& all,
                 std::string_view (*name_of)(Enum) noexcept) {
  std::string names;
  for (const Enum candidate : all) {
    if (name_of(candidate) == value) return candidate;
    names += fmt::format("{}{}", names.empty() ? "" : ", ", name_of(candidate));
  }
  throw InvalidArgument(
      fmt::format("PULSELOCO_FAULT: {} '{}' is not one of {}", key, value, names));
}

}  // namespace

bool FaultPlan::matches(std::uint64_t at_window, WindowPhase at_phase, int at_rank,
                        std::string_view at_worker) const noexcept {
  return !fired && window == at_window && phase == at_phase && (!rank || *rank == at_rank) &&
         (worker.empty() || worker == at_worker);
}

FaultPlan parse_fault_plan(std::string_view text) {
  FaultPlan plan;
  bool have_window = false;
  bool have_phase = false;
  bool have_action = false;
  while (!text.empty()) {
    const std::size_t comma = text.find(',');
    const std::string_view field = trim(text.substr(0, comma));
    text = comma == std::string_view::npos ? std::string_view{} : text.substr(comma + 1);
    if (field.empty()) continue;
    const std::size_t equals = field.find('=');
    if (equals == std::string_view::npos) {
      throw InvalidArgument(fmt::format("PULSELOCO_FAULT: '{}' is not key=value", field));
    }
    const std::string_view key = trim(field.substr(0, equals));
    const std::string_view value = trim(field.substr(equals + 1));
    if (key == "window") {
      plan.window = parse_number(key, value);
      have_window = true;
    } else if (key == "phase") {
      plan.phase = parse_named(key, value,
                               std::array{WindowPhase::gate, WindowPhase::exchange,
                                          WindowPhase::aggregate, WindowPhase::checkpoint},
                               window_phase_name);
      have_phase = true;
    } else if (key == "action") {
      plan.action = parse_named(key, value,
                                std::array{FaultAction::kill, FaultAction::stall,
                                           FaultAction::disconnect, FaultAction::enospc},
                                fault_action_name);
      have_action = true;
    } else if (key == "rank") {
      plan.rank = static_cast<int>(parse_number(key, value));
    } else if (key == "worker") {
      plan.worker = std::string(value);
    } else {
      throw InvalidArgument(fmt::format(
          "PULSELOCO_FAULT: unknown key '{}' (window, phase, action, rank, worker)", key));
    }
  }
  if (!have_window || !have_phase || !have_action) {
    throw InvalidArgument("PULSELOCO_FAULT needs window=, phase= and action=");
  }
  if (plan.action == FaultAction::enospc && plan.phase != WindowPhase::checkpoint) {
    throw InvalidArgument("PULSELOCO_FAULT: action=enospc needs phase=checkpoint");
  }
  return plan;
}

std::optional<FaultPlan> fault_plan_from_environment() {
  const char* text = std::getenv("PULSELOCO_FAULT");
  if (text == nullptr || *text == '\0') return std::nullopt;
  return parse_fault_plan(text);
}

std::string_view fault_action_name(FaultAction action) noexcept {
  switch (action) {
    case FaultAction::kill:
      return "kill";
    case FaultAction::stall:
      return "stall";
    case FaultAction::disconnect:
      return "disconnect";
    case FaultAction::enospc:
      return "enospc";
  }
  return "?";
}

void FaultInjector::at(const PhasePoint& point) {
  if (!plan_.matches(point.window, point.phase, point.rank, point.worker)) return;
  plan_.fired = true;
  logger().warn("fault injection: {} at window {}, phase {}", fault_action_name(plan_.action),
                point.window, window_phase_name(point.phase));
  switch (plan_.action) {
    case FaultAction::kill:
      ::kill(::getpid(), SIGKILL);
      break;
    case FaultAction::stall:
      ::raise(SIGSTOP);
      break;
    case FaultAction::disconnect:
      point.transport.abort("fault injection: this worker disconnected");
      break;
    case FaultAction::enospc:
      throw IoError(
          fmt::format("fault injection: a checkpoint write failed: {}", std::strerror(ENOSPC)),
          {.rank = point.rank});
  }
}

std::unique_ptr<PhaseObserver> fault_injector_from_environment() {
  std::optional<FaultPlan> plan = fault_plan_from_environment();
  if (!plan) return nullptr;
  logger().warn("fault injection armed (PULSELOCO_FAULT): {} at window {}, phase {}",
                fault_action_name(plan->action), plan->window, window_phase_name(plan->phase));
  return std::make_unique<FaultInjector>(std::move(*plan));
}

}  // namespace pulseloco
