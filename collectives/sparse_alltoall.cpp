// Variable-size all-to-all: every rank sends one message to every rank and receives one from
// every rank. Each message goes straight from its sender to its receiver, in chunks of
// pipeline_chunk_bytes (one hop; a rank's uplink carries the sum of its messages to the others).
//
// The sizes travel beside the header: with its header a rank sends each peer the size of the
// message meant for it, so the exchange costs no round of its own. The payload sends are posted
// at once (they read only the caller's input); a peer's receives are posted once its header is
// checked and its size is known.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/collectives/detail/call.h>
#include <pulseloco/collectives/detail/chunks.h>

namespace pulseloco::collectives {

using detail::Call;
using detail::Phase;
using transport::Request;

void sparse_alltoall(transport::Transport& transport,
                     std::span<const std::span<const std::byte>> to_rank,
                     const MessageBuffer& buffer_for, const CollectiveOptions& options,
                     const OnMessage& on_message) {
  detail::validate_options(options, transport, "sparse_alltoall");
  const int n = transport.size();
  const int r = transport.rank();
  if (!buffer_for) throw InvalidArgument("sparse_alltoall: no MessageBuffer callback", {.rank = r});
  if (to_rank.size() != static_cast<std::size_t>(n)) {
    throw InvalidArgument(
        fmt::format("sparse_alltoall: {} messages given for a group of {}", to_rank.size(), n),
        {.rank = r});
  }
  for (int peer = 0; peer < n; ++peer) {
    const std::size_t size = to_rank[static_cast<std::size_t>(peer)].size();
    if (size > options.max_message_bytes) {
      throw InvalidArgument(fmt::format("sparse_alltoall: this rank's message to rank {} of {} "
                                        "bytes exceeds max_message_bytes {}",
                                        peer, size, options.max_message_bytes),
                            {.rank = r});
    }
  }
  if (transport.matches_by_order()) {
    // Its messages match by posting order, and it moves payloads only through its native
    // collectives, which have no all-to-all here.
    throw InvalidArgument(
        "sparse_alltoall: the transport matches messages by order (NCCL); it has no all-to-all",
        {.rank = r});
  }
  std::vector<std::span<std::byte>> buffers(static_cast<std::size_t>(n));
  detail::run_call(transport, options, detail::Op::sparse_alltoall, [&](Call& call) {
    std::uint64_t total = 0;
    for (const auto& message : to_rank)
      total += message.size();
    call.post_headers({.value = total});
    // Sizes out and in, 8 bytes per peer each.
    const std::span<std::byte> sizes = call.scratch(16 * static_cast<std::size_t>(n));
    std::vector<Request*> size_receives(static_cast<std::size_t>(n), nullptr);
    for (int distance = 1; distance < n; ++distance) {
      const int peer = (r + distance) % n;
      const auto index = static_cast<std::size_t>(peer);
      store_le<std::uint64_t>(sizes.data() + 8 * index, to_rank[index].size());
      (void)call.isend(peer, Phase::sizes, sizes.subspan(8 * index, 8));
      size_receives[index] = &call.irecv(peer, Phase::sizes, sizes.subspan(8 * (n + index), 8));
    }
    const std::size_t chunk = options.pipeline_chunk_bytes;
    for (int distance = 1; distance < n; ++distance) {
      const int peer = (r + distance) % n;
      const auto& message = to_rank[static_cast<std::size_t>(peer)];
      for (const detail::MessageChunk& piece : detail::message_chunks(message.size(), chunk))
        (void)call.isend(peer, Phase::payload, message.subspan(piece.offset, piece.bytes));
    }
    (void)call.headers();

    std::vector<std::uint64_t> incoming(static_cast<std::size_t>(n), 0);
    std::vector<std::vector<Request*>> receives(static_cast<std::size_t>(n));
    std::size_t rounds = 0;
    for (int distance = 1; distance < n; ++distance) {
      const int peer = (r + distance) % n;
      const auto index = static_cast<std::size_t>(peer);
      call.wait(*size_receives[index], peer);
      const std::uint64_t size = load_le<std::uint64_t>(sizes.data() + 8 * (n + index));
      if (size > options.max_message_bytes) {
        throw ProtocolError(fmt::format("sparse_alltoall: peer {} announces a message of {} bytes, "
                                        "above max_message_bytes {}",
                                        peer, size, options.max_message_bytes),
                            {.rank = r, .peer = peer});
      }
      incoming[index] = size;
      buffers[index] = buffer_for(peer, static_cast<std::size_t>(size));
      if (buffers[index].size() != size) {
        throw InvalidArgument(fmt::format("sparse_alltoall: the buffer for rank {}'s message has "
                                          "{} bytes where {} are needed",
                                          peer, buffers[index].size(), size),
                              {.rank = r});
      }
      for (const detail::MessageChunk& piece : detail::message_chunks(size, chunk)) {
        receives[index].push_back(
            &call.irecv(peer, Phase::payload, buffers[index].subspan(piece.offset, piece.bytes)));
      }
      rounds = std::max(rounds, receives[index].size());
    }
    // This rank's message to itself, and the callbacks for it and for empty messages.
    const auto own = static_cast<std::size_t>(r);
    buffers[own] = buffer_for(r, to_rank[own].size());
    if (buffers[own].size() != to_rank[own].size()) {
      throw InvalidArgument(
          fmt::format("sparse_alltoall: the buffer for this rank's own message has {} bytes "
                      "where {} are needed",
                      buffers[own].size(), to_rank[own].size()),
          {.rank = r});
    }
    if (!to_rank[own].empty())
      std::memcpy(buffers[own].data(), to_rank[own].data(), to_rank[own].size());
    if (on_message) {
      on_message(r, buffers[own]);
      for (int peer = 0; peer < n; ++peer) {
        if (peer != r && incoming[static_cast<std::size_t>(peer)] == 0) on_message(peer, {});
      }
    }
    // Chunk by chunk across the peers, so that they progress together.
    for (std::size_t round = 0; round < rounds; ++round) {
      for (int distance = 1; distance < n; ++distance) {
        const int peer = (r + distance) % n;
        const auto index = static_cast<std::size_t>(peer);
        if (round >= receives[index].size()) continue;
        call.wait(*receives[index][round], peer);
        if (on_message && round + 1 == receives[index].size()) on_message(peer, buffers[index]);
      }
    }
  });
}

}  // namespace pulseloco::collectives
