// pulseloco_bench_sync's transport decorator: forwards every call to the real transport and
// counts the bytes this rank receives from ranks of other nodes (every tag: payloads, headers,
// notices), what a node's WAN link carries into it on this rank's behalf. A node's inbound
// bytes are the sum of its ranks' counts.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include <pulseloco/transport/forwarding.h>

namespace pulseloco::bench {

class NodeInboundTransport : public transport::ForwardingTransport {
 public:
  // node_of_rank[r]: rank r's node (any number that is equal for ranks of one node).
  NodeInboundTransport(std::unique_ptr<transport::Transport> inner, std::vector<int> node_of_rank)
      : ForwardingTransport(std::move(inner)), node_of_rank_(std::move(node_of_rank)) {}

  // Bytes received from other nodes since the last reset (counted when the receive is posted:
  // a receive's size is exactly its message's).
  [[nodiscard]] std::uint64_t inbound_bytes() const noexcept { return inbound_.load(); }
  void reset() noexcept { inbound_ = 0; }

  [[nodiscard]] std::unique_ptr<transport::Request> irecv(int peer, transport::Tag tag,
                                                          std::span<std::byte> data) override {
    if (node_of_rank_[static_cast<std::size_t>(peer)] !=
        node_of_rank_[static_cast<std::size_t>(rank())]) {
      inbound_ += data.size();
    }
    return inner().irecv(peer, tag, data);
  }

 private:
  std::vector<int> node_of_rank_;
  std::atomic<std::uint64_t> inbound_{0};
};

}  // namespace pulseloco::bench
