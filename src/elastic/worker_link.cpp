#include <pulseloco/elastic/worker_link.h>

#include <fmt/format.h>

#include <cstring>
#include <span>
#include <utility>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/transport/subgroup.h>
#include <pulseloco/transport/tcp/group_table.h>

namespace pulseloco::elastic {
namespace {

// The link's one collective in flight at a time.
constexpr transport::Tag kLinkTag = 1;

}  // namespace

WorkerLink::WorkerLink(group::TransportOptions options, std::string_view rendezvous, int local_rank,
                       int ranks_per_worker, std::string worker)
    : local_rank_(local_rank), ranks_per_worker_(ranks_per_worker), worker_(std::move(worker)) {
  const transport::PeerAddress at = transport::parse_peer_address(rendezvous, "worker_link");
  options.backend = transport::Backend::tcp;
  options.rendezvous = group::RendezvousMethod::environment;
  options.peers.clear();
  options.master_addr = at.host;
  options.master_port = at.port;
  options.rank = local_rank;
  options.world_size = ranks_per_worker;
  options.group_key.clear();
  options.tcp.listen_socket = -1;
  options.tcp.listen_port = 0;
  try {
    transport_ = group::make_transport(options);
  } catch (const Error& error) {
    transport::throw_error_of_kind(
        error.kind(),
        fmt::format("worker {}: local rank {} could not form the link between the worker's {} "
                    "ranks at {}: {}",
                    worker_, local_rank, ranks_per_worker, rendezvous, error.message()),
        {});
  }
}

WorkerLink::~WorkerLink() = default;

std::vector<std::string> WorkerLink::allgather(std::string_view mine,
                                               std::chrono::milliseconds timeout) {
  const collectives::CollectiveOptions options{.timeout = timeout, .tag = kLinkTag};
  std::vector<std::vector<std::byte>> messages;
  try {
    messages = collectives::sparse_allgather(
        *transport_, std::as_bytes(std::span(mine.data(), mine.size())), options);
  } catch (const Error& error) {
    // A local rank that hangs is named as one that died is: its share has no owner either way.
    const auto lost = error.context().peer;
    const bool hung = error.kind() == ErrorKind::timeout;
    transport::throw_error_of_kind(
        error.kind(),
        lost ? fmt::format("worker {}'s local rank {} {} ({}); the worker cannot go on without "
                           "it (this is its local rank {})",
                           worker_, *lost,
                           hung ? fmt::format("did not answer within {} ms", timeout.count())
                                : std::string("is lost"),
                           error.message(), local_rank_)
             : fmt::format("worker {}: the link between its local ranks failed ({}); the worker "
                           "cannot go on (this is its local rank {})",
                           worker_, error.message(), local_rank_),
        {});  // the message names the local rank: `peer` would read as a rank of the group
  }
  std::vector<std::string> texts;
  texts.reserve(messages.size());
  for (const auto& message : messages)
    texts.emplace_back(reinterpret_cast<const char*>(message.data()), message.size());
  return texts;
}

std::string WorkerLink::from_local_rank_0(std::string_view mine,
                                          std::chrono::milliseconds timeout) {
  auto texts = allgather(local_rank_ == 0 ? mine : std::string_view(), timeout);
  return std::move(texts.front());
}

}  // namespace pulseloco::elastic
