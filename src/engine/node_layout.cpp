#include <pulseloco/engine/node_layout.h>

#include <unistd.h>

#include <array>
#include <cstdlib>
#include <map>
#include <span>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::engine_detail {

std::string node_name(const std::string& configured) {
  if (!configured.empty()) return configured;
  if (const char* env = std::getenv("PULSELOCO_NODE"); env != nullptr && *env != '\0') return env;
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) != 0 || host[0] == '\0') {
    throw IoError("cannot read the host name to name this rank's node (set PULSELOCO_NODE)");
  }
  return host.data();
}

int node_count(const collectives::NodeLayout& layout) {
  std::map<int, int> nodes;
  for (const int node : layout.node_of_rank)
    ++nodes[node];
  return static_cast<int>(nodes.size());
}

bool spans_shared_nodes(const collectives::NodeLayout& layout) {
  std::map<int, int> ranks_per_node;
  for (const int node : layout.node_of_rank)
    ++ranks_per_node[node];
  if (ranks_per_node.size() < 2) return false;
  for (const auto& [node, ranks] : ranks_per_node) {
    if (ranks > 1) return true;
  }
  return false;
}

std::optional<collectives::NodeLayout> agree_on_nodes(transport::Transport& transport,
                                                      const collectives::CollectiveOptions& options,
                                                      bool node_aware, const std::string& node) {
  if (!node_aware || transport.size() < 2 || transport.matches_by_order()) return std::nullopt;
  const Digest mine = digest_bytes(std::as_bytes(std::span(node.data(), node.size())));
  const std::vector<std::uint64_t> all = collectives::allgather_u64(transport, mine, options);
  collectives::NodeLayout layout;
  std::map<std::uint64_t, int> first_rank;
  for (int r = 0; r < static_cast<int>(all.size()); ++r)
    layout.node_of_rank.push_back(
        first_rank.try_emplace(all[static_cast<std::size_t>(r)], r).first->second);
  if (!spans_shared_nodes(layout)) return std::nullopt;
  return layout;
}

}  // namespace pulseloco::engine_detail
