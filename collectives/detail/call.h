// One collective call in flight: its tags, the header exchange, waits with deadlines that
// watch for the other ranks' failure notices, the completion round, and the failure path that
// finds the culprit, tells the other ranks and aborts the transport. Internal to collectives/.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::collectives::detail {

enum class Op : std::uint8_t {
  sparse_allgather = 1,
  allreduce_sum = 2,
  broadcast = 3,
  barrier = 4,
  allgather_u64 = 5,
};
[[nodiscard]] std::string_view op_name(Op op) noexcept;

// The low byte of every tag of a call.
enum class Phase : std::uint8_t {
  header = 1,
  notice = 2,
  payload = 3,         // sparse all-gather and broadcast
  reduce_scatter = 4,  // all-reduce
  gather = 5,          // all-reduce's all-gather phase
  diagnosis = 6,       // headers re-sent to every rank to name the culprit of a disagreement
};

// Tag of (base tag, call sequence number, phase); bit 63 marks collective traffic.
[[nodiscard]] transport::Tag make_tag(transport::Tag base, std::uint64_t sequence, Phase phase);

// What every rank announces at the start of a call.
struct Header {
  Op op = Op::barrier;
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::automatic;
  std::int32_t root = 0;
  std::uint64_t sequence = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint64_t value = 0;  // message size, element count, data size or the gathered value
};
inline constexpr std::size_t kHeaderBytes = 40;
[[nodiscard]] std::array<std::byte, kHeaderBytes> encode_header(const Header& header);
// Throws ProtocolError naming `peer` when the bytes are not a header.
[[nodiscard]] Header decode_header(std::span<const std::byte, kHeaderBytes> bytes, int rank,
                                   int peer);

enum class NoticeType : std::uint8_t {
  done = 1,     // the sender finished its part of the call
  suspect = 2,  // the sender timed out waiting on `subject` (which may itself be waiting)
  culprit = 3,  // the sender concluded that `subject` failed with error kind `kind`
  aborted = 4,  // the sender abandons the call because of a local error
  // The sender's left neighbour called with other arguments (headers exchanged with the left
  // neighbour only): every rank sends its header to every rank (Phase::diagnosis) so that all
  // name the same culprit; the sender's verdict follows as a culprit notice.
  disagreement = 5,
};
struct Notice {
  NoticeType type = NoticeType::done;
  ErrorKind kind = ErrorKind::peer_lost;
  std::int32_t reporter = 0;
  std::int32_t subject = 0;
  std::uint64_t sequence = 0;
};
inline constexpr std::size_t kNoticeBytes = 24;
[[nodiscard]] std::array<std::byte, kNoticeBytes> encode_notice(const Notice& notice);
// Throws ProtocolError naming `peer` when the bytes are not a valid notice from `peer` for call
// `sequence` of a group of `world_size`.
[[nodiscard]] Notice decode_notice(std::span<const std::byte, kNoticeBytes> bytes, int rank,
                                   int peer, int world_size, std::uint64_t sequence);

// Checks the options a call needs before anything is sent (InvalidArgument otherwise).
void validate_options(const CollectiveOptions& options, const transport::Transport& transport,
                      std::string_view operation);

// The ranks' headers disagree. Every rank that sees all headers names the same culprit: the
// first rank whose value differs from the majority's.
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

class Call {
 public:
  // Takes the call's sequence number and posts the receives for the peers' notices.
  Call(transport::Transport& transport, const CollectiveOptions& options, Op op);
  // Aborts the transport if the call neither finished nor went through fail().
  ~Call();
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  // The ranks this one receives from and sends to in a ring (rank - 1 and rank + 1).
  [[nodiscard]] int left_neighbour() const noexcept { return (rank_ - 1 + size_) % size_; }
  [[nodiscard]] int right_neighbour() const noexcept { return (rank_ + 1) % size_; }
  [[nodiscard]] const CollectiveOptions& options() const noexcept { return options_; }
  [[nodiscard]] std::uint64_t sequence() const noexcept { return sequence_; }
  [[nodiscard]] transport::Tag tag(Phase phase) const {
    return make_tag(options_.tag, sequence_, phase);
  }

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
  // diagnosis if one comes (Call::fail). With left_neighbour, headers() holds only this rank's
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

  // The completion round: waits for this rank's sends, tells every peer it is done and waits
  // until every peer is. After it returns the call succeeded.
  void finish();

  // The failure path; call it from a catch block. Works out the culprit, tells the other
  // ranks, aborts the transport and throws the error to report (or rethrows a local error).
  [[noreturn]] void fail();

 private:
  struct NoticeSlot {
    std::array<std::byte, kNoticeBytes> buffer{};
    transport::Request* request = nullptr;  // the posted receive, if any
    bool pending = false;                   // `request` not complete yet
    std::optional<Notice> latest;           // the last notice received
    bool timed_out_on_me = false;           // it sent "suspect: this rank"
    std::optional<ErrorKind> broken;        // its notice channel failed (peer lost, garbage)
    std::string broken_detail;
  };
  struct Verdict {
    int culprit = -1;
    ErrorKind kind = ErrorKind::peer_lost;
    int reporter = -1;
    std::string detail;
    int majority = -1;  // for a Disagreement that names this rank: a rank of the majority
  };

  transport::Request& own(std::unique_ptr<transport::Request> request);
  void wait_watching_notices(transport::Request& request, int peer);
  void post_notice_receive(int peer);
  // Collects the notices that arrived; throws a NoticeFailure when one of them (or a lost
  // notice channel) means the call has failed, unless `quiet`.
  void poll_notices(bool quiet);
  void poll_notices_once(bool quiet, bool& progressed);
  // Sends this rank's notice (reporter: this rank, for this call) to every peer.
  void send_notice(NoticeType type, ErrorKind kind, int subject,
                   std::vector<std::pair<transport::Request*, int>>& sent);
  [[nodiscard]] bool failure_reported_by(int peer) const;
  [[nodiscard]] Verdict verdict_from_notice(int peer) const;
  [[nodiscard]] Verdict resolve_definitive(int peer, ErrorKind kind, std::string detail);
  [[nodiscard]] Verdict resolve_chain(int start, int fallback);
  // The best explanation the notices offer: the most incriminating culprit notice, else a lost
  // notice channel.
  [[nodiscard]] std::optional<Verdict> verdict_from_notices() const;
  // Waits briefly for a better explanation than `current` when that is only a lost peer.
  [[nodiscard]] Verdict settle(Verdict current);
  // Polls the notices until `done` holds, waiting on pending notice receives in between, for at
  // most min(timeout / 4, 250 ms); returns whether `done` held.
  [[nodiscard]] bool await_notices(const std::function<bool()>& done);
  // Whether `theirs` is for this very call with this rank's options (operation, call number,
  // chunk size, algorithm).
  [[nodiscard]] bool same_call_and_options(const Header& theirs) const;
  // Whether `theirs` agrees with this rank's header on everything that must be equal.
  [[nodiscard]] bool agrees_with_mine(const Header& theirs) const;
  // Every check of a full set of headers (throws a Disagreement).
  void check_all_headers(const std::vector<Header>& headers) const;
  // Sends this rank's header to every peer under Phase::diagnosis (once; best effort).
  void send_diagnosis_header();
  // The failure path of a disagreement found between left neighbours: collects every rank's
  // header under Phase::diagnosis and names the culprit as a full exchange would (or adopts a
  // verdict another rank sent first).
  [[nodiscard]] Verdict diagnose_disagreement();
  // Under HeaderExchange::left_neighbour: waits at most the settle time for a peer's
  // disagreement notice, and says whether one came. A protocol error from a peer whose header
  // this rank never checked may be that peer calling with other arguments.
  [[nodiscard]] bool disagreement_announced_soon();
  void abort_transport(std::string_view reason) noexcept;
  [[noreturn]] void throw_verdict(const Verdict& verdict) const;

  transport::Transport& transport_;
  CollectiveOptions options_;
  Op op_;
  int rank_;
  int size_;
  std::uint64_t sequence_;
  std::chrono::milliseconds slice_;
  // The header exchange (post_headers): pending until headers() has checked it.
  bool headers_pending_ = false;
  std::vector<Header> headers_;
  std::optional<Agreement> agreement_;
  std::vector<transport::Request*> header_receives_;
  HeaderExchange header_exchange_ = HeaderExchange::all_peers;
  bool diagnosis_header_sent_ = false;

  bool finished_ = false;
  bool failing_ = false;
  bool aborted_ = false;
  int waiting_on_ = -1;  // the peer of the wait in progress

  // Buffers that pending operations use are declared before the requests, so that requests
  // are destroyed first (after the transport was aborted, if the call failed).
  std::vector<NoticeSlot> notices_;
  std::deque<std::array<std::byte, kNoticeBytes>> outgoing_notices_;
  std::vector<std::array<std::byte, kHeaderBytes>> headers_in_;
  std::vector<std::array<std::byte, kHeaderBytes>> diagnosis_in_;
  std::array<std::byte, kHeaderBytes> header_out_{};
  std::unique_ptr<std::byte[]> scratch_;  // not zeroed: every byte is received before it is read
  std::vector<std::unique_ptr<transport::Request>> requests_;
  std::vector<std::pair<transport::Request*, int>> sends_;  // (request, peer) not yet waited
  std::vector<std::pair<transport::Request*, int>> failure_sends_;
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
