// Internal: joining a group (Engine::attach; engine.h says what a member may expect). In turn:
// the options and the tensor tables must agree on every rank; then every member is brought to
// the state of the most advanced ones (the first group of a run: rank 0's weights become
// everyone's); then the members' digests of θ_g and m are compared.
#pragma once

#include <exception>

#include <pulseloco/base/thread_pool.h>
#include <pulseloco/engine/attached_group.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/replicated_state.h>

namespace pulseloco::engine_detail {

// Collective. `setup_error` is this rank's own reason not to start (invalid parameters), told to
// the others in the first agreement round so that every rank fails at once. Returns true when
// this rank took θ_g and m from another member: its θ_l was reset to cast(θ_g), so its inner
// steps start over. A failure leaves the state ready for the next attempt (a member that was
// receiving state counts as new).
[[nodiscard]] bool join_group(const AttachedGroup& group, ReplicatedState& state,
                              const EngineOptions& options, ThreadPool& pool,
                              const std::exception_ptr& setup_error);

}  // namespace pulseloco::engine_detail
