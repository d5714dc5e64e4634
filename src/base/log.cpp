#include <pulseloco/base/boolean_text.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/log_lines.h>

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

namespace pulseloco {
namespace {

constexpr const char* kDefaultPattern = "[%Y-%m-%d %H:%M:%S.%e] [pulseloco] [%^%l%$] %v";

std::shared_ptr<spdlog::logger> make_logger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto created = std::make_shared<spdlog::logger>("pulseloco", sink);
  created->set_pattern(kDefaultPattern);
  created->set_level(spdlog::level::info);
  if (const char* env = std::getenv("PULSELOCO_LOG_LEVEL"); env != nullptr && *env != '\0') {
    if (auto level = parse_log_level(env)) {
      created->set_level(*level);
    } else {
      created->warn(
          "PULSELOCO_LOG_LEVEL='{}' is not a level (trace, debug, info, warn, error, "
          "critical, off); using info",
          env);
    }
  }
  created->flush_on(spdlog::level::warn);
  return created;
}

}  // namespace

std::optional<spdlog::level::level_enum> parse_log_level(std::string_view name) {
  for (int level = spdlog::level::trace; level <= spdlog::level::off; ++level) {
    const auto as_enum = static_cast<spdlog::level::level_enum>(level);
    if (spdlog::level::to_string_view(as_enum) == name) return as_enum;
  }
  if (name == "warn") return spdlog::level::warn;  // spdlog names it "warning"
  if (name == "err") return spdlog::level::err;    // and "error"
  return std::nullopt;
}

spdlog::logger& logger() {
  static const std::shared_ptr<spdlog::logger> instance = make_logger();
  return *instance;
}

namespace {

struct RankTag {
  std::mutex mutex;
  std::optional<int> rank;
  bool chosen_by_program = false;
};

RankTag& rank_tag() {
  static RankTag tag;
  return tag;
}

// Under the tag's mutex.
void apply_rank_tag(RankTag& tag, int rank) {
  tag.rank = rank;
  logger().set_pattern(
      fmt::format("[%Y-%m-%d %H:%M:%S.%e] [pulseloco] [rank {}] [%^%l%$] %v", rank));
}

}  // namespace

void set_log_rank(int rank) {
  RankTag& tag = rank_tag();
  const std::lock_guard lock(tag.mutex);
  tag.chosen_by_program = true;
  apply_rank_tag(tag, rank);
}

void tag_log_with_group_rank(int rank) {
  RankTag& tag = rank_tag();
  const std::lock_guard lock(tag.mutex);
  if (tag.chosen_by_program || tag.rank == rank) return;
  apply_rank_tag(tag, rank);
}

spdlog::level::level_enum shared_line_level(int rank) {
  static const bool all_ranks = [] {
    const char* env = std::getenv("PULSELOCO_LOG_ALL_RANKS");
    if (env == nullptr || *env == '\0') return false;
    const std::optional<bool> value = parse_boolean_text(env);
    // A logging variable never stops a run: a bad value is named in a warning.
    if (!value) {
      logger().warn(
          "PULSELOCO_LOG_ALL_RANKS='{}' is not a boolean (1/0, true/false, yes/no, on/off); "
          "using 0",
          env);
    }
    return value.value_or(false);
  }();
  return rank == 0 || all_ranks ? spdlog::level::info : spdlog::level::debug;
}

std::chrono::milliseconds wait_progress_interval() {
  constexpr std::chrono::milliseconds kDefault{10'000};
  const char* env = std::getenv("PULSELOCO_WAIT_LOG_SECONDS");
  if (env == nullptr || *env == '\0') return kDefault;
  char* end = nullptr;
  const double seconds = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(seconds >= 0) || seconds > 86'400) {
    static std::once_flag warned;
    std::call_once(warned, [env] {
      logger().warn(
          "PULSELOCO_WAIT_LOG_SECONDS='{}' is not a number of seconds from 0 to 86400; using 10",
          env);
    });
    return kDefault;
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0));
}

WaitProgress::WaitProgress() : WaitProgress(wait_progress_interval()) {}

WaitProgress::WaitProgress(std::chrono::milliseconds interval)
    : start_(std::chrono::steady_clock::now()), next_(start_ + interval), interval_(interval) {}

bool WaitProgress::due() {
  if (interval_.count() <= 0) return false;
  const auto now = std::chrono::steady_clock::now();
  if (now < next_) return false;
  next_ = now + interval_;
  return true;
}

double WaitProgress::seconds() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

std::optional<int> log_rank() {
  RankTag& tag = rank_tag();
  const std::lock_guard lock(tag.mutex);
  return tag.rank;
}

}  // namespace pulseloco
