// A transport that forwards every call to another: the base of decorators that watch or extend
// one (counting bytes per peer, recording calls). A decorator overrides what it needs and
// reaches the inner transport through inner().
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include <pulseloco/transport/transport.h>

namespace pulseloco::transport {

class ForwardingTransport : public Transport {
 public:
  explicit ForwardingTransport(std::unique_ptr<Transport> inner) : inner_(std::move(inner)) {}

  [[nodiscard]] int rank() const noexcept override { return inner_->rank(); }
  [[nodiscard]] int size() const noexcept override { return inner_->size(); }
  [[nodiscard]] std::string_view backend() const noexcept override { return inner_->backend(); }
  [[nodiscard]] Device buffer_device() const noexcept override { return inner_->buffer_device(); }
  [[nodiscard]] bool matches_by_order() const noexcept override {
    return inner_->matches_by_order();
  }
  [[nodiscard]] std::unique_ptr<Request> isend(int peer, Tag tag,
                                               std::span<const std::byte> data) override {
    return inner_->isend(peer, tag, data);
  }
  [[nodiscard]] std::unique_ptr<Request> irecv(int peer, Tag tag,
                                               std::span<std::byte> data) override {
    return inner_->irecv(peer, tag, data);
  }
  // The requests are the inner transport's (isend and irecv return them unwrapped).
  [[nodiscard]] std::unique_ptr<Request> iforward(int peer, Tag tag,
                                                  std::span<const std::byte> data,
                                                  const Request& earlier) override {
    return inner_->iforward(peer, tag, data, earlier);
  }
  void retire_tag(Tag tag) noexcept override { inner_->retire_tag(tag); }
  void abort(std::string_view reason) noexcept override { inner_->abort(reason); }
  void abort_blaming(int peer, ErrorKind kind, std::string_view reason) noexcept override {
    inner_->abort_blaming(peer, kind, reason);
  }
  [[nodiscard]] std::vector<int> lost_peers() const override { return inner_->lost_peers(); }
  [[nodiscard]] TransportStats stats() const override { return inner_->stats(); }
  [[nodiscard]] std::uint64_t next_sequence(Tag base_tag) override {
    return inner_->next_sequence(base_tag);
  }

 protected:
  [[nodiscard]] Transport& inner() const noexcept { return *inner_; }

 private:
  std::unique_ptr<Transport> inner_;
};

}  // namespace pulseloco::transport
