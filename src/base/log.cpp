#include <pulseloco/base/log.h>

#include <spdlog/sinks/stdout_color_sinks.h>

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

std::optional<int> log_rank() {
  RankTag& tag = rank_tag();
  const std::lock_guard lock(tag.mutex);
  return tag.rank;
}

}  // namespace pulseloco
