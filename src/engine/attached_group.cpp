#include <pulseloco/engine/attached_group.h>

namespace pulseloco::engine_detail {
namespace {

// The engine's collectives number their calls per base tag themselves.
constexpr transport::Tag kEngineTag = 7;

}  // namespace

AttachedGroup::AttachedGroup(transport::Transport& transport, const EngineOptions& options,
                             const GroupInfo& info, const collectives::NodeLayout* nodes,
                             PhaseObserver* observer)
    : transport_(&transport),
      rank_(transport.rank()),
      world_(transport.size()),
      generation_(info.generation),
      worker_(static_cast<std::size_t>(rank_) < info.members.size()
                  ? std::string_view(info.members[static_cast<std::size_t>(rank_)])
                  : std::string_view{}),
      nodes_(nodes),
      observer_(observer) {
  collective_.timeout = options.timeout;
  collective_.algorithm = options.allgather;
  collective_.pipeline_chunk_bytes = static_cast<std::size_t>(options.pipeline_chunk_bytes);
  collective_.tag = kEngineTag;
}

}  // namespace pulseloco::engine_detail
