#include <pulseloco/base/errors.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <cstdlib>

namespace pulseloco {

std::string_view error_kind_name(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::invalid_argument:
      return "invalid argument";
    case ErrorKind::io:
      return "I/O error";
    case ErrorKind::timeout:
      return "timeout";
    case ErrorKind::peer_lost:
      return "peer lost";
    case ErrorKind::aborted:
      return "aborted";
    case ErrorKind::protocol:
      return "protocol violation";
    case ErrorKind::divergence:
      return "replica divergence";
    case ErrorKind::non_finite:
      return "non-finite value";
    case ErrorKind::membership:
      return "membership";
  }
  return "error";
}

std::string format_error(ErrorKind kind, std::string_view message, const ErrorContext& context) {
  std::vector<std::string> parts;
  if (context.rank) parts.push_back(fmt::format("raised on rank {}", *context.rank));
  if (context.peer) parts.push_back(fmt::format("peer {}", *context.peer));
  if (!context.tensor.empty()) parts.push_back(fmt::format("tensor '{}'", context.tensor));
  if (context.index) parts.push_back(fmt::format("index {}", *context.index));
  if (context.byte_offset) parts.push_back(fmt::format("byte offset {}", *context.byte_offset));
  if (!context.ranks.empty()) {
    parts.push_back(fmt::format("{} involved: {}", context.ranks.size() == 1 ? "rank" : "ranks",
                                fmt::join(context.ranks, ", ")));
  }
  if (parts.empty()) return fmt::format("{}: {}", error_kind_name(kind), message);
  return fmt::format("{}: {} ({})", error_kind_name(kind), message, fmt::join(parts, "; "));
}

Error::Error(ErrorKind kind, std::string_view message, ErrorContext context)
    : std::runtime_error(format_error(kind, message, context)),
      kind_(kind),
      message_(message),
      context_(std::move(context)) {}

void invariant_failed(const char* condition, const char* file, int line, std::string_view detail) {
  std::fprintf(stderr, "pulseloco: internal invariant '%s' failed at %s:%d: %.*s\n", condition,
               file, line, static_cast<int>(detail.size()), detail.data());
  std::fflush(stderr);
  std::abort();
}

}  // namespace pulseloco
