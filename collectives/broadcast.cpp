// Broadcast, barrier and the fixed-size all-gather of 64-bit values. All three start with the
// header exchange of every call; the barrier and the all-gather consist of nothing else (plus
// the completion round every call ends with).
#include <fmt/format.h>

#include <algorithm>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/collectives/detail/call.h>
#include <pulseloco/collectives/detail/chunks.h>
#include <pulseloco/transport/native_collectives.h>

namespace pulseloco::collectives {

using detail::Call;
using detail::Phase;
using transport::Request;

namespace {

// The root sends every chunk straight to every rank.
void direct_broadcast(Call& call, int root, std::span<std::byte> data) {
  const int r = call.rank();
  const std::vector<detail::MessageChunk> pieces =
      detail::message_chunks(data.size(), call.options().pipeline_chunk_bytes);
  if (r == root) {
    for (const detail::MessageChunk& piece : pieces)
      call.isend_to_every_peer(Phase::payload, data.subspan(piece.offset, piece.bytes));
    return;
  }
  std::vector<Request*> receives;
  for (const detail::MessageChunk& piece : pieces) {
    receives.push_back(&call.irecv(root, Phase::payload, data.subspan(piece.offset, piece.bytes)));
  }
  for (Request* receive : receives)
    call.wait(*receive, root);
}

// Chunks travel root -> root+1 -> ... -> root-1; every rank forwards a chunk as soon as it has
// it, so all links of the chain are busy at once.
void chain_broadcast(Call& call, int root, std::span<std::byte> data) {
  const int n = call.size();
  const int r = call.rank();
  const int previous = call.left_neighbour();
  const int next = call.right_neighbour();
  const bool last = (r - root + n) % n == n - 1;
  const std::vector<detail::MessageChunk> pieces =
      detail::message_chunks(data.size(), call.options().pipeline_chunk_bytes);
  if (r == root) {
    for (const detail::MessageChunk& piece : pieces) {
      (void)call.isend(next, Phase::payload, data.subspan(piece.offset, piece.bytes));
    }
    return;
  }
  std::vector<Request*> receives;
  for (const detail::MessageChunk& piece : pieces) {
    receives.push_back(
        &call.irecv(previous, Phase::payload, data.subspan(piece.offset, piece.bytes)));
  }
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    call.wait(*receives[i], previous);
    if (!last) {
      (void)call.iforward(next, Phase::payload, data.subspan(pieces[i].offset, pieces[i].bytes),
                          *receives[i]);
    }
  }
}

}  // namespace

void broadcast(transport::Transport& transport, int root, std::span<std::byte> data,
               const CollectiveOptions& options) {
  detail::validate_options(options, transport, "broadcast");
  const int n = transport.size();
  const int r = transport.rank();
  if (root < 0 || root >= n) {
    throw InvalidArgument(
        fmt::format("broadcast: root {} is not a rank of this group of {}", root, n), {.rank = r});
  }
  detail::run_call(transport, options, detail::Op::broadcast, [&](Call& call) {
    const std::vector<detail::Header> headers =
        call.exchange_headers({.root = root, .value = data.size()});
    call.require_agreement(headers, ErrorKind::invalid_argument,
                           "broadcast needs the same root and size on every rank",
                           [](const detail::Header& h) {
                             return fmt::format("root {} and {} bytes", h.root, h.value);
                           });
    if (n == 1) return;
    if (call.ordered()) {
      transport::NativeCollectives& native = call.native_for_ordered();
      call.run_native(
          [&](transport::Deadline deadline) { native.broadcast(root, data, deadline); });
      return;
    }
    if (auto* native = transport::native_collectives(transport);
        native != nullptr && options.algorithm == CollectiveAlgorithm::automatic) {
      call.run_native(
          [&](transport::Deadline deadline) { native->broadcast(root, data, deadline); });
      return;
    }
    const bool chain = options.algorithm == CollectiveAlgorithm::ring ||
                       (options.algorithm == CollectiveAlgorithm::automatic && n > 2 &&
                        data.size() > options.pipeline_chunk_bytes);
    if (chain) {
      chain_broadcast(call, root, data);
    } else {
      direct_broadcast(call, root, data);
    }
  });
}

void barrier(transport::Transport& transport, const CollectiveOptions& options) {
  detail::validate_options(options, transport, "barrier");
  detail::run_call(transport, options, detail::Op::barrier,
                   [](Call& call) { (void)call.exchange_headers({}); });
}

std::vector<std::uint64_t> allgather_u64(transport::Transport& transport, std::uint64_t mine,
                                         const CollectiveOptions& options) {
  detail::validate_options(options, transport, "allgather_u64");
  std::vector<std::uint64_t> values(static_cast<std::size_t>(transport.size()));
  detail::run_call(transport, options, detail::Op::allgather_u64, [&](Call& call) {
    const std::vector<detail::Header> headers = call.exchange_headers({.value = mine});
    std::transform(headers.begin(), headers.end(), values.begin(),
                   [](const detail::Header& header) { return header.value; });
  });
  return values;
}

}  // namespace pulseloco::collectives
