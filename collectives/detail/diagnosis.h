// The failure side of one collective call: the notice channel every call keeps open to every
// peer (posted at the start, watched by every wait, carrying the completion round's `done`),
// and the failure path that works out the culprit from this rank's observation and its peers'
// notices (verdict.h holds the rules), tells the other ranks, aborts the transport and throws.
// Internal to collectives/; docs/collectives.md ("Failure semantics") describes the protocol.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/collectives/detail/packets.h>
#include <pulseloco/collectives/detail/verdict.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::collectives::detail {

// Which call this is, on which transport, with which options.
struct CallContext {
  CallContext(transport::Transport& transport, const CollectiveOptions& options, Op op);

  transport::Transport& transport;
  CollectiveOptions options;
  Op op;
  int rank;
  int size;
  std::uint64_t sequence;
  std::chrono::milliseconds slice;  // how often a wait looks at the notices
  // The transport matches messages by order (Transport::matches_by_order): no notice may
  // travel out of turn, so the notice receives are posted in the completion round only and
  // the failure path sends none.
  bool ordered;

  [[nodiscard]] transport::Tag tag(Phase phase) const {
    return make_tag(options.tag, sequence, phase);
  }
  // The tag of the next call under the same base tag (every rank makes the same calls).
  [[nodiscard]] transport::Tag next_call_tag(Phase phase) const {
    return make_tag(options.tag, sequence + 1, phase);
  }
  // "allreduce_sum call #3 under tag 0"
  [[nodiscard]] std::string describe() const;
};

// The operations of one call. The call owns them until it ends; the buffers they use must
// outlive this pool (or the transport must have been aborted).
class Requests {
 public:
  transport::Request& own(std::unique_ptr<transport::Request> request) {
    all_.push_back(std::move(request));
    return *all_.back();
  }

 private:
  std::vector<std::unique_ptr<transport::Request>> all_;
};
// Sends not waited for yet, with their peers.
using PendingSends = std::vector<std::pair<transport::Request*, int>>;

// How a call fails, as the failure path tells the causes apart.
//
// A failure this rank observed itself while waiting on or posting to `peer` (-1: a native
// collective, which does not say on whom it waited).
struct ObservedFailure : std::exception {
  ObservedFailure(int p, ErrorKind k, bool timeout, std::string d)
      : peer(p), kind(k), timed_out(timeout), detail(std::move(d)) {}
  [[nodiscard]] const char* what() const noexcept override { return detail.c_str(); }
  int peer;
  ErrorKind kind;
  bool timed_out;  // no progress within the timeout: `peer` is a suspect, not proven guilty
  std::string detail;
};
// A notice from another rank (or a lost notice channel) says that the call has failed.
struct NoticeFailure : std::exception {
  [[nodiscard]] const char* what() const noexcept override {
    return "a peer reported that the collective failed";
  }
};
// This rank's left neighbour called with other arguments; every rank's header is needed to
// name the culprit (Diagnosis: the disagreement diagnosis).
struct LeftDisagreement : std::exception {
  [[nodiscard]] const char* what() const noexcept override {
    return "the left neighbour called with other arguments";
  }
};
// The ranks' headers disagree. Every rank that sees all headers names the same culprit: the
// first rank whose value differs from the majority's (find_minority).
struct Disagreement : std::exception {
  Disagreement(int culprit_rank, int majority_rank_, ErrorKind error_kind, std::string text)
      : culprit(culprit_rank),
        majority_rank(majority_rank_),
        kind(error_kind),
        detail(std::move(text)) {}
  [[nodiscard]] const char* what() const noexcept override { return detail.c_str(); }
  int culprit;
  int majority_rank;  // a rank that holds the majority's value
  ErrorKind kind;
  std::string detail;
};

// Inside a catch block for `error`, an operation with `peer` failed: rethrows a local abort
// unchanged, else throws what this rank observed about the peer (ObservedFailure).
[[noreturn]] void throw_observed(const Error& error, int peer);

// What the failure path needs from the call's header exchange and waits.
struct CallState {
  const Header::Bytes& header;         // this rank's header, as sent
  const std::vector<Header>& headers;  // every rank's header known so far, in rank order
  bool left_neighbour_only;            // headers went to the right neighbour alone
  int waiting_on;                      // the peer of the wait in progress, -1 if none
  // Every check of a full set of headers; throws a Disagreement.
  std::function<void(const std::vector<Header>&)> check_all_headers;
};

class Diagnosis {
 public:
  // `requests` owns every operation the diagnosis posts; it is used from post_receives() on.
  Diagnosis(const CallContext& call, Requests& requests);

  // The notice channel.
  //
  // Posts the receive of every peer's notice.
  void post_receives();
  // Collects the notices that arrived; throws NoticeFailure when one of them (or a lost notice
  // channel) says the call has failed.
  void poll() { collect(false); }
  // Sends this rank's notice (reporter: this rank, for this call) to every peer, best effort,
  // and adds the sends to `sent`. Each type goes out at most once per call.
  void send_notice(NoticeType type, ErrorKind kind, int subject, PendingSends& sent);
  // The pending receive of `peer`'s notice, or nullptr once its notice has come; throws
  // NoticeFailure when its notice channel failed.
  [[nodiscard]] transport::Request* awaited_notice(int peer) const;

  // The failure path: call it from a catch block with the exception the call threw. Works out
  // the culprit, tells the other ranks, aborts the transport and throws the error to report
  // (or rethrows a local error).
  [[noreturn]] void fail(std::exception_ptr error, const CallState& state);
  // The failure path of an order-matching transport: a notice sent now would be taken for
  // whatever message the peer expects next, so none is sent. The culprit is the peer this
  // rank observed (every rank has every header there, so a disagreement names the same culprit
  // everywhere); the peers find out by their own waits, within their timeout.
  [[noreturn]] void fail_without_notices(std::exception_ptr error, const CallState& state);
  // Aborts the transport once (the only way to withdraw operations still posted), blaming
  // `culprit` (-1: none) for a failure of `kind` (Transport::abort_blaming).
  void abort_transport(std::string_view reason, int culprit = -1,
                       ErrorKind kind = ErrorKind::peer_lost) noexcept;

 private:
  struct NoticeReceive {
    Notice::Bytes buffer{};
    transport::Request* request = nullptr;
    bool pending = false;  // `request` not complete yet
  };

  [[nodiscard]] Evidence evidence() const noexcept {
    return {.rank = call_.rank, .heard = heard_, .lost_order = lost_order_};
  }
  void post_receive(int peer);
  // Collects the notices that arrived. Unless `quiet`, throws NoticeFailure when one says the
  // call failed (the failure path polls quietly: it wants the evidence).
  void collect(bool quiet);
  void collect_once(bool quiet, bool& progressed);
  // Polls the notices until `done` holds, waiting on pending notice receives in between, for at
  // most min(timeout / 4, 250 ms); returns whether `done` held.
  [[nodiscard]] bool await_notices(const std::function<bool()>& done);
  // The ruling's verdict, after a brief wait for a better one if it is worth settling.
  [[nodiscard]] Verdict settle(Ruling ruling);
  // Follows the chain of suspects from `start`, waiting up to timeout / 2 for a silent
  // candidate's notice or the other ranks' reports.
  [[nodiscard]] Verdict resolve_chain(int start, int fallback);
  // Collects every rank's header under Phase::diagnosis and names the culprit as a full
  // exchange would (or adopts a verdict another rank sent first).
  [[nodiscard]] Verdict diagnose_disagreement(const CallState& state);
  // Sends this rank's header to every peer under Phase::diagnosis (once; best effort).
  void send_diagnosis_header(const CallState& state);
  // Waits at most the settle time for a peer's disagreement notice; says whether one came.
  [[nodiscard]] bool disagreement_announced_soon();
  // Sends `type` to every peer, waits a little for the notices to leave (not for `skip_peer`,
  // which may never take one) and aborts the transport. Once this rank has said `done`, a peer
  // may have finished the call and started the next one: the notice goes to that call too.
  void tell_and_abort(NoticeType type, ErrorKind kind, int subject, int skip_peer,
                      std::string_view reason);
  // Sends `bytes` under `tag` to every peer, best effort, and adds the sends to `sent`.
  void send_to_every_peer(transport::Tag tag, const Notice::Bytes& bytes, PendingSends& sent);

  const CallContext& call_;
  Requests& requests_;
  bool failing_ = false;
  bool aborted_ = false;
  bool diagnosis_header_sent_ = false;
  std::vector<NoticeReceive> receives_;  // by peer
  std::vector<Heard> heard_;             // by peer
  // This rank's outgoing notices, by type: each is sent at most once per call.
  std::array<Notice::Bytes, kNoticeTypes> outgoing_{};
  std::array<bool, kNoticeTypes> sent_{};
  Notice::Bytes next_call_notice_{};  // this rank's verdict, for the next call (tell_and_abort)
  std::vector<int> lost_order_;       // the transport's lost peers (refreshed while failing)
  PendingSends failure_sends_;
  Header::Bytes diagnosis_out_{};
  std::vector<Header::Bytes> diagnosis_in_;  // by peer, in the disagreement diagnosis only
};

}  // namespace pulseloco::collectives::detail
