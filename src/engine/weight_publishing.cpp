#include <pulseloco/engine/weight_publishing.h>

#include <fmt/format.h>

#include <chrono>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/patch/bucket.h>
#include <pulseloco/patch/manifest.h>
#include <pulseloco/patch/publisher.h>

namespace pulseloco::engine_detail {

WeightPublishing::WeightPublishing(const EngineOptions& options) : options_(options) {}
WeightPublishing::~WeightPublishing() = default;

void WeightPublishing::after_window(const ReplicatedState& state, int rank, WindowReport& report) {
  if (options_.publish_dir.empty()) return;
  if (rank != 0) {
    // One publisher per job: a rank that is no longer 0 (a new group) lets the new rank 0 go on.
    publisher_.reset();
    if (state.committed_windows() % options_.publish_every == 0) continues_run_ = true;
    return;
  }
  if (state.committed_windows() % options_.publish_every != 0) return;
  const auto start = std::chrono::steady_clock::now();
  try {
    publish(state, report);
  } catch (const std::exception& e) {
    // The window has committed everywhere; only the inference servers' copy lags behind.
    report.publish_error = e.what();
    logger().warn("window {}: θ_g not published to {}: {}", report.window, options_.publish_dir,
                  e.what());
  }
  report.seconds.publish =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void WeightPublishing::publish(const ReplicatedState& state, WindowReport& report) {
  const std::uint64_t version = state.committed_windows();
  if (!publisher_) {
    if (!continues_run_ && !options_.publish_continue) {
      const std::optional<patch::Manifest> found = patch::find_manifest(options_.publish_dir);
      if (found && !found->versions.empty()) {
        const patch::Manifest& existing = *found;
        throw InvalidArgument(fmt::format(
            "publish_dir '{}' already holds versions {} to {}, published before this run "
            "started: publish into an empty directory, or set publish_continue "
            "(pulseloco_train --publish-continue) to publish this run's versions after them",
            options_.publish_dir, existing.versions.front().version,
            existing.versions.back().version));
      }
    }
    publisher_ = std::make_unique<patch::Publisher>(
        options_.publish_dir,
        patch::PublisherOptions{
            .anchor_every = options_.anchor_every,
            .chunk_elements = options_.chunk_elements,  // validated: at most kMaxChunkElements
            .threads = options_.threads,
            .continue_existing = true,
        });
  }
  const auto& versions = publisher_->manifest().versions;
  if (!versions.empty() && versions.back().version >= version) {
    // A run resumed from a checkpoint older than what it had published: the versions resume
    // above the newest, as deltas from it (a patch holds absolute values).
    throw InvalidArgument(fmt::format("version {} is not above {}, the newest in the directory",
                                      version, versions.back().version));
  }
  // Host state is read in place. Device state through bf16(θ_g) mirrored in host memory: only
  // the elements whose bf16 bits changed cross from the device, and the publisher compares the
  // mirror's bits with its snapshot as it would compare bf16(θ_g).
  const bool host = state.memory().device().is_cpu();
  if (!host) (void)state.memory().update_bf16_mirror(device_mirror_);
  std::vector<patch::WeightsView> weights;
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    if (host) {
      weights.push_back({.name = state.name(t),
                         .shape = state.shape(t),
                         .data = state.host_values(StateBuffer::global, t).data(),
                         .dtype = DType::float32});
    } else {
      weights.push_back({.name = state.name(t),
                         .shape = state.shape(t),
                         .data = device_mirror_[t].data(),
                         .dtype = DType::bfloat16});
    }
  }
  const patch::PublishedVersion published = publisher_->publish(weights, version);
  continues_run_ = true;
  report.published_version = published.version;
  report.patch_changed = published.changed;
  report.patch_density = report.parameters > 0 ? static_cast<double>(published.changed) /
                                                     static_cast<double>(report.parameters)
                                               : 0.0;
  report.patch_delta_bytes = published.delta_bytes;
  report.patch_compact_bytes = published.compact_bytes;
  report.patch_anchor_bytes = published.anchor_bytes;
}

}  // namespace pulseloco::engine_detail
