// The node-aware all-gather (collectives.h, sparse_allgather_nodes): the rails' all-gathers over
// SubgroupTransport views, the bundles' all-gather inside each node, and the group-wide
// channel that ends the call (a completion round) or tells every rank who failed (a view's
// collective only tells its own members).
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <limits>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/collectives/detail/group_channel.h>
#include <pulseloco/collectives/detail/packets.h>
#include <pulseloco/transport/subgroup.h>

namespace pulseloco::collectives {

namespace {

using detail::GroupChannel;
using transport::SubgroupTransport;
using transport::Transport;

constexpr std::string_view kWhat = "sparse_allgather_nodes";

// The layout, sorted into nodes.
struct Nodes {
  std::vector<std::vector<int>> members;  // by node (ordered by lowest rank): its ranks
  std::vector<int> node_of;               // by rank: index into members
  std::vector<int> local_of;              // by rank: its local rank
  int largest = 0;                        // ranks of the largest node = the number of rails

  [[nodiscard]] int size_of(int node) const {
    return static_cast<int>(members[static_cast<std::size_t>(node)].size());
  }
  // Rail l: the l-th local rank of every node (local rank l mod G of a node of G ranks).
  [[nodiscard]] std::vector<int> rail(int l) const {
    std::vector<int> ranks;
    for (const auto& node : members)
      ranks.push_back(node[static_cast<std::size_t>(l) % node.size()]);
    return ranks;
  }
  // Rank `rank` brings its own message to rail l (else it stands in for its node, empty).
  [[nodiscard]] bool real_on_rail(int rank, int l) const {
    return local_of[static_cast<std::size_t>(rank)] == l;
  }
  // What the bundle of local rank `local` of node `node` holds, in order: its own message,
  // then for each of its rails (ascending) the other nodes' real messages there (node order).
  [[nodiscard]] std::vector<int> bundle_origins(int node, int local) const {
    const auto& own = members[static_cast<std::size_t>(node)];
    const int g = static_cast<int>(own.size());
    std::vector<int> origins{own[static_cast<std::size_t>(local)]};
    for (int l = local; l < largest; l += g) {
      for (std::size_t m = 0; m < members.size(); ++m) {
        if (static_cast<int>(m) == node) continue;
        if (l < static_cast<int>(members[m].size()))
          origins.push_back(members[m][static_cast<std::size_t>(l)]);
      }
    }
    return origins;
  }
};

Nodes sort_into_nodes(const NodeLayout& layout, int world, int rank) {
  if (static_cast<int>(layout.node_of_rank.size()) != world) {
    throw InvalidArgument(fmt::format("{}: the node layout names {} ranks, the group has {}", kWhat,
                                      layout.node_of_rank.size(), world),
                          {.rank = rank});
  }
  Nodes nodes;
  std::map<int, int> index_of_id;
  nodes.node_of.resize(static_cast<std::size_t>(world));
  nodes.local_of.resize(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    const int id = layout.node_of_rank[static_cast<std::size_t>(r)];
    if (id < 0) {
      throw InvalidArgument(
          fmt::format("{}: the node layout gives rank {} the negative node {}", kWhat, r, id),
          {.rank = rank});
    }
    const auto [it, added] = index_of_id.emplace(id, static_cast<int>(nodes.members.size()));
    if (added) nodes.members.emplace_back();
    auto& node = nodes.members[static_cast<std::size_t>(it->second)];
    nodes.node_of[static_cast<std::size_t>(r)] = it->second;
    nodes.local_of[static_cast<std::size_t>(r)] = static_cast<int>(node.size());
    node.push_back(r);
    nodes.largest = std::max(nodes.largest, static_cast<int>(node.size()));
  }
  return nodes;
}

// FNV-1a over the node of every rank, as the ranks group them (the ids themselves may differ).
std::uint64_t layout_hash(const Nodes& nodes) {
  std::uint64_t hash = 0xCBF29CE484222325ULL;
  const auto mix = [&](std::uint64_t value) {
    for (int b = 0; b < 8; ++b) {
      hash ^= (value >> (8 * b)) & 0xFF;
      hash *= 0x100000001B3ULL;
    }
  };
  mix(nodes.node_of.size());
  for (const int node : nodes.node_of)
    mix(static_cast<std::uint64_t>(node));
  return hash;
}

// An error already in the parent's numbering (a callback's, or this file's own), passed
// through a view's collective untouched (which rethrows a local error as it is).
struct ParentNumbered {
  std::exception_ptr error;
};

// What the views' abort hooks share: the channel, and the culprit when this rank knows it
// before the view's collective does (a callback's error, an invalid bundle).
struct Failure {
  Transport& parent;
  GroupChannel& channel;
  std::optional<std::pair<int, ErrorKind>> known;

  // Tells every rank who failed, as far as this rank knows, before the parent is aborted: the
  // known culprit, else the one the view's collective blamed (`blamed`, -1 for none), else the
  // first peer the parent has lost (following the notices from there).
  void tell(int blamed = -1, ErrorKind blamed_kind = ErrorKind::peer_lost) {
    int culprit = -1;
    ErrorKind kind = ErrorKind::peer_lost;
    if (known) {
      std::tie(culprit, kind) = *known;
    } else if (blamed >= 0) {
      culprit = blamed;
      kind = blamed_kind;
    } else {
      for (const int peer : parent.lost_peers()) {
        if (peer != parent.rank()) {
          culprit = peer;
          break;
        }
      }
    }
    if (culprit >= 0 && culprit != parent.rank())
      std::tie(culprit, kind) = channel.resolve(culprit, kind);
    channel.tell(GroupChannel::Type::failure, kind, culprit);
    channel.flush_failure();
  }
};

// Runs `exchange` (a collective over `view`); an error it throws names the view's ranks and
// is thrown again in the parent's numbering, blaming the rank that the failure notices point to.
template <typename Exchange>
void run_over_view(SubgroupTransport& view, std::string_view what, GroupChannel& channel,
                   Exchange&& exchange) {
  try {
    exchange();
  } catch (const ParentNumbered&) {
    throw;
  } catch (const Error& error) {
    try {
      view.rethrow_in_parent_numbering(error, what);
    } catch (const Error& translated) {
      const auto peer = translated.context().peer;
      if (translated.kind() != ErrorKind::aborted && peer) {
        const auto [culprit, kind] = channel.resolve(*peer, translated.kind());
        if (culprit != *peer) {
          transport::throw_error_of_kind(
              kind == ErrorKind::aborted ? ErrorKind::peer_lost : kind,
              fmt::format("{} failed: rank {} failed (reported by rank {}); this rank saw: {}",
                          kWhat, culprit, *peer, translated.message()),
              {.rank = view.parent().rank(), .peer = culprit});
        }
      }
      throw;
    }
  }
}

// Throws InvalidArgument (after aborting `transport`) unless every rank has the same layout.
void require_same_layout(Transport& transport, const std::vector<std::uint64_t>& hashes) {
  std::map<std::uint64_t, int> count;
  for (const std::uint64_t hash : hashes)
    ++count[hash];
  std::uint64_t majority = hashes.front();
  for (const std::uint64_t hash : hashes) {
    if (count[hash] > count[majority]) majority = hash;
  }
  for (std::size_t r = 0; r < hashes.size(); ++r) {
    if (hashes[r] == majority) continue;
    const int culprit = static_cast<int>(r);
    const std::string message =
        fmt::format("{}: rank {} passes another node layout than {} of {} ranks", kWhat, culprit,
                    count[majority], hashes.size());
    transport.abort(message);
    ErrorContext context{.rank = transport.rank()};
    if (culprit != transport.rank()) context.peer = culprit;
    throw InvalidArgument(message, std::move(context));
  }
}

std::uint64_t saturating_bundle_limit(std::uint64_t max_message, std::size_t world) {
  const std::uint64_t per_message = max_message > std::numeric_limits<std::uint64_t>::max() - 8
                                        ? std::numeric_limits<std::uint64_t>::max()
                                        : max_message + 8;
  if (per_message > (std::numeric_limits<std::uint64_t>::max() - 8) / world)
    return std::numeric_limits<std::uint64_t>::max();
  return per_message * world + 8;
}

}  // namespace

void sparse_allgather_nodes(Transport& parent, const NodeLayout& layout,
                            std::span<const std::byte> mine, const MessageBuffer& buffer_for,
                            const CollectiveOptions& options, const OnMessage& on_message) {
  const int world = parent.size();
  const int me = parent.rank();
  if (parent.matches_by_order()) {
    throw InvalidArgument(
        fmt::format("{}: not over an order-matching transport ({})", kWhat, parent.backend()),
        {.rank = me});
  }
  if (!buffer_for)
    throw InvalidArgument(fmt::format("{}: no MessageBuffer callback", kWhat), {.rank = me});
  if (mine.size() > options.max_message_bytes) {
    throw InvalidArgument(fmt::format("{}: this rank's message of {} bytes exceeds "
                                      "max_message_bytes {}",
                                      kWhat, mine.size(), options.max_message_bytes),
                          {.rank = me});
  }
  const Nodes nodes = sort_into_nodes(layout, world, me);
  require_same_layout(parent, allgather_u64(parent, layout_hash(nodes), options));

  // The call's sequence numbers under options.tag: the channel's, one per rail, the node's. Each
  // follows an unused one: a collective that fails after its `done` sends its verdict to the
  // next call's tag too, which must not be another step's (a view numbers ranks differently).
  const auto reserve = [&] {
    (void)parent.next_sequence(options.tag);
    return parent.next_sequence(options.tag);
  };
  const std::uint64_t channel_sequence = reserve();
  std::vector<std::uint64_t> rail_sequence(static_cast<std::size_t>(nodes.largest));
  for (auto& sequence : rail_sequence)
    sequence = reserve();
  const std::uint64_t node_sequence = reserve();

  const int my_node = nodes.node_of[static_cast<std::size_t>(me)];
  const int my_local = nodes.local_of[static_cast<std::size_t>(me)];
  const auto& node_ranks = nodes.members[static_cast<std::size_t>(my_node)];
  const int g = static_cast<int>(node_ranks.size());

  // Buffers that the parent's operations use are declared before anything that may abort it.
  std::vector<std::span<std::byte>> buffers(static_cast<std::size_t>(world));
  std::vector<std::byte> bundle_out;
  std::vector<std::vector<std::byte>> bundles_in(static_cast<std::size_t>(g));
  GroupChannel channel(parent,
                       detail::make_tag(options.tag, channel_sequence, detail::Phase::notice),
                       options.timeout, kWhat);
  Failure failure{.parent = parent, .channel = channel, .known = std::nullopt};
  const auto before_abort = [&failure](int blamed, ErrorKind kind, std::string_view) {
    failure.tell(blamed, kind);
  };

  // The caller's callbacks: an error there is this rank's own.
  const auto own_error = [&]() -> ParentNumbered {
    failure.known = std::pair{me, ErrorKind::aborted};
    return ParentNumbered{std::current_exception()};
  };
  const auto user_buffer = [&](int origin, std::size_t bytes) -> std::span<std::byte> {
    std::span<std::byte> buffer;
    try {
      buffer = buffer_for(origin, bytes);
      if (buffer.size() != bytes) {
        throw InvalidArgument(fmt::format("{}: the buffer for rank {}'s message has {} bytes "
                                          "where {} are needed",
                                          kWhat, origin, buffer.size(), bytes),
                              {.rank = me});
      }
    } catch (...) {
      throw own_error();
    }
    buffers[static_cast<std::size_t>(origin)] = buffer;
    return buffer;
  };
  const auto deliver = [&](int origin) {
    if (!on_message) return;
    try {
      on_message(origin, buffers[static_cast<std::size_t>(origin)]);
    } catch (...) {
      throw own_error();
    }
  };
  const auto protocol_error = [&](int culprit, std::string message) -> ParentNumbered {
    failure.known = std::pair{culprit, ErrorKind::protocol};
    return ParentNumbered{
        std::make_exception_ptr(ProtocolError(message, {.rank = me, .peer = culprit}))};
  };

  try {
    // Step 1: the rails this rank serves (its own, then those it stands in on).
    for (int l = my_local; l < nodes.largest; l += g) {
      const std::vector<int> rail = nodes.rail(l);
      const bool real = l == my_local;
      SubgroupTransport view(parent, rail, rail_sequence[static_cast<std::size_t>(l)],
                             before_abort);
      run_over_view(view, fmt::format("{}'s rail {}", kWhat, l), channel, [&] {
        sparse_allgather_into(
            view, real ? mine : std::span<const std::byte>{},
            [&](int position, std::size_t bytes) -> std::span<std::byte> {
              const int origin = rail[static_cast<std::size_t>(position)];
              if (origin == me) return real ? user_buffer(me, bytes) : std::span<std::byte>{};
              if (!nodes.real_on_rail(origin, l)) {
                if (bytes == 0) return {};
                throw protocol_error(origin, fmt::format("{}: rank {} stands in for its node on "
                                                         "rail {} but sends {} bytes there",
                                                         kWhat, origin, l, bytes));
              }
              return user_buffer(origin, bytes);
            },
            options,
            [&](int position, std::span<const std::byte>) {
              const int origin = rail[static_cast<std::size_t>(position)];
              if (origin == me ? real : nodes.real_on_rail(origin, l)) deliver(origin);
            });
      });
    }

    // Step 2: every local rank's bundle (its own message and what its rails brought) to the
    // others of its node.
    if (g > 1) {
      const std::vector<int> origins = nodes.bundle_origins(my_node, my_local);
      std::size_t total = 8 * (origins.size() + 1);
      for (const int origin : origins)
        total += origin == me ? mine.size() : buffers[static_cast<std::size_t>(origin)].size();
      bundle_out.resize(total);
      ByteWriter header{std::span<std::byte>(bundle_out).first(8 * (origins.size() + 1))};
      header.put(static_cast<std::uint64_t>(origins.size()));
      std::size_t at = 8 * (origins.size() + 1);
      for (const int origin : origins) {
        const std::span<const std::byte> message =
            origin == me ? mine : buffers[static_cast<std::size_t>(origin)];
        header.put(static_cast<std::uint64_t>(message.size()));
        if (!message.empty()) std::memcpy(bundle_out.data() + at, message.data(), message.size());
        at += message.size();
      }

      CollectiveOptions bundle_options = options;
      bundle_options.max_message_bytes =
          saturating_bundle_limit(options.max_message_bytes, static_cast<std::size_t>(world));
      SubgroupTransport view(parent, node_ranks, node_sequence, before_abort);
      const auto unpack = [&](int local, std::span<const std::byte> bundle) {
        const int sender = node_ranks[static_cast<std::size_t>(local)];
        const std::vector<int> theirs = nodes.bundle_origins(my_node, local);
        const std::size_t head = 8 * (theirs.size() + 1);
        std::vector<std::uint64_t> sizes;
        std::uint64_t sum = 0;
        bool valid =
            bundle.size() >= head && load_le<std::uint64_t>(bundle.data()) == theirs.size();
        for (std::size_t i = 0; valid && i < theirs.size(); ++i) {
          sizes.push_back(load_le<std::uint64_t>(bundle.data() + 8 * (i + 1)));
          valid = sizes.back() <= options.max_message_bytes;
          sum += sizes.back();
        }
        if (!valid || sum != bundle.size() - head) {
          throw protocol_error(sender, fmt::format("{}: rank {} sent a bundle of {} bytes that "
                                                   "does not frame its {} messages",
                                                   kWhat, sender, bundle.size(), theirs.size()));
        }
        std::size_t offset = head;
        for (std::size_t i = 0; i < theirs.size(); ++i) {
          const auto bytes = static_cast<std::size_t>(sizes[i]);
          const std::span<std::byte> out = user_buffer(theirs[i], bytes);
          if (bytes > 0) std::memcpy(out.data(), bundle.data() + offset, bytes);
          offset += bytes;
          deliver(theirs[i]);
        }
      };
      run_over_view(view, fmt::format("{}'s exchange inside node {}", kWhat, my_node), channel,
                    [&] {
                      sparse_allgather_into(
                          view, bundle_out,
                          [&](int local, std::size_t bytes) -> std::span<std::byte> {
                            auto& in = bundles_in[static_cast<std::size_t>(local)];
                            in.resize(bytes);
                            return in;
                          },
                          bundle_options,
                          [&](int local, std::span<const std::byte> bundle) {
                            if (local != my_local) unpack(local, bundle);
                          });
                    });
    }
    channel.complete();
  } catch (const ParentNumbered& error) {
    failure.tell();
    parent.abort(fmt::format("{} failed on this rank", kWhat));
    std::rethrow_exception(error.error);
  } catch (...) {
    parent.abort(fmt::format("{} failed", kWhat));
    throw;
  }
}

std::vector<std::vector<std::byte>> sparse_allgather_nodes(Transport& transport,
                                                           const NodeLayout& layout,
                                                           std::span<const std::byte> mine,
                                                           const CollectiveOptions& options,
                                                           const OnMessage& on_message) {
  std::vector<std::vector<std::byte>> messages(static_cast<std::size_t>(transport.size()));
  sparse_allgather_nodes(transport, layout, mine, store_in(messages), options, on_message);
  return messages;
}

}  // namespace pulseloco::collectives
