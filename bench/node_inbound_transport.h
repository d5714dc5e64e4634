// pulseloco_bench_sync's transport decorator: forwards every call to the real transport and
// counts the bytes this rank receives from ranks of other nodes (every tag: payloads, headers,
// notices), what a node's WAN link carries into it on this rank's behalf. A node's inbound
// bytes are the sum of its ranks' counts.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include <pulseloco/transport/transport.h>

namespace pulseloco::bench {

class NodeInboundTransport : public transport::Transport {
 public:
  // node_of_rank[r]: rank r's node (any number that is equal for ranks of one node).
  NodeInboundTransport(std::unique_ptr<transport::Transport> inner, std::vector<int> node_of_rank)
      : inner_(std::move(inner)), node_of_rank_(std::move(node_of_rank)) {}

  // Bytes received from other nodes since the last reset (counted when the receive is posted:
  // a receive's size is exactly its message's).
  [[nodiscard]] std::uint64_t inbound_bytes() const noexcept { return inbound_.load(); }
  void reset() noexcept { inbound_ = 0; }

  [[nodiscard]] int rank() const noexcept override { return inner_->rank(); }
  [[nodiscard]] int size() const noexcept override { return inner_->size(); }
  [[nodiscard]] std::string_view backend() const noexcept override { return inner_->backend(); }
  [[nodiscard]] Device buffer_device() const noexcept override { return inner_->buffer_device(); }
  [[nodiscard]] bool matches_by_order() const noexcept override {
    return inner_->matches_by_order();
  }
  [[nodiscard]] std::unique_ptr<transport::Request> isend(
      int peer, transport::Tag tag, std::span<const std::byte> data) override {
    return inner_->isend(peer, tag, data);
  }
  [[nodiscard]] std::unique_ptr<transport::Request> irecv(int peer, transport::Tag tag,
                                                          std::span<std::byte> data) override {
    if (node_of_rank_[static_cast<std::size_t>(peer)] !=
        node_of_rank_[static_cast<std::size_t>(rank())]) {
      inbound_ += data.size();
    }
    return inner_->irecv(peer, tag, data);
  }
  // The requests are the inner transport's (irecv and isend return them unwrapped).
  [[nodiscard]] std::unique_ptr<transport::Request> iforward(
      int peer, transport::Tag tag, std::span<const std::byte> data,
      const transport::Request& earlier) override {
    return inner_->iforward(peer, tag, data, earlier);
  }
  void retire_tag(transport::Tag tag) noexcept override { inner_->retire_tag(tag); }
  void abort(std::string_view reason) noexcept override { inner_->abort(reason); }
  void abort_blaming(int peer, ErrorKind kind, std::string_view reason) noexcept override {
    inner_->abort_blaming(peer, kind, reason);
  }
  [[nodiscard]] std::vector<int> lost_peers() const override { return inner_->lost_peers(); }
  [[nodiscard]] transport::TransportStats stats() const override { return inner_->stats(); }
  [[nodiscard]] std::uint64_t next_sequence(transport::Tag base_tag) override {
    return inner_->next_sequence(base_tag);
  }

 private:
  std::unique_ptr<transport::Transport> inner_;
  std::vector<int> node_of_rank_;
  std::atomic<std::uint64_t> inbound_{0};
};

}  // namespace pulseloco::bench
