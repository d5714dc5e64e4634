// Test helper: a transport that forwards every call to another, the base of decorators that
// watch or extend one (a test overrides what it needs and reaches the inner one by inner()).
#pragma once

#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include <pulseloco/transport/transport.h>

namespace pulseloco::transport::testing {

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
  void abort(std::string_view reason) noexcept override { inner_->abort(reason); }
  [[nodiscard]] TransportStats stats() const override { return inner_->stats(); }
  [[nodiscard]] std::vector<int> lost_peers() const override { return inner_->lost_peers(); }

 protected:
  [[nodiscard]] Transport& inner() const noexcept { return *inner_; }

 private:
  std::unique_ptr<Transport> inner_;
};

}  // namespace pulseloco::transport::testing
