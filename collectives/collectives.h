// Collectives over any Transport: free functions taking an options struct (as in Gloo).
//
// Guarantees: every rank obtains identical bytes; a failed collective throws on every survivor
// within at most 2x options.timeout, naming the peer at fault, and leaves the caller's input
// buffers unchanged; nothing partial is returned as success.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "transport/transport.h"

namespace pulseloco::collectives {

enum class AllGatherAlgorithm : std::uint8_t {
  automatic,  // chosen from the world size and the message sizes
  ring,       // ring with pipelined chunks: each link carries every message once
  direct,     // every rank sends its message straight to every other rank
};

struct CollectiveOptions {
  std::chrono::milliseconds timeout{60'000};
  AllGatherAlgorithm algorithm = AllGatherAlgorithm::automatic;
  std::size_t pipeline_chunk_bytes = std::size_t{4} << 20;  // ring pipelining granularity
  // Tags of this call: every collective in flight at the same time needs its own base tag.
  transport::Tag tag = 0;
};

// Called as soon as rank `rank`'s complete message is available, so decoding can overlap the
// rest of the exchange. Runs on the calling thread.
using OnMessage = std::function<void(int rank, std::span<const std::byte> message)>;

// Variable-size all-gather: sizes first, then payloads. Returns every rank's message (the
// caller's own included) in rank order.
[[nodiscard]] std::vector<std::vector<std::byte>> sparse_allgather(
    transport::Transport& transport, std::span<const std::byte> mine,
    const CollectiveOptions& options, const OnMessage& on_message = {});

// Dense fp32 sum (ring reduce-scatter + all-gather, chunked); `output` receives identical
// bytes on every rank. `input` and `output` have the same size on every rank and must not
// overlap.
void allreduce_sum(transport::Transport& transport, std::span<const float> input,
                   std::span<float> output, const CollectiveOptions& options);

// Copies `root`'s `data` into every rank's `data` (same size everywhere).
void broadcast(transport::Transport& transport, int root, std::span<std::byte> data,
               const CollectiveOptions& options);

void barrier(transport::Transport& transport, const CollectiveOptions& options);

// Every rank's value in rank order (fixed-size all-gather, e.g. of digests).
[[nodiscard]] std::vector<std::uint64_t> allgather_u64(transport::Transport& transport,
                                                       std::uint64_t mine,
                                                       const CollectiveOptions& options);

}  // namespace pulseloco::collectives
