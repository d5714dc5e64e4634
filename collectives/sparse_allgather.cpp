// Variable-size all-gather: the header exchange carries every rank's message size, then the
// payloads move by one of two algorithms.
//
// ring:   rank r sends to r+1 and receives from r-1. Messages travel in chunks of
//         pipeline_chunk_bytes; a rank forwards each chunk of another rank's message as soon as
//         it has arrived, so all links are busy at once. Every link carries each message once
//         (except the message of the rank it leads to): the busiest link moves
//         sum(sizes) - size(next rank). Latency: world_size - 1 hops.
// direct: every rank sends its message, chunk by chunk, straight to every other rank. A rank's
//         uplink carries (world_size - 1) x its own message; one hop.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/collectives/detail/call.h>
#include <pulseloco/collectives/detail/chunks.h>
#include <pulseloco/transport/native_collectives.h>

namespace pulseloco::collectives {

using detail::Call;
using detail::Phase;
using transport::Request;

std::string_view algorithm_name(CollectiveAlgorithm algorithm) noexcept {
  switch (algorithm) {
    case CollectiveAlgorithm::automatic:
      return "automatic";
    case CollectiveAlgorithm::ring:
      return "ring";
    case CollectiveAlgorithm::direct:
      return "direct";
  }
  return "unknown";
}

namespace {
// The rule of `automatic` (docs/collectives.md); the measurements behind it are in
// docs/benchmarks.md ("Why these defaults").
constexpr std::uint64_t kLatencyBoundBytes = std::uint64_t{32} << 10;
}  // namespace

CollectiveAlgorithm choose_allgather_algorithm(std::span<const std::uint64_t> sizes) {
  // Two ranks: both algorithms move exactly the same bytes in one hop.
  if (sizes.size() <= 2) return CollectiveAlgorithm::direct;
  // Small messages are latency-bound: one hop beats world_size - 1 hops.
  const std::uint64_t largest = *std::max_element(sizes.begin(), sizes.end());
  if (largest <= kLatencyBoundBytes) return CollectiveAlgorithm::direct;
  // Bandwidth-bound: the ring keeps one flow per link (no incast of world_size - 1 senders
  // into one link) and spreads a large message over every link instead of making its owner
  // send it world_size - 1 times.
  return CollectiveAlgorithm::ring;
}

namespace {

// A piece of one rank's message.
struct MessagePiece : detail::MessageChunk {
  int origin = 0;
};

void append_chunks(std::vector<MessagePiece>& out, int origin, std::uint64_t size,
                   std::size_t chunk) {
  for (const detail::MessageChunk& piece : detail::message_chunks(size, chunk))
    out.push_back({piece, origin});
}

// The exchange's first step, posted while the headers travel, so that exchanging the sizes
// costs no round of its own: under both algorithms the first messages between neighbours are
// this rank's own message to its right neighbour and the left neighbour's own message to this
// rank. The first needs nothing from the others; the receives of the second are posted as soon
// as the left neighbour's header tells its size (and agrees with this rank's options: otherwise
// headers() reports the disagreement).
struct FirstStep {
  std::vector<Request*> sent;      // this rank's chunks to rank + 1, in order
  std::vector<Request*> received;  // the left neighbour's chunks, in order
  bool left_posted = false;        // `received` holds all of them
};

// Where the collective stores rank `peer`'s message of `size` bytes (a size the caller has
// checked against max_message_bytes): asks the caller, once per rank, and checks the buffer.
using BufferOf = std::function<void(int peer, std::uint64_t size)>;

// This rank's message to its right neighbour, chunk by chunk: the requests in order.
std::vector<Request*> send_own_to_right(Call& call, std::span<const std::byte> mine) {
  std::vector<MessagePiece> own;
  append_chunks(own, call.rank(), mine.size(), call.options().pipeline_chunk_bytes);
  std::vector<Request*> sent;
  sent.reserve(own.size());
  const int right = call.right_neighbour();
  for (const MessagePiece& piece : own)
    sent.push_back(&call.isend(right, Phase::payload, mine.subspan(piece.offset, piece.bytes)));
  return sent;
}

// While the headers are pending: posts the left neighbour's receives once its header alone is
// in, if that header matches this call and announces at most max_message_bytes.
void post_left_early(Call& call, const BufferOf& buffer_of,
                     const std::vector<std::span<std::byte>>& buffers, FirstStep& first) {
  const int left = call.left_neighbour();
  const std::optional<detail::Header> header = call.matching_header_from(left);
  if (!header || header->value > call.options().max_message_bytes) return;
  buffer_of(left, header->value);
  std::vector<MessagePiece> theirs;
  append_chunks(theirs, left, header->value, call.options().pipeline_chunk_bytes);
  const auto& buffer = buffers[static_cast<std::size_t>(left)];
  for (const MessagePiece& piece : theirs) {
    first.received.push_back(
        &call.irecv(left, Phase::payload, buffer.subspan(piece.offset, piece.bytes)));
  }
  first.left_posted = true;
}

// Both algorithms call `deliver_own` once their sends are posted: copying this rank's message
// into its slot then overlaps with the transfers instead of delaying them.
void ring_allgather(Call& call, const FirstStep& first, const std::vector<std::uint64_t>& sizes,
                    const std::vector<std::span<std::byte>>& buffers, const OnMessage& on_message,
                    const std::function<void()>& deliver_own) {
  const int n = call.size();
  const int r = call.rank();
  const int left = call.left_neighbour();
  const int right = call.right_neighbour();
  const std::size_t chunk = call.options().pipeline_chunk_bytes;

  // From the left come the messages of r-1, r-2, ..., r+1, in that order; the first is posted
  // already (first.received) when its size was known early.
  std::vector<MessagePiece> incoming;
  for (int step = 1; step < n; ++step) {
    const int origin = (r - step + n) % n;
    append_chunks(incoming, origin, sizes[static_cast<std::size_t>(origin)], chunk);
  }
  std::vector<Request*> receives;
  receives.reserve(incoming.size());
  if (first.left_posted) receives = first.received;
  for (std::size_t i = receives.size(); i < incoming.size(); ++i) {
    const MessagePiece& piece = incoming[i];
    receives.push_back(&call.irecv(
        left, Phase::payload,
        buffers[static_cast<std::size_t>(piece.origin)].subspan(piece.offset, piece.bytes)));
  }
  // This rank's own message is on its way (first.sent).
  deliver_own();
  // Forward everything except the right neighbour's own message.
  for (std::size_t i = 0; i < incoming.size(); ++i) {
    const MessagePiece& piece = incoming[i];
    call.wait(*receives[i], left);
    const auto& buffer = buffers[static_cast<std::size_t>(piece.origin)];
    if (piece.origin != right) {
      (void)call.iforward(right, Phase::payload, buffer.subspan(piece.offset, piece.bytes),
                          *receives[i]);
    }
    if (on_message && piece.last_of(sizes[static_cast<std::size_t>(piece.origin)])) {
      on_message(piece.origin, buffer);
    }
  }
}

void direct_allgather(Call& call, std::span<const std::byte> mine, const FirstStep& first,
                      const std::vector<std::uint64_t>& sizes,
                      const std::vector<std::span<std::byte>>& buffers, const OnMessage& on_message,
                      const std::function<void()>& deliver_own) {
  const int n = call.size();
  const int r = call.rank();
  const int left = call.left_neighbour();
  const std::size_t chunk = call.options().pipeline_chunk_bytes;

  std::vector<std::vector<MessagePiece>> pieces(static_cast<std::size_t>(n));
  std::vector<std::vector<Request*>> receives(static_cast<std::size_t>(n));
  std::size_t rounds = 0;
  for (int distance = 1; distance < n; ++distance) {
    const int peer = (r + distance) % n;
    const auto index = static_cast<std::size_t>(peer);
    append_chunks(pieces[index], peer, sizes[index], chunk);
    if (peer == left && first.left_posted) {
      receives[index] = first.received;
    } else {
      for (const MessagePiece& piece : pieces[index]) {
        receives[index].push_back(
            &call.irecv(peer, Phase::payload, buffers[index].subspan(piece.offset, piece.bytes)));
      }
    }
    rounds = std::max(rounds, pieces[index].size());
  }
  std::vector<MessagePiece> own;
  append_chunks(own, r, mine.size(), chunk);
  rounds = std::max(rounds, own.size());
  // The right neighbour has every chunk already (first.sent); the other peers get them chunk by
  // chunk in turn, so that they progress together, and the transport checksums each chunk once
  // (iforward of the first send).
  for (std::size_t i = 0; i < own.size(); ++i) {
    const auto bytes = mine.subspan(own[i].offset, own[i].bytes);
    for (int distance = 2; distance < n; ++distance)
      (void)call.iforward((r + distance) % n, Phase::payload, bytes, *first.sent[i]);
  }
  deliver_own();
  for (std::size_t round = 0; round < rounds; ++round) {
    for (int distance = 1; distance < n; ++distance) {
      const int peer = (r + distance) % n;
      const auto index = static_cast<std::size_t>(peer);
      if (round >= pieces[index].size()) continue;
      call.wait(*receives[index][round], peer);
      if (on_message && pieces[index][round].last_of(sizes[index])) {
        on_message(peer, buffers[index]);
      }
    }
  }
}

// The transport's own all-gather (MPI's), when it has one: returns false when it declines.
bool native_allgather(Call& call, transport::NativeCollectives& native,
                      std::span<const std::byte> mine, const std::vector<std::uint64_t>& sizes,
                      const std::vector<std::span<std::byte>>& buffers,
                      const OnMessage& on_message) {
  const int n = call.size();
  const int r = call.rank();
  std::vector<std::size_t> offsets(static_cast<std::size_t>(n));
  std::size_t total = 0;
  for (int rank = 0; rank < n; ++rank) {
    offsets[static_cast<std::size_t>(rank)] = total;
    total += static_cast<std::size_t>(sizes[static_cast<std::size_t>(rank)]);
  }
  if (total == 0) return true;  // nothing moves (the same decision on every rank)
  // Straight into the caller's buffers when they lie back to back in rank order.
  std::byte* base =
      buffers[static_cast<std::size_t>(r)].data() - offsets[static_cast<std::size_t>(r)];
  bool contiguous = !mine.empty();
  for (int rank = 0; rank < n && contiguous; ++rank) {
    const auto index = static_cast<std::size_t>(rank);
    if (sizes[index] > 0 && buffers[index].data() != base + offsets[index]) contiguous = false;
  }
  std::span<std::byte> out;
  if (contiguous) {
    out = std::span(base, total);
  } else {
    out = call.scratch(total);
  }
  bool done = false;
  call.run_native(
      [&](transport::Deadline deadline) { done = native.allgatherv(mine, sizes, out, deadline); });
  if (!done) return false;
  for (int rank = 0; rank < n; ++rank) {
    const auto index = static_cast<std::size_t>(rank);
    if (rank == r || sizes[index] == 0) continue;
    if (!contiguous) {
      std::memcpy(buffers[index].data(), out.data() + offsets[index], buffers[index].size());
    }
    if (on_message) on_message(rank, buffers[index]);
  }
  return true;
}

// Over an order-matching transport (NCCL) the transport's all-gather moves every message, this
// rank's own into its slot too, so that messages in device memory are never touched on the
// host here; the callbacks run once it has returned, this rank's own first.
void ordered_allgather(Call& call, std::span<const std::byte> mine,
                       const std::vector<std::uint64_t>& sizes,
                       const std::vector<std::span<std::byte>>& buffers,
                       const OnMessage& on_message) {
  const int r = call.rank();
  if (std::any_of(sizes.begin(), sizes.end(), [](std::uint64_t size) { return size > 0; })) {
    transport::NativeCollectives& native = call.native_for_ordered();
    bool done = false;
    call.run_native([&](transport::Deadline deadline) {
      done = native.allgather_into(mine, buffers, deadline);
    });
    if (!done) {
      throw InvalidArgument(
          "sparse_allgather: this order-matching transport does not offer allgather_into",
          {.rank = r});
    }
  }
  if (!on_message) return;
  on_message(r, buffers[static_cast<std::size_t>(r)]);
  for (int peer = 0; peer < call.size(); ++peer) {
    if (peer != r && sizes[static_cast<std::size_t>(peer)] == 0) on_message(peer, {});
  }
  for (int peer = 0; peer < call.size(); ++peer) {
    if (peer != r && sizes[static_cast<std::size_t>(peer)] > 0)
      on_message(peer, buffers[static_cast<std::size_t>(peer)]);
  }
}

}  // namespace

void sparse_allgather_into(transport::Transport& transport, std::span<const std::byte> mine,
                           const MessageBuffer& buffer_for, const CollectiveOptions& options,
                           const OnMessage& on_message) {
  detail::validate_options(options, transport, "sparse_allgather");
  const int n = transport.size();
  const int r = transport.rank();
  if (!buffer_for) {
    throw InvalidArgument("sparse_allgather: no MessageBuffer callback", {.rank = r});
  }
  if (mine.size() > options.max_message_bytes) {
    throw InvalidArgument(fmt::format("sparse_allgather: this rank's message of {} bytes exceeds "
                                      "max_message_bytes {}",
                                      mine.size(), options.max_message_bytes),
                          {.rank = r});
  }
  std::vector<std::span<std::byte>> buffers(static_cast<std::size_t>(n));
  auto* const native = transport::native_collectives(transport);
  const bool ordered = transport.matches_by_order();
  const bool use_native =
      !ordered && native != nullptr && options.algorithm == CollectiveAlgorithm::automatic;
  detail::run_call(transport, options, detail::Op::sparse_allgather, [&](Call& call) {
    const BufferOf buffer_of = [&](int peer, std::uint64_t size) {
      const auto index = static_cast<std::size_t>(peer);
      buffers[index] = buffer_for(peer, static_cast<std::size_t>(size));
      if (buffers[index].size() != size) {
        throw InvalidArgument(fmt::format("sparse_allgather: the buffer for rank {}'s message "
                                          "has {} bytes where {} are needed",
                                          peer, buffers[index].size(), size),
                              {.rank = r});
      }
    };
    call.post_headers({.value = mine.size()});
    FirstStep first;
    if (n > 1 && !use_native && !ordered) {
      first.sent = send_own_to_right(call, mine);
      post_left_early(call, buffer_of, buffers, first);
    }
    const std::vector<detail::Header>& headers = call.headers();
    std::vector<std::uint64_t> sizes(static_cast<std::size_t>(n));
    for (int peer = 0; peer < n; ++peer) {
      const std::uint64_t size = headers[static_cast<std::size_t>(peer)].value;
      if (size > options.max_message_bytes) {
        throw ProtocolError(fmt::format("sparse_allgather: peer {} announces a message of {} "
                                        "bytes, above max_message_bytes {}",
                                        peer, size, options.max_message_bytes),
                            {.rank = r, .peer = peer});
      }
      sizes[static_cast<std::size_t>(peer)] = size;
    }
    const int left = call.left_neighbour();
    for (int peer = 0; peer < n; ++peer) {
      if (peer == left && first.left_posted) continue;  // asked for already
      buffer_of(peer, sizes[static_cast<std::size_t>(peer)]);
    }
    if (ordered) {
      ordered_allgather(call, mine, sizes, buffers, on_message);
      return;
    }
    // This rank's message into its slot, and the callbacks for it and for the empty messages
    // (before those of the other messages).
    bool own_delivered = false;
    const auto deliver_own = [&] {
      if (own_delivered) return;
      own_delivered = true;
      if (!mine.empty())
        std::memcpy(buffers[static_cast<std::size_t>(r)].data(), mine.data(), mine.size());
      if (on_message) {
        on_message(r, buffers[static_cast<std::size_t>(r)]);
        for (int peer = 0; peer < n; ++peer) {
          if (peer != r && sizes[static_cast<std::size_t>(peer)] == 0) on_message(peer, {});
        }
      }
    };
    if (n == 1) {
      deliver_own();
      return;
    }
    if (use_native) {
      deliver_own();  // the native call fills only the other slots (ours, if it declines)
      if (native_allgather(call, *native, mine, sizes, buffers, on_message)) return;
    }
    const CollectiveAlgorithm algorithm = options.algorithm == CollectiveAlgorithm::automatic
                                              ? choose_allgather_algorithm(sizes)
                                              : options.algorithm;
    // Had the native all-gather declined, nothing went out yet: this rank's first sends now
    // (every receive is posted with the others).
    if (use_native) first.sent = send_own_to_right(call, mine);
    if (algorithm == CollectiveAlgorithm::ring) {
      ring_allgather(call, first, sizes, buffers, on_message, deliver_own);
    } else {
      direct_allgather(call, mine, first, sizes, buffers, on_message, deliver_own);
    }
  });
}

MessageBuffer store_in(std::vector<std::vector<std::byte>>& messages) {
  return [&messages](int rank, std::size_t bytes) {
    auto& message = messages.at(static_cast<std::size_t>(rank));
    message.resize(bytes);
    return std::span<std::byte>(message);
  };
}

std::vector<std::vector<std::byte>> sparse_allgather(transport::Transport& transport,
                                                     std::span<const std::byte> mine,
                                                     const CollectiveOptions& options,
                                                     const OnMessage& on_message) {
  std::vector<std::vector<std::byte>> messages(static_cast<std::size_t>(transport.size()));
  sparse_allgather_into(transport, mine, store_in(messages), options, on_message);
  return messages;
}

}  // namespace pulseloco::collectives
