#include <pulseloco/transport/bootstrap.h>

#include <vector>

#include <pulseloco/base/errors.h>

namespace pulseloco::transport {
namespace {

constexpr Tag kAllgatherTag = 0x424F4F54;  // "BOOT"
constexpr Tag kBroadcastTag = 0x4E43434C;  // "NCCL": the NCCL unique id is what it carries

}  // namespace

TransportBootstrap::TransportBootstrap(std::unique_ptr<Transport> transport)
    : transport_(std::move(transport)) {}

void TransportBootstrap::allgather(std::span<const std::byte> mine, std::span<std::byte> all,
                                   Deadline deadline) {
  const int n = size();
  const std::size_t bytes = mine.size();
  PULSELOCO_CHECK(all.size() == bytes * static_cast<std::size_t>(n),
                  "bootstrap allgather: the output must hold every rank's contribution");
  std::vector<std::unique_ptr<Request>> requests;
  for (int peer = 0; peer < n; ++peer)
    requests.push_back(transport_->irecv(
        peer, kAllgatherTag, all.subspan(static_cast<std::size_t>(peer) * bytes, bytes)));
  for (int peer = 0; peer < n; ++peer)
    requests.push_back(transport_->isend(peer, kAllgatherTag, mine));
  for (auto& request : requests)
    request->wait(deadline);
}

void TransportBootstrap::broadcast(int root, std::span<std::byte> data, Deadline deadline) {
  if (rank() != root) {
    transport_->recv(root, kBroadcastTag, data, deadline);
    return;
  }
  std::vector<std::unique_ptr<Request>> sends;
  for (int peer = 0; peer < size(); ++peer)
    if (peer != root) sends.push_back(transport_->isend(peer, kBroadcastTag, data));
  for (auto& send : sends)
    send->wait(deadline);
}

}  // namespace pulseloco::transport
