#include <pulseloco/collectives/detail/diagnosis.h>

#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include <pulseloco/base/log.h>

namespace pulseloco::collectives::detail {

using transport::Clock;
using transport::Request;

CallContext::CallContext(transport::Transport& transport_, const CollectiveOptions& options_,
                         Op op_)
    : transport(transport_),
      options(options_),
      op(op_),
      rank(transport_.rank()),
      size(transport_.size()),
      sequence(transport_.next_sequence(options_.tag)),
      slice(std::clamp(options_.timeout / 16, std::chrono::milliseconds{1},
                       std::chrono::milliseconds{25})),
      ordered(transport_.matches_by_order()) {}

std::string CallContext::describe() const {
  return fmt::format("{} call #{} under tag {}", op_name(op), sequence, options.tag);
}

void throw_observed(const Error& error, int peer) {
  if (error.kind() == ErrorKind::aborted) throw;
  const int culprit = error.context().peer.value_or(peer);
  throw ObservedFailure(culprit, error.kind(), error.kind() == ErrorKind::timeout, error.message());
}

namespace {

// Why a call failed, sorted from the exception it threw.
struct Cause {
  std::optional<ObservedFailure> observed;
  std::optional<Verdict> disagreement;  // found by this rank in a full set of headers
  bool left_disagrees = false;
  bool local_abort = false;  // this rank's transport was aborted (by the caller, say)
  bool local = false;        // an error of this rank's own (a throwing callback, say)
};

[[nodiscard]] Cause cause_of(const std::exception_ptr& error, int rank, int size) {
  Cause cause;
  try {
    std::rethrow_exception(error);
  } catch (const ObservedFailure& failure) {
    cause.observed = failure;
  } catch (const NoticeFailure&) {
    // The notices tell.
  } catch (const LeftDisagreement&) {
    cause.left_disagrees = true;
  } catch (const Disagreement& d) {
    cause.disagreement = Verdict{.culprit = d.culprit,
                                 .kind = d.kind,
                                 .reporter = rank,
                                 .detail = d.detail,
                                 .majority = d.majority_rank};
  } catch (const Error& e) {
    const auto peer = e.context().peer;
    if (e.kind() == ErrorKind::aborted) {
      cause.local_abort = true;
    } else if (peer && *peer >= 0 && *peer < size && *peer != rank) {
      cause.observed.emplace(*peer, e.kind(), false, e.message());
    } else {
      cause.local = true;
    }
  } catch (...) {
    cause.local = true;
  }
  return cause;
}

}  // namespace

Diagnosis::Diagnosis(const CallContext& call, Requests& requests)
    : call_(call),
      requests_(requests),
      receives_(static_cast<std::size_t>(call.size)),
      heard_(static_cast<std::size_t>(call.size)) {}

void Diagnosis::post_receives() {
  for (int peer = 0; peer < call_.size; ++peer) {
    if (peer != call_.rank) post_receive(peer);
  }
}

void Diagnosis::post_receive(int peer) {
  NoticeReceive& receive = receives_[static_cast<std::size_t>(peer)];
  receive.request =
      &requests_.own(call_.transport.irecv(peer, call_.tag(Phase::notice), receive.buffer));
  receive.pending = true;
}

void Diagnosis::collect(bool quiet) {
  // The failure path weighs lost peers by the order the transport lost them in.
  if (failing_) lost_order_ = call_.transport.lost_peers();
  // In the failure path every consumed notice may already have a follow-up waiting: repeat
  // until nothing more arrives.
  bool progressed = true;
  while (progressed) {
    progressed = false;
    collect_once(quiet, progressed);
  }
}

void Diagnosis::collect_once(bool quiet, bool& progressed) {
  for (int peer = 0; peer < call_.size; ++peer) {
    NoticeReceive& receive = receives_[static_cast<std::size_t>(peer)];
    if (!receive.pending) continue;
    Heard& heard = heard_[static_cast<std::size_t>(peer)];
    bool complete = false;
    try {
      complete = receive.request->test();
    } catch (const Error& error) {
      receive.pending = false;
      if (error.kind() == ErrorKind::aborted) {
        if (quiet) continue;
        throw;
      }
      heard.broken = error.kind();
      heard.broken_detail = error.message();
      if (!quiet) throw NoticeFailure();
      continue;
    }
    if (!complete) continue;
    receive.pending = false;
    progressed = failing_;
    try {
      heard.latest = Notice::decode(receive.buffer, call_.rank, peer, call_.size, call_.sequence);
    } catch (const ProtocolError& error) {
      heard.broken = ErrorKind::protocol;
      heard.broken_detail = error.message();
      if (!quiet) throw NoticeFailure();
      continue;
    }
    if (heard.said(NoticeType::suspect) && heard.latest->subject == call_.rank) {
      heard.timed_out_on_me = true;
    }
    if (failing_ && !heard.latest->terminal()) {
      try {
        post_receive(peer);  // a follow-up notice may still come
      } catch (...) {
        // The transport is going down; what arrived so far has to do.
      }
    }
    if (!quiet && !heard.said(NoticeType::done)) throw NoticeFailure();
  }
}

void Diagnosis::send_notice(NoticeType type, ErrorKind kind, int subject, PendingSends& sent) {
  const auto index = static_cast<std::size_t>(type) - 1;
  PULSELOCO_CHECK(!sent_[index], "a call sends each type of notice once");
  sent_[index] = true;
  Notice::Bytes& bytes = outgoing_[index];
  bytes = Notice{.type = type,
                 .kind = kind,
                 .reporter = call_.rank,
                 .subject = subject,
                 .sequence = call_.sequence}
              .encode();
  send_to_every_peer(call_.tag(Phase::notice), bytes, sent);
}

void Diagnosis::send_to_every_peer(transport::Tag tag, const Notice::Bytes& bytes,
                                   PendingSends& sent) {
  for (int peer = 0; peer < call_.size; ++peer) {
    if (peer == call_.rank) continue;
    try {
      sent.emplace_back(&requests_.own(call_.transport.isend(peer, tag, bytes)), peer);
    } catch (...) {
      // Best effort: a peer we cannot reach learns of the failure from its own waits.
    }
  }
}

Request* Diagnosis::awaited_notice(int peer) const {
  const auto index = static_cast<std::size_t>(peer);
  if (heard_[index].latest) return nullptr;
  if (!receives_[index].pending) throw NoticeFailure();
  return receives_[index].request;
}

void Diagnosis::abort_transport(std::string_view reason, int culprit, ErrorKind kind) noexcept {
  if (aborted_) return;
  aborted_ = true;
  call_.transport.abort_blaming(culprit, kind, reason);
}

bool Diagnosis::await_notices(const std::function<bool()>& done) {
  // Bounded, so that survivors stay within 2x the timeout.
  const auto end = Clock::now() + std::min<std::chrono::milliseconds>(
                                      call_.options.timeout / 4, std::chrono::milliseconds{250});
  for (;;) {
    collect(true);
    if (done()) return true;
    const auto now = Clock::now();
    if (now >= end) return false;
    const auto pending = std::find_if(receives_.begin(), receives_.end(),
                                      [](const NoticeReceive& r) { return r.pending; });
    if (pending == receives_.end()) return false;
    try {
      pending->request->wait(std::min(end, now + call_.slice));
    } catch (...) {
      // Sorted out by the next poll.
    }
  }
}

Verdict Diagnosis::settle(Ruling ruling) {
  if (!ruling.settle || !worth_settling(ruling.verdict)) return std::move(ruling.verdict);
  // Give a better explanation a moment to arrive.
  std::optional<Verdict> better;
  (void)await_notices([&] {
    better = better_verdict(evidence(), ruling.verdict);
    return better.has_value();
  });
  return better ? std::move(*better) : std::move(ruling.verdict);
}

Verdict Diagnosis::resolve_chain(int start, int fallback) {
  const auto grace_end = Clock::now() + call_.options.timeout / 2;
  for (;;) {
    collect(true);
    ChainEnd chain = follow_suspects(evidence(), start, fallback, call_.options.timeout);
    if (chain.end != ChainEnd::End::candidate) return settle(std::move(chain.ruling));
    // The candidate is the culprit once every other rank has reported, or when the grace
    // period ends.
    Verdict& verdict = chain.ruling.verdict;
    if (chain.others_reported || Clock::now() >= grace_end) return std::move(verdict);
    // Wait a little for a notice: the candidate's own if it can still speak, else any.
    Request* next = nullptr;
    if (const NoticeReceive& own = receives_[static_cast<std::size_t>(verdict.culprit)];
        own.pending) {
      next = own.request;
    } else {
      const auto pending = std::find_if(receives_.begin(), receives_.end(),
                                        [](const NoticeReceive& r) { return r.pending; });
      if (pending != receives_.end()) next = pending->request;
    }
    if (next == nullptr) return std::move(verdict);
    try {
      next->wait(std::min(grace_end, Clock::now() + call_.slice));
    } catch (...) {
      // Timeouts and failures alike: the next poll sorts them out.
    }
  }
}

void Diagnosis::send_diagnosis_header(const CallState& state) {
  if (diagnosis_header_sent_ || call_.size == 1) return;
  diagnosis_header_sent_ = true;
  diagnosis_out_ = state.header;
  for (int peer = 0; peer < call_.size; ++peer) {
    if (peer == call_.rank) continue;
    try {
      failure_sends_.emplace_back(
          &requests_.own(call_.transport.isend(peer, call_.tag(Phase::diagnosis), diagnosis_out_)),
          peer);
    } catch (...) {
      // Best effort: a peer that cannot be reached is found out by the others' waits.
    }
  }
}

Verdict Diagnosis::diagnose_disagreement(const CallState& state) {
  const int rank = call_.rank;
  const auto lost = [&](int peer, const Error& error) {
    return settle({.verdict = {.culprit = peer,
                               .kind = error.kind(),
                               .reporter = rank,
                               .detail = error.message()},
                   .settle = true});
  };
  // Ranks that are waiting elsewhere in the call learn of it from this notice and diagnose too.
  send_notice(NoticeType::disagreement, ErrorKind::invalid_argument, rank, failure_sends_);
  send_diagnosis_header(state);
  diagnosis_in_.resize(static_cast<std::size_t>(call_.size));
  std::vector<Request*> receives(static_cast<std::size_t>(call_.size), nullptr);
  for (int peer = 0; peer < call_.size; ++peer) {
    if (peer == rank) continue;
    try {
      receives[static_cast<std::size_t>(peer)] = &requests_.own(call_.transport.irecv(
          peer, call_.tag(Phase::diagnosis), diagnosis_in_[static_cast<std::size_t>(peer)]));
    } catch (const Error& error) {
      return lost(peer, error);
    }
  }
  std::vector<Header> all = state.headers;
  const auto deadline = Clock::now() + call_.options.timeout;
  for (;;) {
    // A rank that already knows the verdict (from a full exchange, or a finished diagnosis)
    // says so in a culprit notice; every rank computes the same one from the same headers.
    collect(true);
    if (auto known = strongest_verdict(evidence()); known && !worth_settling(*known)) return *known;
    int missing = -1;
    for (int peer = 0; peer < call_.size; ++peer) {
      Request* receive = receives[static_cast<std::size_t>(peer)];
      if (receive == nullptr) continue;
      bool complete = false;
      try {
        complete = receive->test();
      } catch (const Error& error) {
        return lost(peer, error);
      }
      if (complete) {
        try {
          all[static_cast<std::size_t>(peer)] =
              Header::decode(diagnosis_in_[static_cast<std::size_t>(peer)], rank, peer);
        } catch (const ProtocolError& error) {
          return {
              .culprit = peer, .kind = error.kind(), .reporter = rank, .detail = error.message()};
        }
        receives[static_cast<std::size_t>(peer)] = nullptr;
      } else if (missing < 0) {
        missing = peer;
      }
    }
    if (missing < 0) break;
    if (Clock::now() >= deadline) {
      return {.culprit = missing,
              .kind = ErrorKind::timeout,
              .reporter = rank,
              .detail = fmt::format("its header did not arrive within {} ms of a disagreement",
                                    call_.options.timeout.count())};
    }
    try {
      receives[static_cast<std::size_t>(missing)]->wait(
          std::min(deadline, Clock::now() + call_.slice));
    } catch (...) {
      // Sorted out by the next test.
    }
  }
  try {
    state.check_all_headers(all);
  } catch (const Disagreement& d) {
    return {.culprit = d.culprit,
            .kind = d.kind,
            .reporter = rank,
            .detail = d.detail,
            .majority = d.majority_rank};
  }
  // Unreachable when every header arrived unchanged: two neighbours disagreed.
  return {.culprit = (rank - 1 + call_.size) % call_.size,
          .kind = ErrorKind::protocol,
          .reporter = rank,
          .detail = "its header disagreed with this rank's, but every rank's header agrees"};
}

bool Diagnosis::disagreement_announced_soon() {
  // The rank that saw the odd header sends its notice within about one hop of its arrival.
  return await_notices([this] {
    return std::any_of(heard_.begin(), heard_.end(),
                       [](const Heard& heard) { return heard.said(NoticeType::disagreement); });
  });
}

void Diagnosis::tell_and_abort(NoticeType type, ErrorKind kind, int subject, int skip_peer,
                               std::string_view reason) {
  send_notice(type, kind, subject, failure_sends_);
  if (sent_[static_cast<std::size_t>(NoticeType::done) - 1]) {
    // A peer that has every `done` finished this call and may be waiting in the next one, where
    // it would see this rank leave with nothing to explain why.
    next_call_notice_ = Notice{.type = type,
                               .kind = kind,
                               .reporter = call_.rank,
                               .subject = subject,
                               .sequence = call_.sequence + 1}
                            .encode();
    send_to_every_peer(call_.next_call_tag(Phase::notice), next_call_notice_, failure_sends_);
  }
  const auto deadline = Clock::now() + std::min<std::chrono::milliseconds>(
                                           call_.options.timeout / 4, std::chrono::seconds{2});
  for (const auto& [request, peer] : failure_sends_) {
    if (peer == skip_peer) continue;  // a stalled culprit may never take it
    try {
      request->wait(deadline);
    } catch (...) {
      // A peer that cannot take the notice learns of the failure from its own waits.
    }
  }
  // A culprit notice blames its subject; an aborted notice, this rank itself.
  abort_transport(reason, subject, kind);
}

void Diagnosis::fail_without_notices(std::exception_ptr error, const CallState& state) {
  failing_ = true;
  const int rank = call_.rank;
  Cause cause = cause_of(error, rank, call_.size);
  if (cause.local_abort) {
    aborted_ = true;
    std::rethrow_exception(error);
  }
  Verdict verdict;
  if (cause.disagreement) {
    verdict = std::move(*cause.disagreement);
  } else if (cause.observed) {
    verdict = {.culprit = cause.observed->peer,
               .kind = cause.observed->kind,
               .reporter = rank,
               .detail = cause.observed->detail};
    if (cause.observed->timed_out) {
      verdict.detail +=
          "; the transport completes operations in groups, so the silent rank may be another "
          "peer of the same group";
    }
  } else if (const auto broken = std::find_if(heard_.begin(), heard_.end(),
                                              [](const Heard& h) { return h.broken.has_value(); });
             broken != heard_.end()) {
    // A completion notice that failed or arrived garbled (posted in the completion round only).
    verdict = {.culprit = static_cast<int>(broken - heard_.begin()),
               .kind = *broken->broken,
               .reporter = rank,
               .detail = broken->broken_detail};
  } else {
    // A local error (a throwing callback, say).
    abort_transport(fmt::format("{} abandoned after a local error", call_.describe()));
    std::rethrow_exception(error);
  }
  abort_transport(fmt::format("{} failed: {}", call_.describe(), verdict.detail));
  throw_verdict(evidence(), verdict, state.waiting_on, call_.describe());
}

void Diagnosis::fail(std::exception_ptr error, const CallState& state) {
  if (call_.ordered) fail_without_notices(std::move(error), state);
  failing_ = true;
  const int rank = call_.rank;
  Cause cause = cause_of(error, rank, call_.size);
  if (cause.local_abort) {
    aborted_ = true;  // someone else aborted the transport: nothing can be sent any more
    std::rethrow_exception(error);
  }
  if (cause.local) {
    // Tells every peer (the culprit too: it may be alive and merely disagree).
    tell_and_abort(NoticeType::aborted, ErrorKind::peer_lost, rank, -1,
                   fmt::format("{} call #{} abandoned after a local error", op_name(call_.op),
                               call_.sequence));
    std::rethrow_exception(error);
  }

  // Notices that arrived complete so far may be followed by others now.
  for (int peer = 0; peer < call_.size; ++peer) {
    const Heard& heard = heard_[static_cast<std::size_t>(peer)];
    if (peer != rank && !receives_[static_cast<std::size_t>(peer)].pending && !heard.broken &&
        heard.latest && !heard.latest->terminal()) {
      try {
        post_receive(peer);
      } catch (...) {
        // The transport is going down.
      }
    }
  }

  // A rank diagnosing a disagreement between neighbours needs every rank's header, this
  // rank's too, whatever this rank's own reason to fail.
  collect(true);
  const bool disagreement_reported = std::any_of(heard_.begin(), heard_.end(), [](const Heard& h) {
    return h.said(NoticeType::disagreement);
  });
  if (cause.disagreement || cause.left_disagrees || disagreement_reported) {
    send_diagnosis_header(state);
  }

  const std::optional<ObservedFailure>& observed = cause.observed;
  Verdict verdict;
  if (cause.disagreement) {
    verdict = std::move(*cause.disagreement);
  } else if (cause.left_disagrees || disagreement_reported) {
    // The disagreement explains whatever else this rank ran into (a message of the wrong size,
    // a neighbour that stopped sending).
    verdict = diagnose_disagreement(state);
  } else if (observed && observed->peer < 0) {
    // A native collective failed without saying on whom it waited: "suspect: unknown" (the
    // subject is the reporter itself), then find the rank that says nothing.
    send_notice(NoticeType::suspect, ErrorKind::timeout, rank, failure_sends_);
    verdict = resolve_chain(-1, -1);
  } else if (observed && !observed->timed_out && observed->kind == ErrorKind::protocol &&
             state.left_neighbour_only && observed->peer != (rank - 1 + call_.size) % call_.size &&
             disagreement_announced_soon()) {
    // A message of the wrong size from a peer whose header this rank never saw: that peer
    // called with another length, and the rank to its right, which checks its header, says so.
    verdict = diagnose_disagreement(state);
  } else if (observed && !observed->timed_out) {
    collect(true);
    verdict =
        settle(first_hand_ruling(evidence(), observed->peer, observed->kind, observed->detail));
  } else if (observed) {
    send_notice(NoticeType::suspect, ErrorKind::timeout, observed->peer, failure_sends_);
    verdict = resolve_chain(observed->peer, observed->peer);
  } else {
    // A peer's notice (or a lost notice channel) ended the call here.
    collect(true);
    if (auto known = strongest_verdict(evidence())) {
      verdict = settle({.verdict = std::move(*known), .settle = true});
    } else {
      int start = -1;
      for (int peer = 0; peer < call_.size && start < 0; ++peer) {
        if (heard_[static_cast<std::size_t>(peer)].reported_failure()) start = peer;
      }
      PULSELOCO_CHECK(start >= 0, "a notice failure without any failure notice");
      verdict = resolve_chain(start, state.waiting_on >= 0 ? state.waiting_on : start);
    }
  }

  logger().debug("{} call #{}: rank {} blames peer {} ({}), reported by {}", op_name(call_.op),
                 call_.sequence, rank, verdict.culprit, error_kind_name(verdict.kind),
                 verdict.reporter);
  if (verdict.culprit < 0) {
    // Nobody to blame: every rank reports the same stall itself.
    abort_transport(
        fmt::format("{} call #{} failed: {}", op_name(call_.op), call_.sequence, verdict.detail));
  } else {
    tell_and_abort(NoticeType::culprit, verdict.kind, verdict.culprit, verdict.culprit,
                   fmt::format("{} call #{} failed: peer {} {}", op_name(call_.op), call_.sequence,
                               verdict.culprit, describe_failure(verdict.kind)));
  }
  throw_verdict(evidence(), verdict, state.waiting_on, call_.describe());
}

}  // namespace pulseloco::collectives::detail
