#include <pulseloco/patch/send_pace.h>

#include <fmt/format.h>

#include <algorithm>

namespace pulseloco::patch {

SendPace::SendPace(const PaceLimits& limits, TimePoint start)
    : limits_(limits), last_progress_(start), window_start_(start) {}

std::uint64_t SendPace::window_minimum() const noexcept {
  if (limits_.min_bytes_per_second == 0) return 0;
  const auto window_ms = static_cast<std::uint64_t>(limits_.window.count());
  // At least one byte: a window too short to ask for any would make the rule vanish.
  return std::max<std::uint64_t>(1, (limits_.min_bytes_per_second * window_ms + 999) / 1000);
}

PaceVerdict SendPace::slow(std::uint64_t bytes) const {
  return {.rule = PaceVerdict::Rule::slow,
          .reason =
              fmt::format("it took {} bytes in {} ms ({} bytes/s), below the minimum of {} bytes/s",
                          bytes, limits_.window.count(),
                          bytes * 1000 / static_cast<std::uint64_t>(limits_.window.count()),
                          limits_.min_bytes_per_second)};
}

void SendPace::took(std::uint64_t bytes, TimePoint now) {
  const std::uint64_t minimum = window_minimum();
  // Close the windows that ended before this write completed.
  while (minimum > 0 && !short_window_ && now >= window_start_ + limits_.window) {
    if (window_bytes_ < minimum) {
      short_window_ = window_bytes_;
      break;
    }
    window_start_ += limits_.window;
    window_bytes_ = 0;
  }
  window_bytes_ += bytes;
  last_progress_ = std::max(last_progress_, now);
}

SendPace::TimePoint SendPace::deadline() const {
  const TimePoint idle = last_progress_ + limits_.idle_timeout;
  const std::uint64_t minimum = window_minimum();
  if (minimum == 0) return idle;
  if (short_window_) return window_start_ + limits_.window;
  // A window that has its bytes is followed by one that starts empty.
  const TimePoint window_end = window_start_ + limits_.window;
  return std::min(idle, window_bytes_ < minimum ? window_end : window_end + limits_.window);
}

std::optional<PaceVerdict> SendPace::verdict(TimePoint now) const {
  if (short_window_) return slow(*short_window_);
  if (now >= last_progress_ + limits_.idle_timeout)
    return PaceVerdict{
        .rule = PaceVerdict::Rule::idle,
        .reason = fmt::format("it took no bytes for {} ms", limits_.idle_timeout.count())};
  const std::uint64_t minimum = window_minimum();
  TimePoint start = window_start_;
  std::uint64_t bytes = window_bytes_;
  // Windows that ended by `now` with no write completing since: the first short one decides.
  while (minimum > 0 && now >= start + limits_.window) {
    if (bytes < minimum) return slow(bytes);
    start += limits_.window;
    bytes = 0;
  }
  return std::nullopt;
}

}  // namespace pulseloco::patch
