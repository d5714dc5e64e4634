// Internal: publishing θ_g as bf16 versions for inference servers (EngineOptions::publish_dir,
// docs/patches.md, "Publishing from training"). Rank 0 publishes after every publish_every-th
// window, as version = the window counter, through one patch::Publisher that it opens at its
// first publication: on a directory that holds versions (a resumed run, or a new rank 0 after a
// membership change) it continues their sequence from the newest one, reloaded and verified.
// A directory that already held versions when a new run started (another run's) is refused
// unless EngineOptions::publish_continue says to publish after them: a new run never appends
// onto another run's versions unasked.
//
// A publication that fails (a full disk, a directory of another model) is not an error of the
// window, which has committed on every rank: the report says so (publish_error) and the log
// warns, the publisher's snapshot stays at the last published version, and the next
// publication is a delta from it.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <pulseloco/base/thread_pool.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/replicated_state.h>
#include <pulseloco/engine/report.h>

namespace pulseloco::patch {
class Publisher;
}

namespace pulseloco::engine_detail {

class WeightPublishing {
 public:
  explicit WeightPublishing(const EngineOptions& options);
  ~WeightPublishing();
  WeightPublishing(const WeightPublishing&) = delete;
  WeightPublishing& operator=(const WeightPublishing&) = delete;

  // After a window committed and its digests agreed: publishes θ_g when this rank is 0 and the
  // window counter is due, filling the report's publishing fields. Never throws for a failed
  // publication (see above).
  void after_window(const ReplicatedState& state, int rank, WindowReport& report);
  // The state was restored from a checkpoint or taken from the group's other members: the
  // directory's versions are this run's.
  void state_loaded() noexcept { continues_run_ = true; }

 private:
  void publish(const ReplicatedState& state, WindowReport& report);

  const EngineOptions& options_;
  std::unique_ptr<patch::Publisher> publisher_;  // rank 0's, once it has published
  // State on a device: bf16(θ_g) in host memory, kept up to date by the memory's changed entries
  // (StateMemory::update_bf16_mirror), which the publisher reads instead of θ_g.
  std::vector<std::vector<std::uint16_t>> device_mirror_;
  // Versions in the directory are this run's to continue: the state came from a checkpoint, or
  // this engine saw (as another rank) or made publications of this run.
  bool continues_run_ = false;
};

}  // namespace pulseloco::engine_detail
