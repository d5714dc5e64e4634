// libtorch integration: wrap a module's parameters and call one method after each optimizer
// step. The only part of pulseloco that includes libtorch.
//
//   pulseloco::libtorch::Synchronizer sync(model->named_parameters(), options, std::move(t));
//   for (...) {
//     loss.backward();
//     sync.before_optimizer_step();   // ddp averages gradients here; a no-op otherwise
//     optimizer.step();
//     if (auto report = sync.after_optimizer_step()) { ... }  // a window ran
//   }
#pragma once

#include <torch/types.h>
// Not self-contained: needs torch/types.h (TORCH_CHECK) before it.
#include <torch/optim/optimizer.h>
#include <torch/ordered_dict.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/elastic/elastic_engine.h>
#include <pulseloco/engine/engine.h>

namespace pulseloco::libtorch {

// The optimizer's state (torch::save into memory) as the checkpoint file `name`, for
// CheckpointSave::files. Throws InvalidArgument when libtorch cannot serialise it.
[[nodiscard]] CheckpointFile optimizer_file(const torch::optim::Optimizer& optimizer,
                                            std::string name = "optimizer.pt");
// Restores the optimizer from the file `name` of a loaded checkpoint (verified by
// load_checkpoint). Throws InvalidArgument when the checkpoint holds no such file of this
// rank, ProtocolError naming the file when libtorch cannot read it.
void load_optimizer(torch::optim::Optimizer& optimizer, const LoadedCheckpoint& loaded,
                    std::string_view name = "optimizer.pt");

class Synchronizer {
 public:
  // Collective. Parameters must be contiguous fp32 or bf16 tensors, all on the CPU or all on
  // one CUDA device. For CUDA parameters options.state_location chooses where θ_g, m and e live
  // (docs/operations.md): `device` keeps them next to the parameters and hands the engine device
  // pointers (the program links pulseloco_engine_cuda and the adapter was built against a CUDA
  // libtorch); `host` stages the parameters through pinned host buffers at each window;
  // `automatic` is `device` when the program links pulseloco_engine_cuda, `host` otherwise.
  // The device work is ordered after the current CUDA stream of the parameters' device and that
  // stream's later work after it, with events. Rank 0's values are broadcast into every replica.
  Synchronizer(const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
               EngineOptions options, std::unique_ptr<transport::Transport> transport);
  // An elastic run (docs/elastic.md): registers with the coordinator, waits to be admitted and
  // takes the group's weights; windows survive lost workers and admit new ones.
  Synchronizer(const torch::OrderedDict<std::string, torch::Tensor>& named_parameters,
               EngineOptions options, ElasticOptions elastic);
  ~Synchronizer();
  Synchronizer(const Synchronizer&) = delete;
  Synchronizer& operator=(const Synchronizer&) = delete;

  // ddp: average every parameter's gradient across ranks (collective). Other modes: nothing.
  void before_optimizer_step();

  // Counts the step; every H-th call runs a window (collective) and returns its report.
  [[nodiscard]] std::optional<WindowReport> after_optimizer_step();

  // Overlapped windows (EngineOptions::overlap): Engine::complete_in_flight() (collective), with
  // the weights it leaves written into the parameters; e.g. after the last step, so that they
  // include the last window. Nothing (and no copy) when no window is in flight.
  [[nodiscard]] std::optional<WindowReport> complete_in_flight();

  // Engine::save_checkpoint and load_checkpoint (collective; docs/operations.md,
  // "Checkpoints"): a new directory under `root` that commits as a whole, with this rank's own
  // files (optimizer_file() below) listed in its manifest with their checksums; loading verifies
  // them and returns them (those `required_files` names must be there: load_optimizer's).
  std::filesystem::path save_checkpoint(const std::filesystem::path& root,
                                        const CheckpointSave& save = {});
  LoadedCheckpoint load_checkpoint(const std::filesystem::path& path,
                                   std::span<const std::string> required_files = {});

  [[nodiscard]] Engine& engine() noexcept { return runner_->engine(); }
  // The elastic driver, when constructed for an elastic run (else null).
  [[nodiscard]] ElasticEngine* elastic() noexcept { return elastic_; }

 private:
  // Checks the parameters, sets up host staging and returns the engine's views of them.
  std::vector<NamedTensor> prepare(
      const torch::OrderedDict<std::string, torch::Tensor>& named_parameters);
  void stage_to_host();
  void stage_from_host();
  // Device state: the engine's work follows the user's current stream (and precedes its later
  // work). Nothing otherwise.
  void order_with_current_stream();

  std::vector<std::string> names_;
  std::vector<torch::Tensor> parameters_;  // the user's tensors
  std::vector<torch::Tensor> host_;        // what the engine sees (== parameters_ on the CPU)
  StateLocation options_location_ = StateLocation::automatic;
  bool staged_ = false;
  bool device_state_ = false;  // the engine holds device pointers to parameters_
  int device_index_ = 0;
  std::unique_ptr<WindowRunner> runner_;  // an Engine (a fixed group) or an ElasticEngine
  ElasticEngine* elastic_ = nullptr;      // runner_, when it is an ElasticEngine
};

}  // namespace pulseloco::libtorch
