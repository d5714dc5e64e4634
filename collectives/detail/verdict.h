// The rules by which a rank names the culprit of a failed collective call, as pure functions
// over what it knows: the notices its peers sent (diagnosis.h receives them), the notice
// channels it lost, and what it observed itself. Nothing here waits or sends; where a rule
// says that more evidence is worth waiting for, diagnosis.h waits and asks again.
// docs/collectives.md ("Failure semantics") states the rules in words.
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/detail/packets.h>

namespace pulseloco::collectives::detail {

// Who failed, in what way, and on whose word.
struct Verdict {
  int culprit = -1;  // -1: no rank in particular (every rank stalled)
  ErrorKind kind = ErrorKind::peer_lost;
  int reporter = -1;  // the rank whose evidence it is
  std::string detail;
  int majority = -1;  // when this rank is the odd one out of a disagreement: a majority rank
};

// What a rank has heard from one peer during a call.
struct Heard {
  std::optional<Notice> latest;     // the last notice received
  bool timed_out_on_me = false;     // it sent "suspect: this rank"
  std::optional<ErrorKind> broken;  // its notice channel failed (peer lost, garbage)
  std::string broken_detail;

  // It sent a failure notice (anything but `done`), or its channel failed.
  [[nodiscard]] bool reported_failure() const noexcept {
    return broken || (latest && latest->type != NoticeType::done);
  }
  [[nodiscard]] bool said(NoticeType type) const noexcept { return latest && latest->type == type; }
};

// What one rank knows: its own rank; indexed by rank, what it heard from every peer (its own
// entry stays empty); and the peers its transport lost, in the order it lost them
// (Transport::lost_peers).
struct Evidence {
  int rank = 0;
  std::span<const Heard> heard;
  std::span<const int> lost_order;

  [[nodiscard]] int size() const noexcept { return static_cast<int>(heard.size()); }
  [[nodiscard]] const Heard& from(int peer) const { return heard[static_cast<std::size_t>(peer)]; }
};

// How strongly a kind of failure incriminates the peer it names. A lost peer is often only a
// consequence (it aborted after finding the real culprit, or closed its connections after
// rejecting this rank's data); garbage and disagreement are first-hand evidence.
// protocol, invalid_argument: 3; timeout: 2; peer_lost: 1; anything else: 0.
[[nodiscard]] int weight(ErrorKind kind) noexcept;

// A verdict as good as a lost peer or worse is worth a brief wait for a better explanation
// (Diagnosis::settle).
[[nodiscard]] inline bool worth_settling(const Verdict& verdict) noexcept {
  return weight(verdict.kind) <= weight(ErrorKind::peer_lost);
}

// What `peer`'s terminal notice says: its culprit, or itself for an aborted notice.
[[nodiscard]] Verdict verdict_from_notice(int peer, const Notice& notice);

// The best explanation the notices offer: the most incriminating culprit or aborted notice (the
// lowest rank's among equals), else a failed notice channel: the most incriminating, and among
// equals the peer the transport lost first (a survivor that failed because of that loss closes
// its own connections soon after), else the lowest rank's. nullopt when no peer has said
// anything of the kind.
[[nodiscard]] std::optional<Verdict> strongest_verdict(const Evidence& evidence);

// The strongest verdict if it incriminates more than `current` does.
[[nodiscard]] std::optional<Verdict> better_verdict(const Evidence& evidence,
                                                    const Verdict& current);

// A verdict, and whether it is worth settling (waiting briefly for a better one).
struct Ruling {
  Verdict verdict;
  bool settle = false;
};

// This rank saw `peer` fail first-hand with `kind` (anything but a timeout): `peer`'s own
// terminal notice explains it, if one came; else first-hand garbage or disagreement stands;
// else (a lost peer) what the others found about another rank or another rank lost before it,
// else the loss.
[[nodiscard]] Ruling first_hand_ruling(const Evidence& evidence, int peer, ErrorKind kind,
                                       std::string detail);

// Where the chain of suspects "X timed out waiting on Y" leads from `start` (-1: from no rank).
struct ChainEnd {
  enum class End : std::uint8_t {
    ruling,     // a rank on the chain failed on record: `ruling`
    candidate,  // the chain ends at a rank that said nothing: `ruling.verdict` names it
    nobody,     // no chain, and every peer reported: every rank stalled (culprit -1)
  };
  End end = End::nobody;
  Ruling ruling;
  // End::candidate: every peer but the candidate has reported, so the candidate is the culprit
  // without waiting any longer.
  bool others_reported = false;
};

// Follows the suspects from `start`: a chain that comes back to this rank names the rank that
// timed out waiting for it; a chain that reaches a rank with a terminal notice or a lost
// channel takes that; a cycle names `fallback` (a lost message between two live ranks). The
// candidate is the rank the chain ends at, or without a chain the lowest rank that has said
// nothing about the failure. `timeout` is the call's, for the verdict's words.
[[nodiscard]] ChainEnd follow_suspects(const Evidence& evidence, int start, int fallback,
                                       std::chrono::milliseconds timeout);

// The odd one out among the ranks' values of what must agree (one key per rank, in rank
// order): the first rank whose key differs from the majority's. The majority's key is the most
// frequent one; a tie goes to the lowest rank's.
struct Minority {
  int culprit = -1;
  int majority_rank = -1;  // the lowest rank holding the majority's key
  std::size_t majority_count = 0;
};
[[nodiscard]] std::optional<Minority> find_minority(std::span<const std::string> keys);

// The peer this rank's error names for `verdict`: the culprit; when this rank itself is the odd
// one out, a rank of the majority; when the others accuse it, the other end of the likely
// broken link: for a timeout the peer it was itself waiting for (`waiting_on`, -1 if none),
// else a peer that timed out waiting for it, else the accuser.
[[nodiscard]] int named_peer(const Evidence& evidence, const Verdict& verdict, int waiting_on);

// Throws the error this rank reports for `verdict`: an Error of the verdict's kind (timeout,
// protocol, invalid_argument, io; peer_lost otherwise) whose context names this rank and
// named_peer(). `call` describes the call ("allreduce_sum call #3 under tag 0").
[[noreturn]] void throw_verdict(const Evidence& evidence, const Verdict& verdict, int waiting_on,
                                std::string_view call);

// How an error message words a failure of `kind` ("was lost (...)", "stopped responding").
[[nodiscard]] std::string_view describe_failure(ErrorKind kind) noexcept;

}  // namespace pulseloco::collectives::detail
