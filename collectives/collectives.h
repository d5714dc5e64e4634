// Collectives over any Transport: free functions taking an options struct (as in Gloo).
//
// Guarantees: every rank obtains identical bytes; a failed collective throws on every survivor
// within at most 2x options.timeout, naming the peer at fault, and leaves the caller's input
// buffers unchanged; nothing partial is returned as success.
//
// How a call runs (docs/collectives.md has the details):
// - Every call first exchanges a small header with every peer (which collective, its call
//   number, the options that must agree, and the sizes; the all-reduce with its right
//   neighbour only, which suffices there), then moves its payload, then ends with a completion
//   round: a rank returns success only once every rank has received everything.
// - Every call has its own tags: (options.tag, the call's sequence number under that tag, the
//   phase), so messages of a failed call can never be taken for a later call's.
// - When the transport has native collectives (transport/native_collectives.h: MPI) and the
//   algorithm is `automatic`, sparse_allgather's and broadcast's payload moves through them.
// - options.timeout bounds every single wait: for one chunk from one peer, for one send to be
//   taken by its peer, for one peer's completion notice (a native collective is one wait). It must
//   exceed the time one pipeline chunk needs on the slowest link (for `direct`, world_size - 1
//   chunks share a link). A dead peer is usually noticed at once (its connections close); a stalled
//   one after the timeout.
// - Failure: the rank that notices a failure tells every other rank which peer failed (a
//   failure notice), so ranks that were waiting on healthy neighbours blame the right peer;
//   ranks that time out in a chain of waits follow the chain to the silent rank. Every
//   survivor throws within 2x options.timeout of the fault: PeerLostError (the peer died or
//   closed), TimeoutError (it stopped responding), ProtocolError (it sent invalid data) or
//   InvalidArgument (the ranks' arguments disagree), with ErrorContext::peer = the culprit.
// - After a collective has thrown, its transport has been aborted (pending operations cannot
//   be cancelled safely any other way): build a new transport to continue, as with NCCL's
//   ncclCommAbort or Gloo's context. Arguments that are invalid on the calling rank alone throw
//   InvalidArgument before anything is sent and leave the transport usable.
// - Order-matching transports (Transport::matches_by_order(): NCCL, and the in-process double
//   transport/inproc/ordered.h that stands in for it in the tests). There messages between two
//   ranks match by posting order whatever their tags, and an operation completes only with
//   the group it was launched in. A call then posts, with every peer and in this order on
//   both sides: the header (to and from every peer, the all-reduce too), then the payload
//   through the transport's native collectives (native_collectives.h; options.algorithm and
//   pipeline_chunk_bytes do not apply, they must still agree), then the completion round's
//   "done" notices, whose receives are posted only then. This ordering is what such a
//   transport may rely on; the collectives guarantee it. Calls on one such transport run one at
//   a time (different base tags do not separate concurrent calls there). No failure notice is
//   sent (it would be taken for the next message the peer expects): every rank checks every
//   header itself, so a disagreement names the same culprit everywhere, and otherwise each
//   survivor throws within options.timeout of its own wait, naming the peer it waited on
//   (operations launched together complete together, so the silent rank may be another peer
//   of that group; a native collective's timeout names none). The caller then aborts
//   (ncclCommAbort).
// - Buffers may be device memory when the transport's buffer_device() is a GPU (NCCL): the
//   collectives then never read or write payload bytes on the host (the native collectives
//   move them, the caller's own message included); headers and notices stay in host memory,
//   which the transport stages.
// - Edge case inherent to any protocol: if a rank fails during the final completion round,
//   ranks that already received every completion notice return success while the others
//   throw. The data phase had completed everywhere by then.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include <pulseloco/transport/transport.h>

namespace pulseloco::collectives {

// How sparse_allgather, allreduce_sum and broadcast move their payload (each says what the
// two mean for it).
enum class CollectiveAlgorithm : std::uint8_t {
  automatic,  // chosen from the world size and the sizes
  ring,       // ring (a chain for broadcast) with pipelined chunks: one flow per link
  direct,     // every rank sends straight to every rank that needs its bytes: one hop
};

[[nodiscard]] std::string_view algorithm_name(CollectiveAlgorithm algorithm) noexcept;

// Base tags must be below this (the rest of the 64-bit transport tag holds the call's sequence
// number and phase).
inline constexpr transport::Tag kTagLimit = transport::Tag{1} << 23;

struct CollectiveOptions {
  std::chrono::milliseconds timeout{60'000};
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::automatic;
  // Pipelining granularity (and the unit a single wait covers). The ring's pipeline fills in
  // world_size - 2 chunk times, so smaller chunks suit slow links; 1 MiB costs nothing
  // measurable on fast ones (docs/benchmarks.md, "Why these defaults").
  std::size_t pipeline_chunk_bytes = std::size_t{1} << 20;
  // Tags of this call: every collective in flight at the same time needs its own base tag.
  transport::Tag tag = 0;
  // The largest message a peer may announce in sparse_allgather; a larger size is a protocol
  // violation by that peer (it guards this rank's memory).
  std::uint64_t max_message_bytes = std::uint64_t{1} << 36;
};

// Called as soon as rank `rank`'s complete message is available, so decoding can overlap the
// rest of the exchange. Runs on the calling thread, exactly once per rank (the caller's own
// rank included, first), in any order. The bytes are tentative until the collective returns:
// if it throws, callbacks may already have run for some ranks.
// The bytes live where the caller's buffers do: device memory for a GPU transport given device
// buffers (then only device code may read them). Over an order-matching transport every
// callback runs after the native all-gather has returned.
using OnMessage = std::function<void(int rank, std::span<const std::byte> message)>;

// Variable-size all-gather: sizes first, then payloads. Returns every rank's message (the
// caller's own included) in rank order.
[[nodiscard]] std::vector<std::vector<std::byte>> sparse_allgather(
    transport::Transport& transport, std::span<const std::byte> mine,
    const CollectiveOptions& options, const OnMessage& on_message = {});

// Where rank `rank`'s message of `bytes` bytes is to be stored: a buffer of exactly `bytes`
// bytes that stays valid and untouched by the caller until the collective returns.
using MessageBuffer = std::function<std::span<std::byte>(int rank, std::size_t bytes)>;

// A MessageBuffer that stores rank r's message in messages[r], resized to its size (`messages`
// holds one vector per rank and outlives the collective).
[[nodiscard]] MessageBuffer store_in(std::vector<std::vector<std::byte>>& messages);

// The same exchange into storage the caller provides (a reusable arena avoids allocating and
// first-touching fresh pages on every call). Over a GPU transport `mine` and the buffers may be
// device memory (moved device to device) or host memory (staged by the transport). `buffer_for` is
// called on the calling thread once per rank, as soon as that rank's size is known and before its
// message is received: the left neighbour's (rank - 1) first, as soon as its header is in, then the
// others in rank order once every header is; over an order-matching transport, all in rank order
// once every header is in; the caller's own message is copied into its buffer. On failure the
// buffers hold garbage.
void sparse_allgather_into(transport::Transport& transport, std::span<const std::byte> mine,
                           const MessageBuffer& buffer_for, const CollectiveOptions& options,
                           const OnMessage& on_message = {});

// Which node every rank runs on: node_of_rank[r] is rank r's node, any non-negative number
// (equal numbers, equal node). A node's ranks need not be contiguous and nodes may differ in
// size. Its local ranks are its ranks in ascending order; nodes are ordered by their lowest rank.
struct NodeLayout {
  std::vector<int> node_of_rank;
};

// sparse_allgather_into for ranks grouped in nodes whose links to each other are the slow
// part: every rank still obtains every rank's exact message, but each message crosses into
// each other node once instead of once per rank there (docs/collectives.md, "The node-aware
// all-gather"). Step 1: rail l (the l-th local rank of every node; a node with G ranks puts its
// local rank l mod G there, with an empty message when l >= G) runs sparse_allgather; step 2:
// the ranks of each node all-gather what their rails brought (a bundle per rank, framed with
// its messages' sizes); a completion round over the whole group ends the call.
//
// Every rank passes the same layout (checked first, with one allgather_u64: InvalidArgument
// naming the rank that disagrees); a layout of the wrong size or with a negative node is
// refused before anything is sent. Not over an order-matching transport (InvalidArgument).
// buffer_for runs on the calling thread once per rank, before that rank's message is stored
// (in step 1 as its rail's all-gather asks, in step 2 as bundles arrive); on_message runs once
// per rank, the own message first, then each other rank's as it arrives in step 1 or step 2.
// Failure rules as for every collective, with ranks named in `transport`'s numbering. Calls
// under options.tag draw several sequence numbers (one per rail and step): every rank must make
// the same calls, as always.
void sparse_allgather_nodes(transport::Transport& transport, const NodeLayout& layout,
                            std::span<const std::byte> mine, const MessageBuffer& buffer_for,
                            const CollectiveOptions& options, const OnMessage& on_message = {});

// The same, returning every rank's message in rank order.
[[nodiscard]] std::vector<std::vector<std::byte>> sparse_allgather_nodes(
    transport::Transport& transport, const NodeLayout& layout, std::span<const std::byte> mine,
    const CollectiveOptions& options, const OnMessage& on_message = {});

// Variable-size all-to-all: `to_rank[p]` is this rank's message for rank p (its own included,
// delivered by a copy); rank p's message for this rank is stored where buffer_for(p, size) says,
// called once per rank on the calling thread as soon as that size is known. The sizes travel
// beside the header round, and every message goes straight from its sender to its receiver in
// chunks of pipeline_chunk_bytes (options.algorithm must agree but does not change this).
// `on_message` runs once per rank as its message completes (the own one first). Failure rules
// as for every collective; not over an order-matching transport (InvalidArgument).
void sparse_alltoall(transport::Transport& transport,
                     std::span<const std::span<const std::byte>> to_rank,
                     const MessageBuffer& buffer_for, const CollectiveOptions& options,
                     const OnMessage& on_message = {});

// The algorithm `automatic` picks for these message sizes (one per rank, in rank order); every
// rank computes the same choice from the same sizes. The rule is explained in
// docs/collectives.md, the measurements behind it are in docs/benchmarks.md.
[[nodiscard]] CollectiveAlgorithm choose_allgather_algorithm(std::span<const std::uint64_t> sizes);

// Dense fp32 sum (reduce-scatter + all-gather, chunked); `output` receives identical bytes on
// every rank. `input` and `output` have the same size on every rank and must not overlap.
//
// Summation order: the vector is cut into world_size near-equal segments; segment g is summed
// left to right in ring order starting at rank g, ((x_g + x_{g+1}) + x_{g+2}) + ... +
// x_{g-1}, in plain fp32 additions, by the rank that finishes it, and every other rank copies
// those bytes. The result therefore depends only on the inputs and the world size, never on
// the algorithm. On failure `output` holds garbage; `input` is never written.
//
// Algorithms (options.algorithm): `ring` passes partial sums around the ring (2 (n-1) hops);
// `direct` sends every segment straight to the rank that finishes it and the finished segment
// straight to every rank (2 hops, the same bytes per link, plus a receive buffer of (n-1)/n of
// the vector); `automatic` picks with choose_allreduce_algorithm.
//
// Over an order-matching transport (NCCL) the transport's own all-reduce runs instead
// (NativeCollectives::allreduce_sum, ncclAllReduce): every rank still gets the same bytes, but
// in NCCL's summation order, not the one above (so a group's result depends on its backend).
void allreduce_sum(transport::Transport& transport, std::span<const float> input,
                   std::span<float> output, const CollectiveOptions& options);

// The algorithm `automatic` picks for an all-reduce of `elements` floats over `world_size`
// ranks (the same choice on every rank). The rule is explained in docs/collectives.md, the
// measurements behind it are in docs/benchmarks.md.
[[nodiscard]] CollectiveAlgorithm choose_allreduce_algorithm(std::size_t elements, int world_size);
// The largest vector, in bytes, that choose_allreduce_algorithm gives to `direct` (world sizes
// above 2).
inline constexpr std::size_t kAllReduceDirectMaxBytes = std::size_t{4} << 20;

// Copies `root`'s `data` into every rank's `data` (same size everywhere). The root's data is
// only read; on failure the other ranks' data holds garbage. Small data (at most one pipeline
// chunk) goes straight from the root to every rank; larger data is pipelined in chunks along
// a chain starting at the root (options.algorithm `direct` or `ring` forces either).
void broadcast(transport::Transport& transport, int root, std::span<std::byte> data,
               const CollectiveOptions& options);

void barrier(transport::Transport& transport, const CollectiveOptions& options);

// Seconds that the calling thread's collective calls have spent waiting for their peers to
// join: in each call, from its start until the headers it first waits for had all arrived
// (every peer's, except in the all-reduce: its left neighbour's, the one header it exchanges).
// A peer's header leaves as soon as that peer enters the call, so this is the time a call
// waited for the last of those peers to arrive; what follows is the transfer. Cumulative over
// the thread's life: a caller takes the difference around the calls it measures.
[[nodiscard]] double header_wait_seconds() noexcept;

// Every rank's value in rank order (fixed-size all-gather, e.g. of digests).
[[nodiscard]] std::vector<std::uint64_t> allgather_u64(transport::Transport& transport,
                                                       std::uint64_t mine,
                                                       const CollectiveOptions& options);

}  // namespace pulseloco::collectives
