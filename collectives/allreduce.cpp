// Dense fp32 sum: reduce-scatter then all-gather, both pipelined in chunks, by one of two
// algorithms that give the same bits.
//
// The vector is cut into world_size segments; segment g is summed in ring order starting at
// rank g, ((x_g + x_{g+1}) + x_{g+2}) + ... + x_{g-1}, whichever algorithm runs.
//
// ring:   reduce-scatter step s (0..n-2): rank r sends segment r-s to r+1 and receives segment
//         r-s-1 from r-1, adding its own input to it (received + own, in that order). Segment g
//         thus starts at rank g and is finished by rank g-1 after n-1 additions in ring order.
//         The all-gather then passes every finished segment around the ring as bytes, so every
//         rank ends with the finisher's exact bits. Chunks are forwarded as soon as they are
//         reduced, so every link is busy during both phases. Latency: 2 (n-1) hops.
// direct: every rank sends segment g of its input straight to rank g, which adds the n-1
//         contributions to its own in the same order (x_g first, then x_{g+1}, ...) and sends
//         the finished segment straight to every rank. The same bytes cross each rank's link
//         as in the ring, in 2 hops instead of 2 (n-1); the price is a receive buffer of
//         (n-1)/n of the vector. `automatic` takes it for latency-bound vectors.
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

CollectiveAlgorithm choose_allreduce_algorithm(std::size_t elements, int world_size) {
  // Two ranks: both algorithms are the same exchange.
  if (world_size <= 2) return CollectiveAlgorithm::ring;
  // Up to a few MiB the hops cost more than the incast: 2 hops instead of 2 (n-1), for the
  // same bytes per link. Each hop is a round of wake-ups where ranks share cores, and a one-way
  // latency on a WAN; n-1 senders into one link cost a little on shaped links without delay.
  if (elements * sizeof(float) <= kAllReduceDirectMaxBytes) return CollectiveAlgorithm::direct;
  // Larger: one flow per link, and no receive buffer of (n-1)/n of the vector.
  return CollectiveAlgorithm::ring;
}

namespace {

// Elements [begin, end) of the vector.
struct Range {
  std::size_t begin = 0;
  std::size_t end = 0;
};

class Segments {
 public:
  Segments(std::size_t count, int world)
      : base_(count / static_cast<std::size_t>(world)),
        remainder_(count % static_cast<std::size_t>(world)) {}
  [[nodiscard]] Range segment(int g) const {
    const auto index = static_cast<std::size_t>(g);
    const std::size_t begin = index * base_ + std::min(index, remainder_);
    return {begin, begin + base_ + (index < remainder_ ? 1 : 0)};
  }

 private:
  std::size_t base_;
  std::size_t remainder_;
};

void append_chunks(std::vector<Range>& out, Range segment, std::size_t chunk_elements) {
  detail::for_each_chunk(
      segment.begin, segment.end, chunk_elements, [&](std::uint64_t begin, std::uint64_t end) {
        out.push_back({static_cast<std::size_t>(begin), static_cast<std::size_t>(end)});
      });
}

// One chunk of the receive stream, and the ring step it belongs to.
struct Step {
  Range range;
  int step = 0;
};

void ring_allreduce(Call& call, std::span<const float> input, std::span<float> output) {
  const int n = call.size();
  const int r = call.rank();
  const int left = call.left_neighbour();
  const int right = call.right_neighbour();
  const std::size_t chunk_elements =
      std::max<std::size_t>(1, call.options().pipeline_chunk_bytes / sizeof(float));
  const Segments segments(input.size(), n);
  const auto out_bytes = [&](Range range) {
    return std::as_writable_bytes(output.subspan(range.begin, range.end - range.begin));
  };
  const auto in_bytes = [&](Range range) {
    return std::as_bytes(input.subspan(range.begin, range.end - range.begin));
  };
  // The chunks of the segments that arrive from the left: segment first(s) at step s.
  const auto stream = [&](auto first) {
    std::vector<Step> steps;
    for (int step = 0; step + 1 < n; ++step) {
      std::vector<Range> chunks;
      append_chunks(chunks, segments.segment(first(step)), chunk_elements);
      for (const Range& range : chunks)
        steps.push_back({range, step});
    }
    return steps;
  };

  // Reduce-scatter: step s receives segment r-s-1, adds the own input to it and sends it on.
  // Every receive lands in `output`, where the reduction happens in place.
  const std::vector<Step> scatter = stream([&](int step) { return (r - step - 1 + n) % n; });
  // All-gather: step s receives the finished segment r-s and forwards it (except the last).
  const std::vector<Step> gather = stream([&](int step) { return (r - step + n) % n; });

  std::vector<Request*> scatter_receives;
  scatter_receives.reserve(scatter.size());
  for (const Step& s : scatter) {
    scatter_receives.push_back(&call.irecv(left, Phase::reduce_scatter, out_bytes(s.range)));
  }
  // The output of segment r is untouched by the reduce-scatter, so the all-gather's step-0
  // receives are posted now (the left neighbour sends them while this rank may still be
  // reducing). The later ones overwrite regions this rank sends from during the
  // reduce-scatter, so they wait until those sends are done.
  std::vector<Request*> gather_receives;
  gather_receives.reserve(gather.size());
  std::size_t posted = 0;
  for (; posted < gather.size() && gather[posted].step == 0; ++posted) {
    gather_receives.push_back(&call.irecv(left, Phase::gather, out_bytes(gather[posted].range)));
  }
  {
    std::vector<Range> own;
    append_chunks(own, segments.segment(r), chunk_elements);
    for (const Range& range : own) {
      (void)call.isend(right, Phase::reduce_scatter, in_bytes(range));
    }
  }
  std::vector<Request*> sends_from_output;
  for (std::size_t i = 0; i < scatter.size(); ++i) {
    const Step& s = scatter[i];
    call.wait(*scatter_receives[i], left);
    float* out = output.data();
    const float* in = input.data();
    for (std::size_t e = s.range.begin; e < s.range.end; ++e)
      out[e] = out[e] + in[e];
    if (s.step + 2 < n) {
      sends_from_output.push_back(&call.isend(right, Phase::reduce_scatter, out_bytes(s.range)));
    } else {
      // Segment r+1 is finished here: it opens the all-gather.
      (void)call.isend(right, Phase::gather, out_bytes(s.range));
    }
  }
  // Their receiver posted every reduce-scatter receive up front, so these complete.
  for (Request* send : sends_from_output)
    call.wait(*send, right);
  for (; posted < gather.size(); ++posted) {
    gather_receives.push_back(&call.irecv(left, Phase::gather, out_bytes(gather[posted].range)));
  }
  for (std::size_t i = 0; i < gather.size(); ++i) {
    const Step& s = gather[i];
    call.wait(*gather_receives[i], left);
    if (s.step + 2 < n)
      (void)call.iforward(right, Phase::gather, out_bytes(s.range), *gather_receives[i]);
  }
}

// out[e] = ((first[e] + addends[0][e]) + addends[1][e]) + ..., in one pass over the chunk (it
// is memory-bound: one pass reads every input once and writes the output once). Blocks of a
// few addends at a time keep the adds in that order while the loop vectorises.
void sum_in_order(std::span<const float> first, std::span<const float* const> addends,
                  std::span<float> out) {
  const std::size_t count = out.size();
  float* __restrict o = out.data();
  const float* __restrict f = first.data();
  std::size_t k = 0;
  switch (addends.size()) {
    case 0:
      std::memcpy(o, f, count * sizeof(float));
      return;
    case 1: {
      const float* __restrict a = addends[0];
      for (std::size_t e = 0; e < count; ++e)
        o[e] = f[e] + a[e];
      return;
    }
    case 2: {
      const float* __restrict a = addends[0];
      const float* __restrict b = addends[1];
      for (std::size_t e = 0; e < count; ++e)
        o[e] = (f[e] + a[e]) + b[e];
      return;
    }
    default: {
      const float* __restrict a = addends[0];
      const float* __restrict b = addends[1];
      const float* __restrict c = addends[2];
      for (std::size_t e = 0; e < count; ++e)
        o[e] = ((f[e] + a[e]) + b[e]) + c[e];
      k = 3;
      break;
    }
  }
  // More than three addends: the rest one at a time onto the output, still in order.
  for (; k < addends.size(); ++k) {
    const float* __restrict a = addends[k];
    for (std::size_t e = 0; e < count; ++e)
      o[e] = o[e] + a[e];
  }
}

void direct_allreduce(Call& call, std::span<const float> input, std::span<float> output) {
  const int n = call.size();
  const int r = call.rank();
  const std::size_t chunk_elements =
      std::max<std::size_t>(1, call.options().pipeline_chunk_bytes / sizeof(float));
  const Segments segments(input.size(), n);
  const Range mine = segments.segment(r);
  const std::size_t mine_count = mine.end - mine.begin;
  std::vector<Range> my_chunks;
  append_chunks(my_chunks, mine, chunk_elements);

  // The peers' contributions to this rank's segment, by distance: peer r+d's lies at
  // (d-1) * mine_count. The call owns the buffer, so receives may write into it until the
  // transport is aborted.
  const std::span<std::byte> scratch =
      call.scratch(static_cast<std::size_t>(n - 1) * mine_count * sizeof(float));
  const auto contribution = [&](int distance, Range range) {
    const std::size_t at =
        (static_cast<std::size_t>(distance - 1) * mine_count + (range.begin - mine.begin)) *
        sizeof(float);
    return scratch.subspan(at, (range.end - range.begin) * sizeof(float));
  };
  // receives[d-1][c]: chunk c of peer r+d's contribution.
  std::vector<std::vector<Request*>> receives(static_cast<std::size_t>(n - 1));
  for (int distance = 1; distance < n; ++distance) {
    const int peer = (r + distance) % n;
    for (const Range& range : my_chunks) {
      receives[static_cast<std::size_t>(distance - 1)].push_back(
          &call.irecv(peer, Phase::reduce_scatter, contribution(distance, range)));
    }
  }
  // The finished segments of the other ranks land in `output`, which this rank only reads for
  // its own segment: all of them can be posted now.
  std::vector<std::pair<int, Request*>> gather_receives;
  for (int distance = 1; distance < n; ++distance) {
    const int peer = (r + distance) % n;
    std::vector<Range> chunks;
    append_chunks(chunks, segments.segment(peer), chunk_elements);
    for (const Range& range : chunks) {
      gather_receives.emplace_back(peer, &call.irecv(peer, Phase::gather,
                                                     std::as_writable_bytes(output.subspan(
                                                         range.begin, range.end - range.begin))));
    }
  }
  // Segment p of the input to rank p, chunk by chunk to every peer in turn, so that all peers
  // progress together.
  std::vector<std::vector<Range>> outgoing(static_cast<std::size_t>(n));
  std::size_t rounds = 0;
  for (int distance = 1; distance < n; ++distance) {
    const int peer = (r + distance) % n;
    append_chunks(outgoing[static_cast<std::size_t>(peer)], segments.segment(peer), chunk_elements);
    rounds = std::max(rounds, outgoing[static_cast<std::size_t>(peer)].size());
  }
  for (std::size_t round = 0; round < rounds; ++round) {
    for (int distance = 1; distance < n; ++distance) {
      const int peer = (r + distance) % n;
      const auto& chunks = outgoing[static_cast<std::size_t>(peer)];
      if (round >= chunks.size()) continue;
      const Range range = chunks[round];
      (void)call.isend(peer, Phase::reduce_scatter,
                       std::as_bytes(input.subspan(range.begin, range.end - range.begin)));
    }
  }
  // Reduce each chunk of this rank's segment once every contribution to it is in, in the
  // documented order, and send it to every peer.
  std::vector<const float*> addends(static_cast<std::size_t>(n - 1));
  for (std::size_t c = 0; c < my_chunks.size(); ++c) {
    const Range range = my_chunks[c];
    for (int distance = 1; distance < n; ++distance) {
      call.wait(*receives[static_cast<std::size_t>(distance - 1)][c], (r + distance) % n);
      addends[static_cast<std::size_t>(distance - 1)] =
          reinterpret_cast<const float*>(contribution(distance, range).data());
    }
    sum_in_order(input.subspan(range.begin, range.end - range.begin), addends,
                 output.subspan(range.begin, range.end - range.begin));
    const auto finished = std::as_bytes(output.subspan(range.begin, range.end - range.begin));
    call.isend_to_every_peer(Phase::gather, finished);
  }
  for (const auto& [peer, request] : gather_receives)
    call.wait(*request, peer);
}

[[nodiscard]] bool overlap(std::span<const float> a, std::span<float> b) {
  if (a.empty() || b.empty()) return false;
  const std::less<const float*> less;
  return less(a.data(), b.data() + b.size()) && less(b.data(), a.data() + a.size());
}

}  // namespace

void allreduce_sum(transport::Transport& transport, std::span<const float> input,
                   std::span<float> output, const CollectiveOptions& options) {
  detail::validate_options(options, transport, "allreduce_sum");
  const int r = transport.rank();
  if (input.size() != output.size()) {
    throw InvalidArgument(
        fmt::format("allreduce_sum: input has {} elements, output {}", input.size(), output.size()),
        {.rank = r});
  }
  if (overlap(input, output)) {
    throw InvalidArgument("allreduce_sum: input and output overlap", {.rank = r});
  }
  detail::run_call(transport, options, detail::Op::allreduce_sum, [&](Call& call) {
    const CollectiveAlgorithm algorithm =
        call.options().algorithm == CollectiveAlgorithm::automatic
            ? choose_allreduce_algorithm(input.size(), call.size())
            : call.options().algorithm;
    // The first step's sends and the receives go out while the headers travel: they depend
    // only on the length and the options, which the headers then confirm before the first wait.
    // Each rank sends its header to its right neighbour alone, and checks its left neighbour's:
    // when every rank agrees with its left neighbour, all agree (Call::HeaderExchange). This
    // saves the direct algorithm world_size - 2 messages per rank and call; a peer of another
    // length that it meets first as a message of the wrong size is still reported as a
    // disagreement (Call::fail).
    call.post_headers(
        {.value = input.size()},
        Call::Agreement{
            .kind = ErrorKind::invalid_argument,
            .what = "allreduce_sum needs the same length on every rank",
            .key = [](const detail::Header& h) { return fmt::format("{} elements", h.value); }},
        Call::HeaderExchange::left_neighbour);
    if (call.ordered()) {
      // The transport's own all-reduce (NCCL's): the same bytes on every rank, in its
      // summation order; buffers in device memory stay there.
      transport::NativeCollectives& native = call.native_for_ordered();
      bool done = false;
      call.run_native([&](transport::Deadline deadline) {
        done = native.allreduce_sum(input, output, deadline);
      });
      if (!done) {
        throw InvalidArgument(
            "allreduce_sum: this order-matching transport offers no identical-bytes all-reduce",
            {.rank = call.rank()});
      }
      return;
    }
    if (call.size() == 1) {
      if (!input.empty()) std::memcpy(output.data(), input.data(), input.size_bytes());
      return;
    }
    if (algorithm == CollectiveAlgorithm::direct) {
      direct_allreduce(call, input, output);
    } else {
      ring_allreduce(call, input, output);
    }
  });
}

}  // namespace pulseloco::collectives
