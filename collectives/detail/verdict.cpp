#include <pulseloco/collectives/detail/verdict.h>

#include <fmt/format.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace pulseloco::collectives::detail {

int weight(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::protocol:
    case ErrorKind::invalid_argument:
      return 3;
    case ErrorKind::timeout:
      return 2;
    case ErrorKind::peer_lost:
      return 1;
    default:
      return 0;
  }
}

Verdict verdict_from_notice(int peer, const Notice& notice) {
  if (notice.type == NoticeType::aborted) {
    return {.culprit = peer,
            .kind = ErrorKind::peer_lost,
            .reporter = peer,
            .detail = "it abandoned the call after an error of its own"};
  }
  return {.culprit = notice.subject, .kind = notice.kind, .reporter = peer, .detail = {}};
}

std::optional<Verdict> strongest_verdict(const Evidence& evidence) {
  std::optional<Verdict> best;
  for (int peer = 0; peer < evidence.size(); ++peer) {
    const Heard& heard = evidence.from(peer);
    if (!heard.latest || !heard.latest->terminal()) continue;
    Verdict candidate = verdict_from_notice(peer, *heard.latest);
    if (!best || weight(candidate.kind) > weight(best->kind)) best = std::move(candidate);
  }
  if (best) return best;
  // Where the transport lost `peer` (peers it never reported lost come after, by rank).
  const auto loss_position = [&](int peer) {
    const auto found = std::find(evidence.lost_order.begin(), evidence.lost_order.end(), peer);
    return static_cast<std::size_t>(found - evidence.lost_order.begin());
  };
  int chosen = -1;
  for (int peer = 0; peer < evidence.size(); ++peer) {
    const Heard& heard = evidence.from(peer);
    if (!heard.broken) continue;
    if (chosen < 0) {
      chosen = peer;
      continue;
    }
    const ErrorKind kind = *evidence.from(chosen).broken;
    if (weight(*heard.broken) > weight(kind) ||
        (weight(*heard.broken) == weight(kind) && loss_position(peer) < loss_position(chosen))) {
      chosen = peer;
    }
  }
  if (chosen < 0) return std::nullopt;
  const Heard& heard = evidence.from(chosen);
  return Verdict{.culprit = chosen,
                 .kind = *heard.broken,
                 .reporter = evidence.rank,
                 .detail = heard.broken_detail};
}

std::optional<Verdict> better_verdict(const Evidence& evidence, const Verdict& current) {
  auto best = strongest_verdict(evidence);
  if (best && weight(best->kind) > weight(current.kind)) return best;
  return std::nullopt;
}

Ruling first_hand_ruling(const Evidence& evidence, int peer, ErrorKind kind, std::string detail) {
  const Heard& heard = evidence.from(peer);
  if (heard.latest && heard.latest->terminal()) {
    return {.verdict = verdict_from_notice(peer, *heard.latest), .settle = true};
  }
  Verdict observed{
      .culprit = peer, .kind = kind, .reporter = evidence.rank, .detail = std::move(detail)};
  if (kind != ErrorKind::peer_lost) return {.verdict = std::move(observed), .settle = false};
  // The peer may have aborted after finding the real culprit (and its notice may have been
  // overtaken by the closing connection), or closed the connection after rejecting this rank's
  // data: prefer what the others found.
  if (auto best = strongest_verdict(evidence); best && best->culprit != peer) {
    return {.verdict = std::move(*best), .settle = true};
  }
  return {.verdict = std::move(observed), .settle = true};
}

ChainEnd follow_suspects(const Evidence& evidence, int start, int fallback,
                         std::chrono::milliseconds timeout) {
  const int rank = evidence.rank;
  const auto ruling = [](Verdict verdict, bool settle = false) {
    return ChainEnd{.end = ChainEnd::End::ruling,
                    .ruling = {.verdict = std::move(verdict), .settle = settle}};
  };
  // Follow "X timed out waiting on Y" from `start` to the first rank that is silent or known to
  // have failed. A rank that timed out without knowing on whom (a native collective) ends the
  // chain without an answer.
  std::vector<bool> visited(static_cast<std::size_t>(evidence.size()), false);
  int previous = rank;
  int current = start;
  while (current >= 0) {
    if (current == rank) {
      return ruling({.culprit = previous,
                     .kind = ErrorKind::timeout,
                     .reporter = rank,
                     .detail = fmt::format("peer {} timed out waiting for this rank", previous)});
    }
    const Heard& heard = evidence.from(current);
    if (heard.latest && heard.latest->terminal()) {
      return ruling(verdict_from_notice(current, *heard.latest));
    }
    if (heard.broken) {
      return ruling({.culprit = current,
                     .kind = *heard.broken,
                     .reporter = rank,
                     .detail = heard.broken_detail},
                    true);
    }
    if (!heard.said(NoticeType::suspect)) break;
    if (visited[static_cast<std::size_t>(current)]) {
      return ruling({.culprit = fallback,
                     .kind = ErrorKind::timeout,
                     .reporter = rank,
                     .detail = "the ranks time out waiting on one another in a cycle (a lost "
                               "message, or a timeout shorter than one chunk's transfer)"});
    }
    visited[static_cast<std::size_t>(current)] = true;
    previous = current;
    current = heard.latest->subject == current ? -1 : heard.latest->subject;
  }
  Verdict stalled{.culprit = -1,
                  .kind = ErrorKind::timeout,
                  .reporter = rank,
                  .detail = fmt::format("no progress for {} ms", timeout.count())};
  // The candidate: the rank the chain ended at, or (without a chain) the first rank that has
  // said nothing about the failure.
  int candidate = current;
  for (int peer = 0; peer < evidence.size() && candidate < 0; ++peer) {
    if (peer != rank && !evidence.from(peer).reported_failure()) candidate = peer;
  }
  if (candidate < 0) {
    stalled.detail += " on every rank (no single peer is at fault)";
    return {.end = ChainEnd::End::nobody, .ruling = {.verdict = std::move(stalled)}};
  }
  bool others_reported = true;
  for (int peer = 0; peer < evidence.size(); ++peer) {
    if (peer != rank && peer != candidate && !evidence.from(peer).reported_failure()) {
      others_reported = false;
    }
  }
  stalled.culprit = candidate;
  return {.end = ChainEnd::End::candidate,
          .ruling = {.verdict = std::move(stalled)},
          .others_reported = others_reported};
}

std::optional<Minority> find_minority(std::span<const std::string> keys) {
  std::size_t majority = 0;
  std::size_t majority_count = 0;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const auto count = static_cast<std::size_t>(std::count(keys.begin(), keys.end(), keys[i]));
    if (count > majority_count) {
      majority = i;
      majority_count = count;
    }
  }
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] != keys[majority]) {
      return Minority{.culprit = static_cast<int>(i),
                      .majority_rank = static_cast<int>(majority),
                      .majority_count = majority_count};
    }
  }
  return std::nullopt;
}

namespace {

// The peer that timed out waiting for this rank first, in rank order, if any.
[[nodiscard]] int first_to_time_out_on(const Evidence& evidence) {
  for (int peer = 0; peer < evidence.size(); ++peer) {
    if (evidence.from(peer).timed_out_on_me) return peer;
  }
  return -1;
}

[[noreturn]] void throw_kind(ErrorKind kind, const std::string& message, ErrorContext context) {
  switch (kind) {
    case ErrorKind::timeout:
      throw TimeoutError(message, std::move(context));
    case ErrorKind::protocol:
      throw ProtocolError(message, std::move(context));
    case ErrorKind::invalid_argument:
      throw InvalidArgument(message, std::move(context));
    case ErrorKind::io:
      throw IoError(message, std::move(context));
    default:
      throw PeerLostError(message, std::move(context));
  }
}

// Accused of a timeout while waiting for a peer itself: the others waited for this rank, which
// waited for that peer, whose messages did not arrive.
[[nodiscard]] bool accused_while_waiting(const Evidence& evidence, const Verdict& verdict,
                                         int waiting_on) {
  return verdict.kind == ErrorKind::timeout && waiting_on >= 0 && waiting_on != evidence.rank;
}

}  // namespace

int named_peer(const Evidence& evidence, const Verdict& verdict, int waiting_on) {
  if (verdict.culprit != evidence.rank) return verdict.culprit;
  if (verdict.reporter == evidence.rank) return verdict.majority;
  if (accused_while_waiting(evidence, verdict, waiting_on)) return waiting_on;
  const int timed_out = first_to_time_out_on(evidence);
  return timed_out >= 0 ? timed_out : verdict.reporter;
}

std::string_view describe_failure(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::peer_lost:
      return "was lost (its connection closed or its process died)";
    case ErrorKind::timeout:
      return "stopped responding";
    case ErrorKind::protocol:
      return "sent invalid data";
    case ErrorKind::invalid_argument:
      return "disagrees with this rank on the call's arguments";
    default:
      return error_kind_name(kind);
  }
}

void throw_verdict(const Evidence& evidence, const Verdict& verdict, int waiting_on,
                   std::string_view call) {
  const int rank = evidence.rank;
  if (verdict.culprit < 0) {
    throw_kind(verdict.kind, fmt::format("{} failed: {}", call, verdict.detail), {.rank = rank});
  }
  const int peer = named_peer(evidence, verdict, waiting_on);
  if (verdict.culprit == rank && verdict.reporter == rank) {
    throw_kind(
        verdict.kind,
        fmt::format("{} failed: this rank disagrees with the others: {}", call, verdict.detail),
        {.rank = rank, .peer = peer});
  }
  if (verdict.culprit == rank) {
    std::string message = fmt::format("{} failed: peer {} reports that this rank failed ({})", call,
                                      verdict.reporter, error_kind_name(verdict.kind));
    if (accused_while_waiting(evidence, verdict, waiting_on)) {
      message += fmt::format("; this rank was waiting for peer {}", peer);
    } else if (peer != verdict.reporter) {
      message += fmt::format("; peer {} timed out waiting for this rank", peer);
    }
    throw_kind(verdict.kind, message, {.rank = rank, .peer = peer});
  }
  std::string message =
      fmt::format("{} failed: peer {} {}", call, verdict.culprit, describe_failure(verdict.kind));
  if (verdict.reporter != rank) message += fmt::format(" (reported by peer {})", verdict.reporter);
  if (!verdict.detail.empty()) message += fmt::format(": {}", verdict.detail);
  throw_kind(verdict.kind, message, {.rank = rank, .peer = peer});
}

}  // namespace pulseloco::collectives::detail
