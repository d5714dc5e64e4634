#include <pulseloco/collectives/detail/call.h>

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <exception>
#include <utility>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/log.h>

namespace pulseloco::collectives::detail {

static_assert(std::endian::native == std::endian::little,
              "the collective headers and notices are little-endian on the wire");

using transport::Clock;
using transport::Request;
using transport::Tag;

namespace {

constexpr std::uint32_t kHeaderMagic = 0x48434C50;  // "PLCH"
constexpr std::uint32_t kNoticeMagic = 0x4E434C50;  // "PLCN"
constexpr std::uint8_t kWireVersion = 1;

// A failure this rank observed itself while waiting on or posting to `peer`.
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

// This rank's left neighbour called with other arguments (Call::headers); the failure path
// finds out who is at fault (Call::diagnose_disagreement).
struct LeftDisagreement : std::exception {
  [[nodiscard]] const char* what() const noexcept override {
    return "the left neighbour called with other arguments";
  }
};

// The transport was aborted on this rank (by the caller or an earlier failure).
[[nodiscard]] bool is_local_abort(const Error& error) {
  return error.kind() == ErrorKind::aborted;
}

// Inside a catch block for `error`: rethrows a local abort unchanged, else reports what this
// rank observed about `peer`.
[[noreturn]] void throw_observed(const Error& error, int peer) {
  if (is_local_abort(error)) throw;
  const int culprit = error.context().peer.value_or(peer);
  throw ObservedFailure(culprit, error.kind(), error.kind() == ErrorKind::timeout, error.message());
}

[[nodiscard]] bool is_terminal(NoticeType type) {
  return type == NoticeType::culprit || type == NoticeType::aborted;
}

[[nodiscard]] std::string_view describe(ErrorKind kind) {
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

}  // namespace

std::string_view op_name(Op op) noexcept {
  switch (op) {
    case Op::sparse_allgather:
      return "sparse_allgather";
    case Op::allreduce_sum:
      return "allreduce_sum";
    case Op::broadcast:
      return "broadcast";
    case Op::barrier:
      return "barrier";
    case Op::allgather_u64:
      return "allgather_u64";
  }
  return "unknown collective";
}

Tag make_tag(Tag base, std::uint64_t sequence, Phase phase) {
  PULSELOCO_CHECK(base < kTagLimit, "base tag out of range");
  return (Tag{1} << 63) | (base << 40) | ((sequence & 0xFFFF'FFFFULL) << 8) |
         static_cast<Tag>(phase);
}

std::array<std::byte, kHeaderBytes> encode_header(const Header& header) {
  std::array<std::byte, kHeaderBytes> out{};
  ByteWriter(out)
      .put(kHeaderMagic)
      .put(kWireVersion)
      .put(static_cast<std::uint8_t>(header.op))
      .put(static_cast<std::uint8_t>(header.algorithm))
      .zeros(1)
      .put(header.root)
      .zeros(4)
      .put(header.sequence)
      .put(header.chunk_bytes)
      .put(header.value);
  return out;
}

Header decode_header(std::span<const std::byte, kHeaderBytes> bytes, int rank, int peer) {
  const ErrorContext context{.rank = rank, .peer = peer};
  ByteReader in(bytes, context);
  const auto magic = in.get<std::uint32_t>("magic");
  const auto version = in.get<std::uint8_t>("version");
  if (magic != kHeaderMagic || version != kWireVersion) {
    throw ProtocolError(
        fmt::format("peer {} sent something that is not a version-{} collective header", peer,
                    kWireVersion),
        context);
  }
  const auto op = in.get<std::uint8_t>("operation");
  const auto algorithm = in.get<std::uint8_t>("algorithm");
  if (op < static_cast<std::uint8_t>(Op::sparse_allgather) ||
      op > static_cast<std::uint8_t>(Op::allgather_u64) ||
      algorithm > static_cast<std::uint8_t>(CollectiveAlgorithm::direct)) {
    throw ProtocolError(fmt::format("peer {} sent a collective header with operation {} and "
                                    "algorithm {}, which do not exist",
                                    peer, op, algorithm),
                        context);
  }
  in.skip(1, "padding");
  Header header{.op = static_cast<Op>(op), .algorithm = static_cast<CollectiveAlgorithm>(algorithm)};
  header.root = in.get<std::int32_t>("root");
  in.skip(4, "padding");
  header.sequence = in.get<std::uint64_t>("sequence");
  header.chunk_bytes = in.get<std::uint64_t>("chunk size");
  header.value = in.get<std::uint64_t>("value");
  return header;
}

std::array<std::byte, kNoticeBytes> encode_notice(const Notice& notice) {
  std::array<std::byte, kNoticeBytes> out{};
  ByteWriter(out)
      .put(kNoticeMagic)
      .put(kWireVersion)
      .put(static_cast<std::uint8_t>(notice.type))
      .put(static_cast<std::uint8_t>(notice.kind))
      .zeros(1)
      .put(notice.reporter)
      .put(notice.subject)
      .put(notice.sequence);
  return out;
}

Notice decode_notice(std::span<const std::byte, kNoticeBytes> bytes, int rank, int peer,
                     int world_size, std::uint64_t sequence) {
  const ErrorContext context{.rank = rank, .peer = peer};
  ByteReader in(bytes, context);
  const auto magic = in.get<std::uint32_t>("magic");
  const auto version = in.get<std::uint8_t>("version");
  const auto type = in.get<std::uint8_t>("notice type");
  const auto kind = in.get<std::uint8_t>("error kind");
  in.skip(1, "padding");
  Notice notice{.type = static_cast<NoticeType>(type), .kind = static_cast<ErrorKind>(kind)};
  notice.reporter = in.get<std::int32_t>("reporter");
  notice.subject = in.get<std::int32_t>("subject");
  notice.sequence = in.get<std::uint64_t>("sequence");
  const bool valid =
      magic == kNoticeMagic && version == kWireVersion &&
      type >= static_cast<std::uint8_t>(NoticeType::done) &&
      type <= static_cast<std::uint8_t>(NoticeType::disagreement) &&
      kind <= static_cast<std::uint8_t>(ErrorKind::non_finite) && notice.reporter == peer &&
      notice.subject >= 0 && notice.subject < world_size && notice.sequence == sequence;
  if (!valid) {
    throw ProtocolError(
        fmt::format("peer {} sent an invalid completion/failure notice for call #{}", peer,
                    sequence),
        context);
  }
  return notice;
}

void validate_options(const CollectiveOptions& options, const transport::Transport& transport,
                      std::string_view operation) {
  const ErrorContext context{.rank = transport.rank()};
  if (options.tag >= kTagLimit) {
    throw InvalidArgument(
        fmt::format("{}: base tag {} is not below {}", operation, options.tag, kTagLimit), context);
  }
  if (options.timeout <= std::chrono::milliseconds::zero()) {
    throw InvalidArgument(
        fmt::format("{}: timeout {} ms must be positive", operation, options.timeout.count()),
        context);
  }
  if (options.pipeline_chunk_bytes == 0) {
    throw InvalidArgument(fmt::format("{}: pipeline_chunk_bytes must be positive", operation),
                          context);
  }
  if (options.algorithm > CollectiveAlgorithm::direct) {
    throw InvalidArgument(fmt::format("{}: algorithm {} does not exist", operation,
                                      static_cast<int>(options.algorithm)),
                          context);
  }
}

Call::Call(transport::Transport& transport, const CollectiveOptions& options, Op op)
    : transport_(transport),
      options_(options),
      op_(op),
      rank_(transport.rank()),
      size_(transport.size()),
      sequence_(transport.next_sequence(options.tag)),
      slice_(std::clamp(options.timeout / 16, std::chrono::milliseconds{1},
                        std::chrono::milliseconds{25})),
      notices_(static_cast<std::size_t>(size_)),
      headers_in_(static_cast<std::size_t>(size_)),
      diagnosis_in_(static_cast<std::size_t>(size_)) {
  try {
    for (int peer = 0; peer < size_; ++peer) {
      if (peer != rank_) post_notice_receive(peer);
    }
  } catch (...) {
    abort_transport(fmt::format("{} call #{} could not start", op_name(op_), sequence_));
    throw;
  }
}

Call::~Call() {
  if (!finished_) {
    abort_transport(fmt::format("{} call #{} was abandoned", op_name(op_), sequence_));
  }
}

std::span<std::byte> Call::scratch(std::size_t bytes) {
  PULSELOCO_CHECK(!scratch_, "a call takes its scratch buffer once");
  scratch_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
  return {scratch_.get(), bytes};
}

Request& Call::own(std::unique_ptr<Request> request) {
  requests_.push_back(std::move(request));
  return *requests_.back();
}

void Call::post_notice_receive(int peer) {
  NoticeSlot& slot = notices_[static_cast<std::size_t>(peer)];
  slot.request = &own(transport_.irecv(peer, tag(Phase::notice), slot.buffer));
  slot.pending = true;
}

Request& Call::isend(int peer, Phase phase, std::span<const std::byte> data) {
  try {
    Request& request = own(transport_.isend(peer, tag(phase), data));
    sends_.emplace_back(&request, peer);
    return request;
  } catch (const Error& error) {
    throw_observed(error, peer);
  }
}

Request& Call::iforward(int peer, Phase phase, std::span<const std::byte> data,
                        const Request& earlier) {
  try {
    Request& request = own(transport_.iforward(peer, tag(phase), data, earlier));
    sends_.emplace_back(&request, peer);
    return request;
  } catch (const Error& error) {
    throw_observed(error, peer);
  }
}

void Call::isend_to_every_peer(Phase phase, std::span<const std::byte> data) {
  if (size_ == 1) return;
  const Request& first = isend(right_neighbour(), phase, data);
  for (int distance = 2; distance < size_; ++distance)
    (void)iforward((rank_ + distance) % size_, phase, data, first);
}

Request& Call::irecv(int peer, Phase phase, std::span<std::byte> data) {
  try {
    return own(transport_.irecv(peer, tag(phase), data));
  } catch (const Error& error) {
    throw_observed(error, peer);
  }
}

void Call::wait(Request& request, int peer) {
  if (headers_pending_) (void)headers();
  wait_watching_notices(request, peer);
}

void Call::wait_watching_notices(Request& request, int peer) {
  waiting_on_ = peer;
  const auto step_deadline = Clock::now() + options_.timeout;
  for (;;) {
    poll_notices(false);
    const auto slice_end = std::min(step_deadline, Clock::now() + slice_);
    try {
      request.wait(slice_end);
      waiting_on_ = -1;
      return;
    } catch (const TimeoutError&) {
      if (Clock::now() >= step_deadline) {
        throw ObservedFailure(
            peer, ErrorKind::timeout, true,
            fmt::format("no progress from peer {} for {} ms", peer, options_.timeout.count()));
      }
    } catch (const Error& error) {
      throw_observed(error, peer);
    }
  }
}

void Call::run_native(const std::function<void(transport::Deadline)>& collective) {
  if (headers_pending_) (void)headers();
  poll_notices(false);
  try {
    collective(transport::deadline_after(options_.timeout));
  } catch (const TimeoutError& error) {
    throw ObservedFailure(-1, ErrorKind::timeout, true, error.message());
  } catch (const Error& error) {
    if (is_local_abort(error)) throw;
    throw ObservedFailure(error.context().peer.value_or(-1), error.kind(), false, error.message());
  }
}

void Call::wait_sends() {
  for (const auto& [request, peer] : sends_)
    wait(*request, peer);
  sends_.clear();
}

void Call::poll_notices(bool quiet) {
  // In the failure path every consumed notice may already have a follow-up waiting: repeat
  // until nothing more arrives.
  bool progressed = true;
  while (progressed) {
    progressed = false;
    poll_notices_once(quiet, progressed);
  }
}

void Call::poll_notices_once(bool quiet, bool& progressed) {
  for (int peer = 0; peer < size_; ++peer) {
    NoticeSlot& slot = notices_[static_cast<std::size_t>(peer)];
    if (!slot.pending) continue;
    bool complete = false;
    try {
      complete = slot.request->test();
    } catch (const Error& error) {
      slot.pending = false;
      if (is_local_abort(error)) {
        if (quiet) continue;
        throw;
      }
      slot.broken = error.kind();
      slot.broken_detail = error.message();
      if (!quiet) throw NoticeFailure();
      continue;
    }
    if (!complete) continue;
    slot.pending = false;
    progressed = failing_;
    try {
      slot.latest = decode_notice(slot.buffer, rank_, peer, size_, sequence_);
    } catch (const ProtocolError& error) {
      slot.broken = ErrorKind::protocol;
      slot.broken_detail = error.message();
      if (!quiet) throw NoticeFailure();
      continue;
    }
    if (slot.latest->type == NoticeType::suspect && slot.latest->subject == rank_) {
      slot.timed_out_on_me = true;
    }
    if (failing_ && !is_terminal(slot.latest->type)) {
      try {
        post_notice_receive(peer);  // a follow-up notice may still come
      } catch (...) {
        // The transport is going down; what arrived so far has to do.
      }
    }
    if (!quiet && slot.latest->type != NoticeType::done) throw NoticeFailure();
  }
}

std::vector<Header> Call::exchange_headers(Header mine) {
  post_headers(mine);
  return headers();
}

void Call::post_headers(Header mine, std::optional<Agreement> agreement, HeaderExchange exchange) {
  mine.op = op_;
  mine.sequence = sequence_;
  const bool uses_options = op_ != Op::barrier && op_ != Op::allgather_u64;
  mine.chunk_bytes = uses_options ? options_.pipeline_chunk_bytes : 0;
  mine.algorithm = uses_options ? options_.algorithm : CollectiveAlgorithm::automatic;
  headers_.assign(static_cast<std::size_t>(size_), Header{});
  headers_[static_cast<std::size_t>(rank_)] = mine;
  agreement_ = std::move(agreement);
  header_exchange_ = exchange;
  headers_pending_ = true;
  header_out_ = encode_header(mine);
  if (size_ == 1) return;

  header_receives_.assign(static_cast<std::size_t>(size_), nullptr);
  if (exchange == HeaderExchange::left_neighbour) {
    const int left = left_neighbour();
    header_receives_[static_cast<std::size_t>(left)] =
        &irecv(left, Phase::header, headers_in_[static_cast<std::size_t>(left)]);
    isend(right_neighbour(), Phase::header, header_out_);
    return;
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    header_receives_[static_cast<std::size_t>(peer)] =
        &irecv(peer, Phase::header, headers_in_[static_cast<std::size_t>(peer)]);
  }
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_) isend(peer, Phase::header, header_out_);
  }
}

std::optional<Header> Call::matching_header_from(int peer) {
  PULSELOCO_CHECK(headers_pending_ && peer != rank_, "a pending header from a peer");
  const auto index = static_cast<std::size_t>(peer);
  wait_watching_notices(*header_receives_[index], peer);
  const Header theirs = decode_header(headers_in_[index], rank_, peer);
  if (!same_call_and_options(theirs)) return std::nullopt;
  return theirs;
}

const std::vector<Header>& Call::headers() {
  if (!headers_pending_) return headers_;
  headers_pending_ = false;
  if (size_ == 1) return headers_;
  // The left neighbour's first: it is sent whichever exchange that rank chose, and when every
  // rank's left neighbour agrees with it, all ranks agree (the ring closes).
  const int left = left_neighbour();
  const auto left_index = static_cast<std::size_t>(left);
  wait_watching_notices(*header_receives_[left_index], left);
  headers_[left_index] = decode_header(headers_in_[left_index], rank_, left);
  if (!agrees_with_mine(headers_[left_index])) throw LeftDisagreement();
  if (header_exchange_ == HeaderExchange::left_neighbour) return headers_;
  for (int distance = 1; distance + 1 < size_; ++distance) {
    const int peer = (rank_ + distance) % size_;
    const auto index = static_cast<std::size_t>(peer);
    wait_watching_notices(*header_receives_[index], peer);
    headers_[index] = decode_header(headers_in_[index], rank_, peer);
  }
  // Checked once every header is in, so that every rank names the same culprit.
  check_all_headers(headers_);
  return headers_;
}

bool Call::same_call_and_options(const Header& theirs) const {
  const Header& mine = headers_[static_cast<std::size_t>(rank_)];
  return theirs.op == mine.op && theirs.sequence == mine.sequence &&
         theirs.chunk_bytes == mine.chunk_bytes && theirs.algorithm == mine.algorithm;
}

bool Call::agrees_with_mine(const Header& theirs) const {
  const Header& mine = headers_[static_cast<std::size_t>(rank_)];
  return same_call_and_options(theirs) &&
         (!agreement_ || agreement_->key(theirs) == agreement_->key(mine));
}

void Call::check_all_headers(const std::vector<Header>& headers) const {
  require_agreement(
      headers, ErrorKind::protocol, "the ranks called different collectives", [&](const Header& h) {
        return fmt::format("{} call #{} under tag {}", op_name(h.op), h.sequence, options_.tag);
      });
  require_agreement(headers, ErrorKind::invalid_argument, "every rank must pass the same options",
                    [](const Header& h) {
                      return fmt::format("pipeline_chunk_bytes {} and algorithm {}", h.chunk_bytes,
                                         algorithm_name(h.algorithm));
                    });
  if (agreement_) require_agreement(headers, agreement_->kind, agreement_->what, agreement_->key);
}

void Call::require_agreement(const std::vector<Header>& headers, ErrorKind kind,
                             std::string_view what,
                             const std::function<std::string(const Header&)>& key) const {
  std::vector<std::string> keys;
  keys.reserve(headers.size());
  for (const Header& header : headers)
    keys.push_back(key(header));
  // The majority's value; a tie goes to the value of the lowest rank.
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
    if (keys[i] == keys[majority]) continue;
    throw Disagreement(static_cast<int>(i), static_cast<int>(majority), kind,
                       fmt::format("{}: rank {} has {} while {} of {} ranks have {}", what, i,
                                   keys[i], majority_count, keys.size(), keys[majority]));
  }
}

void Call::send_notice(NoticeType type, ErrorKind kind, int subject,
                       std::vector<std::pair<Request*, int>>& sent) {
  const auto& bytes = outgoing_notices_.emplace_back(encode_notice(
      {.type = type, .kind = kind, .reporter = rank_, .subject = subject, .sequence = sequence_}));
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    try {
      sent.emplace_back(&own(transport_.isend(peer, tag(Phase::notice), bytes)), peer);
    } catch (...) {
      // Best effort: a peer we cannot reach learns of the failure from its own waits.
    }
  }
}

void Call::finish() {
  if (headers_pending_) (void)headers();
  if (size_ > 1) {
    // Every receive of the call is complete: "done" says that this rank has everything, so it
    // goes out at once, without waiting for this rank's last sends (the peers' own "done"
    // notices cannot come before those arrived anyway).
    send_notice(NoticeType::done, ErrorKind::peer_lost, rank_, sends_);
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      NoticeSlot& slot = notices_[static_cast<std::size_t>(peer)];
      while (!slot.latest) {
        if (!slot.pending) throw NoticeFailure();
        wait(*slot.request, peer);
        poll_notices(false);
      }
    }
    wait_sends();
  }
  finished_ = true;
  // Every operation of the call is complete and its tags are never used again.
  for (const Phase phase : {Phase::header, Phase::notice, Phase::payload, Phase::reduce_scatter,
                            Phase::gather, Phase::diagnosis})
    transport_.retire_tag(tag(phase));
}

bool Call::failure_reported_by(int peer) const {
  const NoticeSlot& slot = notices_[static_cast<std::size_t>(peer)];
  return slot.broken || (slot.latest && slot.latest->type != NoticeType::done);
}

Call::Verdict Call::verdict_from_notice(int peer) const {
  const Notice& notice = *notices_[static_cast<std::size_t>(peer)].latest;
  if (notice.type == NoticeType::aborted) {
    return {.culprit = peer,
            .kind = ErrorKind::peer_lost,
            .reporter = peer,
            .detail = "it abandoned the call after an error of its own"};
  }
  return {.culprit = notice.subject, .kind = notice.kind, .reporter = peer, .detail = {}};
}

namespace {
// How strongly a kind of failure incriminates the peer it names. A lost peer is often only a
// consequence: it aborted after finding the real culprit, or it closed its connections after
// rejecting this rank's data. Garbage and disagreement are first-hand evidence.
[[nodiscard]] int weight(ErrorKind kind) {
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
}  // namespace

std::optional<Call::Verdict> Call::verdict_from_notices() const {
  std::optional<Verdict> best;
  for (int peer = 0; peer < size_; ++peer) {
    const NoticeSlot& slot = notices_[static_cast<std::size_t>(peer)];
    if (!slot.latest || !is_terminal(slot.latest->type)) continue;
    Verdict candidate = verdict_from_notice(peer);
    if (!best || weight(candidate.kind) > weight(best->kind)) best = std::move(candidate);
  }
  if (best) return best;
  for (int peer = 0; peer < size_; ++peer) {
    const NoticeSlot& slot = notices_[static_cast<std::size_t>(peer)];
    if (slot.broken) {
      return Verdict{
          .culprit = peer, .kind = *slot.broken, .reporter = rank_, .detail = slot.broken_detail};
    }
  }
  return std::nullopt;
}

bool Call::await_notices(const std::function<bool()>& done) {
  // Bounded, so that survivors stay within 2x the timeout.
  const auto end = Clock::now() + std::min<std::chrono::milliseconds>(
                                      options_.timeout / 4, std::chrono::milliseconds{250});
  for (;;) {
    poll_notices(true);
    if (done()) return true;
    const auto now = Clock::now();
    if (now >= end) return false;
    Request* pending = nullptr;
    for (NoticeSlot& slot : notices_) {
      if (slot.pending) {
        pending = slot.request;
        break;
      }
    }
    if (pending == nullptr) return false;
    try {
      pending->wait(std::min(end, now + slice_));
    } catch (...) {
      // Sorted out by the next poll.
    }
  }
}

Call::Verdict Call::settle(Verdict current) {
  if (weight(current.kind) > weight(ErrorKind::peer_lost)) return current;
  // Give a better explanation a moment to arrive.
  std::optional<Verdict> better;
  (void)await_notices([&] {
    if (auto best = verdict_from_notices(); best && weight(best->kind) > weight(current.kind)) {
      better = std::move(best);
      return true;
    }
    return false;
  });
  return better ? *better : current;
}

Call::Verdict Call::resolve_definitive(int peer, ErrorKind kind, std::string detail) {
  poll_notices(true);
  const NoticeSlot& slot = notices_[static_cast<std::size_t>(peer)];
  if (slot.latest && is_terminal(slot.latest->type)) return settle(verdict_from_notice(peer));
  if (kind != ErrorKind::peer_lost) {
    return {.culprit = peer, .kind = kind, .reporter = rank_, .detail = std::move(detail)};
  }
  // The peer may have aborted after finding the real culprit (and its notice may have been
  // overtaken by the closing connection), or closed the connection after rejecting this rank's
  // data: prefer what the others found.
  if (auto best = verdict_from_notices(); best && best->culprit != peer) return settle(*best);
  return settle({.culprit = peer, .kind = kind, .reporter = rank_, .detail = std::move(detail)});
}

Call::Verdict Call::resolve_chain(int start, int fallback) {
  const auto grace_end = Clock::now() + options_.timeout / 2;
  const Verdict stalled{.culprit = -1,
                        .kind = ErrorKind::timeout,
                        .reporter = rank_,
                        .detail = fmt::format("no progress for {} ms", options_.timeout.count())};
  for (;;) {
    poll_notices(true);
    // Follow "X timed out waiting on Y" from `start` to the first rank that is silent or known
    // to have failed. A rank that timed out without knowing on whom (a native collective)
    // ends the chain without an answer.
    std::vector<bool> visited(static_cast<std::size_t>(size_), false);
    int previous = rank_;
    int current = start;
    while (current >= 0) {
      if (current == rank_) {
        return {.culprit = previous,
                .kind = ErrorKind::timeout,
                .reporter = rank_,
                .detail = fmt::format("peer {} timed out waiting for this rank", previous)};
      }
      const NoticeSlot& slot = notices_[static_cast<std::size_t>(current)];
      if (slot.latest && is_terminal(slot.latest->type)) return verdict_from_notice(current);
      if (slot.broken) {
        return settle({.culprit = current,
                       .kind = *slot.broken,
                       .reporter = rank_,
                       .detail = slot.broken_detail});
      }
      if (!slot.latest || slot.latest->type != NoticeType::suspect) break;
      if (visited[static_cast<std::size_t>(current)]) {
        return {.culprit = fallback,
                .kind = ErrorKind::timeout,
                .reporter = rank_,
                .detail =
                    "the ranks time out waiting on one another in a cycle (a lost message, "
                    "or a timeout shorter than one chunk's transfer)"};
      }
      visited[static_cast<std::size_t>(current)] = true;
      previous = current;
      current = slot.latest->subject == current ? -1 : slot.latest->subject;
    }
    // The candidates: the rank the chain ended at, or (without a chain) every rank that has
    // said nothing about the failure. One is the culprit once every other rank has reported,
    // or when the grace period ends.
    std::vector<int> quiet;
    if (current >= 0) {
      quiet.push_back(current);
    } else {
      for (int peer = 0; peer < size_; ++peer) {
        if (peer != rank_ && !failure_reported_by(peer)) quiet.push_back(peer);
      }
      if (quiet.empty()) {
        Verdict everyone = stalled;
        everyone.detail += " on every rank (no single peer is at fault)";
        return everyone;
      }
    }
    bool others_reported = true;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer != rank_ && peer != quiet.front() && !failure_reported_by(peer)) {
        others_reported = false;
      }
    }
    Verdict verdict = stalled;
    verdict.culprit = quiet.front();
    if (others_reported || Clock::now() >= grace_end) return verdict;
    // Wait a little for a notice: the candidate's own if it can still speak, else any.
    Request* next = nullptr;
    if (notices_[static_cast<std::size_t>(quiet.front())].pending) {
      next = notices_[static_cast<std::size_t>(quiet.front())].request;
    } else {
      for (NoticeSlot& slot : notices_) {
        if (slot.pending) {
          next = slot.request;
          break;
        }
      }
    }
    if (next == nullptr) return verdict;
    try {
      next->wait(std::min(grace_end, Clock::now() + slice_));
    } catch (...) {
      // Timeouts and failures alike: the next poll sorts them out.
    }
  }
}

void Call::send_diagnosis_header() {
  if (diagnosis_header_sent_ || size_ == 1) return;
  diagnosis_header_sent_ = true;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    try {
      failure_sends_.emplace_back(&own(transport_.isend(peer, tag(Phase::diagnosis), header_out_)),
                                  peer);
    } catch (...) {
      // Best effort: a peer that cannot be reached is found out by the others' waits.
    }
  }
}

Call::Verdict Call::diagnose_disagreement() {
  // Ranks that are waiting elsewhere in the call learn of it from this notice and diagnose too.
  send_notice(NoticeType::disagreement, ErrorKind::invalid_argument, rank_, failure_sends_);
  send_diagnosis_header();
  std::vector<Request*> receives(static_cast<std::size_t>(size_), nullptr);
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    try {
      receives[static_cast<std::size_t>(peer)] = &own(transport_.irecv(
          peer, tag(Phase::diagnosis), diagnosis_in_[static_cast<std::size_t>(peer)]));
    } catch (const Error& error) {
      return settle(
          {.culprit = peer, .kind = error.kind(), .reporter = rank_, .detail = error.message()});
    }
  }
  std::vector<Header> all = headers_;
  const auto deadline = Clock::now() + options_.timeout;
  for (;;) {
    // A rank that already knows the verdict (from a full exchange, or a finished diagnosis)
    // says so in a culprit notice; every rank computes the same one from the same headers.
    poll_notices(true);
    if (auto from_notices = verdict_from_notices();
        from_notices && weight(from_notices->kind) > weight(ErrorKind::peer_lost)) {
      return *from_notices;
    }
    int missing = -1;
    for (int peer = 0; peer < size_; ++peer) {
      Request* receive = receives[static_cast<std::size_t>(peer)];
      if (receive == nullptr) continue;
      bool complete = false;
      try {
        complete = receive->test();
      } catch (const Error& error) {
        return settle(
            {.culprit = peer, .kind = error.kind(), .reporter = rank_, .detail = error.message()});
      }
      if (complete) {
        try {
          all[static_cast<std::size_t>(peer)] =
              decode_header(diagnosis_in_[static_cast<std::size_t>(peer)], rank_, peer);
        } catch (const ProtocolError& error) {
          return {
              .culprit = peer, .kind = error.kind(), .reporter = rank_, .detail = error.message()};
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
              .reporter = rank_,
              .detail = fmt::format("its header did not arrive within {} ms of a disagreement",
                                    options_.timeout.count())};
    }
    try {
      receives[static_cast<std::size_t>(missing)]->wait(std::min(deadline, Clock::now() + slice_));
    } catch (...) {
      // Sorted out by the next test.
    }
  }
  try {
    check_all_headers(all);
  } catch (const Disagreement& d) {
    return {.culprit = d.culprit,
            .kind = d.kind,
            .reporter = rank_,
            .detail = d.detail,
            .majority = d.majority_rank};
  }
  // Unreachable when every header arrived unchanged: two neighbours disagreed.
  const int left = left_neighbour();
  return {.culprit = left,
          .kind = ErrorKind::protocol,
          .reporter = rank_,
          .detail = "its header disagreed with this rank's, but every rank's header agrees"};
}

bool Call::disagreement_announced_soon() {
  // The rank that saw the odd header sends its notice within about one hop of its arrival.
  return await_notices([this] {
    return std::any_of(notices_.begin(), notices_.end(), [](const NoticeSlot& slot) {
      return slot.latest && slot.latest->type == NoticeType::disagreement;
    });
  });
}

void Call::abort_transport(std::string_view reason) noexcept {
  if (aborted_) return;
  aborted_ = true;
  transport_.abort(reason);
}

void Call::throw_verdict(const Verdict& verdict) const {
  const std::string call =
      fmt::format("{} call #{} under tag {}", op_name(op_), sequence_, options_.tag);
  if (verdict.culprit < 0) {
    throw_kind(verdict.kind, fmt::format("{} failed: {}", call, verdict.detail), {.rank = rank_});
  }
  if (verdict.culprit == rank_ && verdict.reporter == rank_) {
    throw_kind(
        verdict.kind,
        fmt::format("{} failed: this rank disagrees with the others: {}", call, verdict.detail),
        {.rank = rank_, .peer = verdict.majority});
  }
  if (verdict.culprit == rank_) {
    // Accused by the others. Name the other end of the link that is the likely fault: for a
    // timeout, the peer this rank itself was waiting for (the others waited for this rank,
    // which waited for that peer: its messages did not arrive); else a peer that timed out
    // waiting for this rank; else the peer that reported it.
    std::string message = fmt::format("{} failed: peer {} reports that this rank failed ({})", call,
                                      verdict.reporter, error_kind_name(verdict.kind));
    int accuser = verdict.reporter;
    if (verdict.kind == ErrorKind::timeout && waiting_on_ >= 0 && waiting_on_ != rank_) {
      accuser = waiting_on_;
      message += fmt::format("; this rank was waiting for peer {}", accuser);
    } else {
      for (int peer = 0; peer < size_; ++peer) {
        if (notices_[static_cast<std::size_t>(peer)].timed_out_on_me) {
          accuser = peer;
          break;
        }
      }
      if (accuser != verdict.reporter) {
        message += fmt::format("; peer {} timed out waiting for this rank", accuser);
      }
    }
    throw_kind(verdict.kind, message, {.rank = rank_, .peer = accuser});
  }
  std::string message =
      fmt::format("{} failed: peer {} {}", call, verdict.culprit, describe(verdict.kind));
  if (verdict.reporter != rank_) message += fmt::format(" (reported by peer {})", verdict.reporter);
  if (!verdict.detail.empty()) message += fmt::format(": {}", verdict.detail);
  throw_kind(verdict.kind, message, {.rank = rank_, .peer = verdict.culprit});
}

void Call::fail() {
  const std::exception_ptr error = std::current_exception();
  failing_ = true;
  std::optional<ObservedFailure> observed;
  std::optional<Verdict> disagreement;
  bool left_disagrees = false;
  bool local = false;
  try {
    std::rethrow_exception(error);
  } catch (const ObservedFailure& failure) {
    observed = failure;
  } catch (const NoticeFailure&) {
    // Examined below.
  } catch (const LeftDisagreement&) {
    left_disagrees = true;
  } catch (const Disagreement& d) {
    disagreement = Verdict{.culprit = d.culprit,
                           .kind = d.kind,
                           .reporter = rank_,
                           .detail = d.detail,
                           .majority = d.majority_rank};
  } catch (const Error& e) {
    if (is_local_abort(e)) {
      aborted_ = true;  // someone else aborted the transport: nothing can be sent any more
      std::rethrow_exception(error);
    }
    const auto peer = e.context().peer;
    if (peer && *peer >= 0 && *peer < size_ && *peer != rank_) {
      observed.emplace(*peer, e.kind(), false, e.message());
    } else {
      local = true;
    }
  } catch (...) {
    local = true;
  }

  // Tells every peer (the culprit too: it may be alive and merely disagree), waits a little for
  // the notices to leave (not for the culprit, which may never take one), and aborts.
  const auto tell_and_abort = [&](NoticeType type, ErrorKind kind, int subject, int skip_peer,
                                  const std::string& reason) {
    send_notice(type, kind, subject, failure_sends_);
    const auto deadline =
        Clock::now() +
        std::min<std::chrono::milliseconds>(options_.timeout / 4, std::chrono::milliseconds{2'000});
    for (const auto& [request, peer] : failure_sends_) {
      if (peer == skip_peer) continue;  // a stalled culprit may never take it
      try {
        request->wait(deadline);
      } catch (...) {
        // A peer that cannot take the notice learns of the failure from its own waits.
      }
    }
    abort_transport(reason);
  };

  if (local) {
    tell_and_abort(
        NoticeType::aborted, ErrorKind::peer_lost, rank_, -1,
        fmt::format("{} call #{} abandoned after a local error", op_name(op_), sequence_));
    std::rethrow_exception(error);
  }

  // Notices that arrived complete so far may be followed by others now.
  for (int peer = 0; peer < size_; ++peer) {
    NoticeSlot& slot = notices_[static_cast<std::size_t>(peer)];
    if (peer != rank_ && !slot.pending && !slot.broken && slot.latest &&
        !is_terminal(slot.latest->type)) {
      try {
        post_notice_receive(peer);
      } catch (...) {
        // The transport is going down.
      }
    }
  }

  // A rank diagnosing a disagreement between neighbours needs every rank's header, this
  // rank's too, whatever this rank's own reason to fail.
  poll_notices(true);
  bool disagreement_reported = false;
  for (const NoticeSlot& slot : notices_) {
    if (slot.latest && slot.latest->type == NoticeType::disagreement) disagreement_reported = true;
  }
  if (disagreement || left_disagrees || disagreement_reported) send_diagnosis_header();

  Verdict verdict;
  if (disagreement) {
    verdict = *disagreement;
  } else if (left_disagrees || disagreement_reported) {
    // The disagreement explains whatever else this rank ran into (a message of the wrong size,
    // a neighbour that stopped sending).
    verdict = diagnose_disagreement();
  } else if (observed && observed->peer < 0) {
    // A native collective failed without saying on whom it waited: "suspect: unknown" (the
    // subject is the reporter itself), then find the rank that says nothing.
    send_notice(NoticeType::suspect, ErrorKind::timeout, rank_, failure_sends_);
    verdict = resolve_chain(-1, -1);
  } else if (observed && !observed->timed_out && observed->kind == ErrorKind::protocol &&
             header_exchange_ == HeaderExchange::left_neighbour &&
             observed->peer != left_neighbour() && disagreement_announced_soon()) {
    // A message of the wrong size from a peer whose header this rank never saw: that peer
    // called with another length, and the rank to its right, which checks its header, says so.
    send_diagnosis_header();
    verdict = diagnose_disagreement();
  } else if (observed && !observed->timed_out) {
    verdict = resolve_definitive(observed->peer, observed->kind, observed->detail);
  } else if (observed) {
    send_notice(NoticeType::suspect, ErrorKind::timeout, observed->peer, failure_sends_);
    verdict = resolve_chain(observed->peer, observed->peer);
  } else {
    poll_notices(true);
    if (auto from_notices = verdict_from_notices()) {
      verdict = settle(*from_notices);
    } else {
      int start = -1;
      for (int peer = 0; peer < size_ && start < 0; ++peer) {
        if (failure_reported_by(peer)) start = peer;
      }
      PULSELOCO_CHECK(start >= 0, "a notice failure without any failure notice");
      verdict = resolve_chain(start, waiting_on_ >= 0 ? waiting_on_ : start);
    }
  }

  logger().debug("{} call #{}: rank {} blames peer {} ({}), reported by {}", op_name(op_),
                 sequence_, rank_, verdict.culprit, error_kind_name(verdict.kind),
                 verdict.reporter);
  if (verdict.culprit < 0) {
    // Nobody to blame: every rank reports the same stall itself.
    abort_transport(fmt::format("{} call #{} failed: {}", op_name(op_), sequence_, verdict.detail));
    throw_verdict(verdict);
  }
  tell_and_abort(NoticeType::culprit, verdict.kind, verdict.culprit, verdict.culprit,
                 fmt::format("{} call #{} failed: peer {} {}", op_name(op_), sequence_,
                             verdict.culprit, describe(verdict.kind)));
  throw_verdict(verdict);
}

}  // namespace pulseloco::collectives::detail
