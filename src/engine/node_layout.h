// Internal: the nodes of the group an engine is attached to, for node-aware exchanges
// (EngineOptions::node_aware, collectives::sparse_allgather_nodes). Every rank names its node
// (GroupInfo::node); the ranks agree on the layout with one fixed-size all-gather of the
// names' digests.
#pragma once

#include <optional>
#include <string>

#include <pulseloco/collectives/collectives.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::engine_detail {

// The name of this rank's node: `configured` when not empty, else PULSELOCO_NODE when set and
// not empty, else the host name.
[[nodiscard]] std::string node_name(const std::string& configured);

// Whether a group with these nodes gains from the node-aware all-gather: more than one node,
// and more than one rank on some node. (One node, or one rank per node: every link is the same
// kind, and the flat all-gather moves the same bytes.)
[[nodiscard]] bool spans_shared_nodes(const collectives::NodeLayout& layout);

// The number of distinct nodes.
[[nodiscard]] int node_count(const collectives::NodeLayout& layout);

// Collective when `node_aware` (every rank calls it with the same value): the layout of the
// group's nodes when the exchange should be node-aware, else nothing. Node k of the layout is
// the one whose lowest rank is k. Never node-aware over an order-matching transport (NCCL),
// which the node all-gather does not support.
[[nodiscard]] std::optional<collectives::NodeLayout> agree_on_nodes(
    transport::Transport& transport, const collectives::CollectiveOptions& options, bool node_aware,
    const std::string& node);

}  // namespace pulseloco::engine_detail
