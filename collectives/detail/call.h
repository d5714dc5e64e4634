// One collective call in flight: its tags, the header exchange, posting and waiting (waits
// with deadlines that watch the other ranks' notices) and the completion round. A failure goes
// to the call's Diagnosis (diagnosis.h), which names the culprit, tells the other ranks and
// aborts the transport. Internal to collectives/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log_lines.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/collectives/detail/diagnosis.h>
#include <pulseloco/collectives/detail/packets.h>
#include <pulseloco/transport/native_collectives.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::collectives::detail {

// Checks the options a call needs before anything is sent (InvalidArgument otherwise).
void validate_options(const CollectiveOptions& options, const transport::Transport& transport,
                      std::string_view operation);

class Call {
 public:
  // Takes the call's sequence number and posts the receives for the peers' notices.
  Call(transport::Transport& transport, const CollectiveOptions& options, Op op);
  // Aborts the transport if the call neither finished nor went through fail().
  ~Call();
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  [[nodiscard]] int rank() const noexcept { return context_.rank; }
  [[nodiscard]] int size() const noexcept { return context_.size; }
  // The ranks this one receives from and sends to in a ring (rank - 1 and rank + 1).
  [[nodiscard]] int left_neighbour() const noexcept {
    return (context_.rank - 1 + context_.size) % context_.size;
  }
  [[nodiscard]] int right_neighbour() const noexcept { return (context_.rank + 1) % context_.size; }
  [[nodiscard]] const CollectiveOptions& options() const noexcept { return context_.options; }
  [[nodiscard]] std::uint64_t sequence() const noexcept { return context_.sequence; }
  // The transport matches messages by order (Transport::matches_by_order): payloads move
  // through its native collectives, which it must offer (native_for_ordered()).
  [[nodiscard]] bool ordered() const noexcept { return context_.ordered; }
  // The native collectives of an order-matching transport (InvalidArgument when it has none).
  [[nodiscard]] transport::NativeCollectives& native_for_ordered() const;
  [[nodiscard]] transport::Tag tag(Phase phase) const { return context_.tag(phase); }

  // Every rank's header in rank order (the own one with op, sequence, chunk size and algorithm
  // filled in). Throws when a peer runs another collective or with other options.
  [[nodiscard]] std::vector<Header> exchange_headers(Header mine);

  // The header exchange in two halves, so that a collective whose first operations do not
  // depend on the peers' headers (the all-reduce's: its length and algorithm must agree
  // anyway) can post them while the headers travel: the exchange then costs no round of its
  // own. post_headers() sends this rank's header and posts the receives; the headers are
  // checked (as by exchange_headers, plus `agreement`) before any other wait of the call, so a
  // disagreement is still reported as one, whatever the early operations ran into. Until
  // then, the call may only post operations: receives into buffers it owns or the caller's
  // output, sends from the caller's input.
  struct Agreement {
    ErrorKind kind = ErrorKind::invalid_argument;
    std::string what;                               // the rule, in words
    std::function<std::string(const Header&)> key;  // what must be equal on every rank
  };
  //
  // Who gets the header: every peer (the default), or the right neighbour alone
  // (HeaderExchange::left_neighbour, for a collective whose value is known to every rank before
  // the call and whose payload sizes follow from it: the all-reduce). Either way a rank checks
  // its left neighbour's header first, before anything else: when every rank's left neighbour
  // agrees with it, all agree, whichever exchange each rank chose. A rank whose left neighbour
  // disagrees makes every rank exchange headers with every rank (Phase::diagnosis, in the
  // failure path), so that the culprit is named as with a full exchange. A rank that receives
  // from peers other than its left neighbour may meet a disagreement as a message of the wrong
  // size from a peer whose header it never saw: under left_neighbour such a protocol error waits
  // (briefly) for the disagreement notice of the rank that saw the odd header, and joins the
  // diagnosis if one comes (Diagnosis::fail). With left_neighbour, headers() holds only this rank's
  // header and its left neighbour's.
  enum class HeaderExchange : std::uint8_t { all_peers, left_neighbour };
  void post_headers(Header mine, std::optional<Agreement> agreement = std::nullopt,
                    HeaderExchange exchange = HeaderExchange::all_peers);
  // Waits for the headers posted by post_headers and checks them (once); every rank's header in
  // rank order.
  [[nodiscard]] const std::vector<Header>& headers();
  // While the headers are pending: waits for `peer`'s header alone and returns it if it is for
  // this very call with this rank's options (operation, call number, chunk size, algorithm),
  // else nullopt; headers() still checks every header, and reports a disagreement as one. For
  // an early receive: the all-gather posts its left neighbour's as soon as it knows that
  // message's size.
  [[nodiscard]] std::optional<Header> matching_header_from(int peer);

  // Throws a Disagreement unless every rank's header has the same `key` (a description of the
  // fields that must agree, in words).
  void require_agreement(const std::vector<Header>& headers, ErrorKind kind, std::string_view what,
                         const std::function<std::string(const Header&)>& key) const;

  // Posts an operation; the call owns it until it ends. The references stay valid until then.
  transport::Request& isend(int peer, Phase phase, std::span<const std::byte> data);
  transport::Request& irecv(int peer, Phase phase, std::span<std::byte> data);
  // isend of exactly the bytes of `earlier` (a completed receive into them, or a send of them
  // to another peer), unchanged since (Transport::iforward): the transport may reuse their
  // checksums.
  transport::Request& iforward(int peer, Phase phase, std::span<const std::byte> data,
                               const transport::Request& earlier);
  // Sends `data` to every peer in turn (this rank + 1, + 2, ...), the direct collectives' way:
  // the first through isend, the others through iforward of it, so that the transport
  // checksums the bytes once.
  void isend_to_every_peer(Phase phase, std::span<const std::byte> data);

  // Waits for `request` (an operation with `peer`) for at most options.timeout, while watching
  // the other ranks' notices (after headers(), if they are pending).
  void wait(transport::Request& request, int peer);
  // Waits for every send posted so far.
  void wait_sends();
  // Runs one of the transport's native collectives (transport/native_collectives.h) with a
  // deadline of options.timeout for the whole call. A failure there does not say which peer
  // is missing: the failure path then looks for the rank that says nothing.
  void run_native(const std::function<void(transport::Deadline)>& collective);
  // A buffer of `bytes` uninitialised bytes that lives as long as the call (for operations
  // that may still write into it until the transport is aborted). Once per call.
  [[nodiscard]] std::span<std::byte> scratch(std::size_t bytes);

  // The completion round: tells every peer that this rank has received everything, then waits
  // until every peer has said the same and this rank's sends are complete. After it returns
  // the call succeeded.
  void finish();

  // The failure path; call it from a catch block. The call's Diagnosis works out the culprit,
  // tells the other ranks, aborts the transport and throws the error to report (or rethrows a
  // local error).
  [[noreturn]] void fail();

 private:
  void wait_watching_notices(transport::Request& request, int peer);
  // A long wait's progress line (WaitProgress): whom the call waits for now, and which ranks'
  // headers have not arrived (those ranks have not entered the call).
  void log_progress(int peer);
  // Adds the time from the call's start until now (every header it waits for is in) to the
  // calling thread's header_wait_seconds().
  void add_header_wait() const;
  // Whether `theirs` is for this very call with this rank's options (operation, call number,
  // chunk size, algorithm).
  [[nodiscard]] bool same_call_and_options(const Header& theirs) const;
  // Whether `theirs` agrees with this rank's header on everything that must be equal.
  [[nodiscard]] bool agrees_with_mine(const Header& theirs) const;
  // Every check of a full set of headers (throws a Disagreement).
  void check_all_headers(const std::vector<Header>& headers) const;

  CallContext context_;
  transport::Clock::time_point started_ = transport::Clock::now();
  WaitProgress progress_;
  // The header exchange (post_headers): pending until headers() has checked it.
  bool headers_pending_ = false;
  std::vector<Header> headers_;
  std::optional<Agreement> agreement_;
  std::vector<transport::Request*> header_receives_;
  HeaderExchange header_exchange_ = HeaderExchange::all_peers;

  bool finished_ = false;
  int waiting_on_ = -1;  // the peer of the wait in progress

  // Buffers that pending operations use are declared before the requests, so that requests
  // are destroyed first (after the transport was aborted, if the call failed).
  std::vector<Header::Bytes> headers_in_;
  Header::Bytes header_out_{};
  std::unique_ptr<std::byte[]> scratch_;  // not zeroed: every byte is received before it is read
  Diagnosis diagnosis_;                   // the notices' buffers, and the failure path
  Requests requests_;
  PendingSends sends_;  // not yet waited
};

// Runs `body(call)` as one collective call: finish() on success, fail() on any exception.
template <typename Body>
void run_call(transport::Transport& transport, const CollectiveOptions& options, Op op,
              Body&& body) {
  Call call(transport, options, op);
  try {
    body(call);
    call.finish();
  } catch (...) {
    call.fail();
  }
}

}  // namespace pulseloco::collectives::detail
