#include <pulseloco/collectives/detail/call.h>

#include <fmt/format.h>

#include <algorithm>
#include <exception>
#include <utility>

#include <pulseloco/base/log.h>

namespace pulseloco::collectives {
namespace {

thread_local double header_wait_total = 0;  // header_wait_seconds()

}  // namespace

double header_wait_seconds() noexcept {
  return header_wait_total;
}

}  // namespace pulseloco::collectives

namespace pulseloco::collectives::detail {

using transport::Clock;
using transport::Request;

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
    : context_(transport, options, op),
      headers_in_(static_cast<std::size_t>(context_.size)),
      diagnosis_(context_, requests_) {
  try {
    if (!context_.ordered) diagnosis_.post_receives();
  } catch (...) {
    diagnosis_.abort_transport(fmt::format("{} could not start", context_.describe()));
    throw;
  }
}

Call::~Call() {
  if (!finished_) diagnosis_.abort_transport(fmt::format("{} was abandoned", context_.describe()));
}

transport::NativeCollectives& Call::native_for_ordered() const {
  auto* native = transport::native_collectives(context_.transport);
  if (native == nullptr) {
    throw InvalidArgument(fmt::format("{}: the {} transport matches messages by order but has no "
                                      "native collectives",
                                      context_.describe(), context_.transport.backend()),
                          {.rank = rank()});
  }
  return *native;
}

std::span<std::byte> Call::scratch(std::size_t bytes) {
  PULSELOCO_CHECK(!scratch_, "a call takes its scratch buffer once");
  scratch_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
  return {scratch_.get(), bytes};
}

Request& Call::isend(int peer, Phase phase, std::span<const std::byte> data) {
  try {
    Request& request = requests_.own(context_.transport.isend(peer, tag(phase), data));
    sends_.emplace_back(&request, peer);
    return request;
  } catch (const Error& error) {
    throw_observed(error, peer);
  }
}

Request& Call::iforward(int peer, Phase phase, std::span<const std::byte> data,
                        const Request& earlier) {
  try {
    Request& request = requests_.own(context_.transport.iforward(peer, tag(phase), data, earlier));
    sends_.emplace_back(&request, peer);
    return request;
  } catch (const Error& error) {
    throw_observed(error, peer);
  }
}

void Call::isend_to_every_peer(Phase phase, std::span<const std::byte> data) {
  if (size() == 1) return;
  const Request& first = isend(right_neighbour(), phase, data);
  for (int distance = 2; distance < size(); ++distance)
    (void)iforward((rank() + distance) % size(), phase, data, first);
}

Request& Call::irecv(int peer, Phase phase, std::span<std::byte> data) {
  try {
    return requests_.own(context_.transport.irecv(peer, tag(phase), data));
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
  const auto step_deadline = Clock::now() + options().timeout;
  for (;;) {
    diagnosis_.poll();
    const auto slice_end = std::min(step_deadline, Clock::now() + context_.slice);
    try {
      request.wait(slice_end);
      waiting_on_ = -1;
      return;
    } catch (const TimeoutError&) {
      if (Clock::now() >= step_deadline) {
        throw ObservedFailure(
            peer, ErrorKind::timeout, true,
            fmt::format("no progress from peer {} for {} ms", peer, options().timeout.count()));
      }
      if (progress_.due()) log_progress(peer);
    } catch (const Error& error) {
      throw_observed(error, peer);
    }
  }
}

void Call::log_progress(int peer) {
  std::vector<int> not_joined;
  for (std::size_t r = 0; r < header_receives_.size(); ++r) {
    Request* receive = header_receives_[r];
    if (receive == nullptr) continue;
    bool arrived = false;
    try {
      arrived = receive->test();
    } catch (const Error&) {
      // A failed receive: the wait in progress reports it.
    }
    if (!arrived) not_joined.push_back(static_cast<int>(r));
  }
  const std::string joined =
      not_joined.empty()
          ? std::string("every peer it exchanges headers with has joined")
          : fmt::format("no header yet from {} {}", not_joined.size() == 1 ? "rank" : "ranks",
                        fmt::join(not_joined, ", "));
  logger().warn("{}: still waiting after {:.1f} s, now for rank {}; {}", context_.describe(),
                progress_.seconds(), peer, joined);
}

void Call::add_header_wait() const {
  header_wait_total += std::chrono::duration<double>(Clock::now() - started_).count();
}

void Call::run_native(const std::function<void(transport::Deadline)>& collective) {
  if (headers_pending_) (void)headers();
  diagnosis_.poll();
  try {
    collective(transport::deadline_after(options().timeout));
  } catch (const TimeoutError& error) {
    throw ObservedFailure(error.context().peer.value_or(-1), ErrorKind::timeout, true,
                          error.message());
  } catch (const Error& error) {
    if (error.kind() == ErrorKind::aborted) throw;
    throw ObservedFailure(error.context().peer.value_or(-1), error.kind(), false, error.message());
  }
}

void Call::wait_sends() {
  for (const auto& [request, peer] : sends_)
    wait(*request, peer);
  sends_.clear();
}

std::vector<Header> Call::exchange_headers(Header mine) {
  post_headers(mine);
  return headers();
}

void Call::post_headers(Header mine, std::optional<Agreement> agreement, HeaderExchange exchange) {
  const Op op = context_.op;
  mine.op = op;
  mine.sequence = sequence();
  const bool uses_options = op != Op::barrier && op != Op::allgather_u64;
  mine.chunk_bytes = uses_options ? options().pipeline_chunk_bytes : 0;
  mine.algorithm = uses_options ? options().algorithm : CollectiveAlgorithm::automatic;
  headers_.assign(static_cast<std::size_t>(size()), Header{});
  headers_[static_cast<std::size_t>(rank())] = mine;
  agreement_ = std::move(agreement);
  // Over an order-matching transport every rank checks every header itself: the failure path
  // there cannot ask the others for theirs.
  header_exchange_ = context_.ordered ? HeaderExchange::all_peers : exchange;
  headers_pending_ = true;
  header_out_ = mine.encode();
  if (size() == 1) return;

  header_receives_.assign(static_cast<std::size_t>(size()), nullptr);
  if (header_exchange_ == HeaderExchange::left_neighbour) {
    const int left = left_neighbour();
    header_receives_[static_cast<std::size_t>(left)] =
        &irecv(left, Phase::header, headers_in_[static_cast<std::size_t>(left)]);
    isend(right_neighbour(), Phase::header, header_out_);
    return;
  }
  for (int peer = 0; peer < size(); ++peer) {
    if (peer == rank()) continue;
    header_receives_[static_cast<std::size_t>(peer)] =
        &irecv(peer, Phase::header, headers_in_[static_cast<std::size_t>(peer)]);
  }
  for (int peer = 0; peer < size(); ++peer) {
    if (peer != rank()) isend(peer, Phase::header, header_out_);
  }
}

std::optional<Header> Call::matching_header_from(int peer) {
  PULSELOCO_CHECK(headers_pending_ && peer != rank(), "a pending header from a peer");
  const auto index = static_cast<std::size_t>(peer);
  wait_watching_notices(*header_receives_[index], peer);
  const Header theirs = Header::decode(headers_in_[index], rank(), peer);
  if (!same_call_and_options(theirs)) return std::nullopt;
  return theirs;
}

const std::vector<Header>& Call::headers() {
  if (!headers_pending_) return headers_;
  headers_pending_ = false;
  if (size() == 1) return headers_;
  // The left neighbour's first: it is sent whichever exchange that rank chose, and when every
  // rank's left neighbour agrees with it, all ranks agree (the ring closes).
  const int left = left_neighbour();
  const auto left_index = static_cast<std::size_t>(left);
  wait_watching_notices(*header_receives_[left_index], left);
  headers_[left_index] = Header::decode(headers_in_[left_index], rank(), left);
  // (Over an order-matching transport every header is checked below instead: no rank could
  // ask the others for theirs.)
  if (!context_.ordered && !agrees_with_mine(headers_[left_index])) throw LeftDisagreement();
  if (header_exchange_ == HeaderExchange::left_neighbour) {
    add_header_wait();
    return headers_;
  }
  for (int distance = 1; distance + 1 < size(); ++distance) {
    const int peer = (rank() + distance) % size();
    const auto index = static_cast<std::size_t>(peer);
    wait_watching_notices(*header_receives_[index], peer);
    headers_[index] = Header::decode(headers_in_[index], rank(), peer);
  }
  add_header_wait();
  // Checked once every header is in, so that every rank names the same culprit.
  check_all_headers(headers_);
  return headers_;
}

bool Call::same_call_and_options(const Header& theirs) const {
  const Header& mine = headers_[static_cast<std::size_t>(rank())];
  return theirs.op == mine.op && theirs.sequence == mine.sequence &&
         theirs.chunk_bytes == mine.chunk_bytes && theirs.algorithm == mine.algorithm;
}

bool Call::agrees_with_mine(const Header& theirs) const {
  const Header& mine = headers_[static_cast<std::size_t>(rank())];
  return same_call_and_options(theirs) &&
         (!agreement_ || agreement_->key(theirs) == agreement_->key(mine));
}

void Call::check_all_headers(const std::vector<Header>& headers) const {
  require_agreement(
      headers, ErrorKind::protocol, "the ranks called different collectives", [&](const Header& h) {
        return fmt::format("{} call #{} under tag {}", op_name(h.op), h.sequence, options().tag);
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
  const std::optional<Minority> odd = find_minority(keys);
  if (!odd) return;
  const auto culprit = static_cast<std::size_t>(odd->culprit);
  const auto majority = static_cast<std::size_t>(odd->majority_rank);
  throw Disagreement(odd->culprit, odd->majority_rank, kind,
                     fmt::format("{}: rank {} has {} while {} of {} ranks have {}", what, culprit,
                                 keys[culprit], odd->majority_count, keys.size(), keys[majority]));
}

void Call::finish() {
  if (headers_pending_) (void)headers();
  if (size() > 1) {
    // Every receive of the call is complete: "done" says that this rank has everything, so it
    // goes out at once, without waiting for this rank's last sends (the peers' own "done"
    // notices cannot come before those arrived anyway). Over an order-matching transport the
    // notices' receives are posted only now, after every other receive of the call, in the
    // order in which the peers send: the header, the payload, then "done".
    if (context_.ordered) diagnosis_.post_receives();
    diagnosis_.send_notice(NoticeType::done, ErrorKind::peer_lost, rank(), sends_);
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      while (Request* notice = diagnosis_.awaited_notice(peer)) {
        wait(*notice, peer);
        diagnosis_.poll();
      }
    }
    wait_sends();
  }
  finished_ = true;
  // Every operation of the call is complete and its tags are never used again.
  for (const Phase phase : {Phase::header, Phase::notice, Phase::payload, Phase::reduce_scatter,
                            Phase::gather, Phase::diagnosis, Phase::sizes})
    context_.transport.retire_tag(tag(phase));
}

void Call::fail() {
  diagnosis_.fail(
      std::current_exception(),
      {.header = header_out_,
       .headers = headers_,
       .left_neighbour_only = header_exchange_ == HeaderExchange::left_neighbour,
       .waiting_on = waiting_on_,
       .check_all_headers = [this](const std::vector<Header>& all) { check_all_headers(all); }});
}

}  // namespace pulseloco::collectives::detail
