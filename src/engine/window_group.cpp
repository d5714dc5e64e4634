#include <pulseloco/engine/window_group.h>

#include <vector>

#include <pulseloco/base/errors.h>

namespace pulseloco::engine_detail {
namespace {

// The engine's collectives number their calls per base tag themselves.
constexpr transport::Tag kEngineTag = 7;

}  // namespace

WindowGroup::WindowGroup(transport::Transport& transport, const EngineOptions& options,
                         const GroupInfo& info, PhaseObserver* observer)
    : transport_(&transport),
      rank_(transport.rank()),
      world_(transport.size()),
      generation_(info.generation),
      worker_(static_cast<std::size_t>(rank_) < info.members.size()
                  ? std::string_view(info.members[static_cast<std::size_t>(rank_)])
                  : std::string_view{}),
      observer_(observer) {
  collective_.timeout = options.timeout;
  collective_.algorithm = options.allgather;
  collective_.pipeline_chunk_bytes = static_cast<std::size_t>(options.pipeline_chunk_bytes);
  collective_.tag = kEngineTag;
}

void agree_to_commit(const WindowGroup& group, bool accepted,
                     const std::exception_ptr& local_error) {
  const auto votes =
      collectives::allgather_u64(group.transport(), accepted ? 1u : 0u, group.collective());
  if (local_error) std::rethrow_exception(local_error);
  std::vector<int> rejecting;
  for (int r = 0; r < group.world(); ++r) {
    if (votes[static_cast<std::size_t>(r)] != 1) rejecting.push_back(r);
  }
  if (!rejecting.empty()) {
    throw ProtocolError(
        "the window was rejected by other ranks (invalid messages); "
        "state left unchanged",
        {.rank = group.rank(), .ranks = rejecting});
  }
}

}  // namespace pulseloco::engine_detail
