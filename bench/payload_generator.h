// A streaming synthetic PULSELoCo run over a real model's tensor table (e.g. Qwen2.5-7B's), for
// the payload benchmark (bench/bench_payload.cpp; docs/benchmarks.md, "Payload").
//
// Every quantity of the simulation is element-wise: the initial weights, the gradients, the
// inner AdamW steps, the gate, the residual, the aggregate and the outer step of an element
// depend only on that element (plus per-step scalars). So the model is processed chunk by chunk
// (the engine's chunks, one wire frame each), each chunk through all windows and workers, and
// only a few chunk-sized buffers per thread are ever allocated: a 7.6e9-parameter model runs in
// well under 1 GiB. The result is exactly what the whole-model computation would give.
//
// Model (all settings stated in GeneratorConfig; none is fitted to a target density):
//   - weights: matrices, embeddings and biases N(0, weight_std^2), norm weights norm_weight,
//     rounded to bf16 (a bf16 checkpoint loaded into fp32 master weights);
//   - gradient of element i at inner step t of worker r:
//       g = grad_rms * c_rt * (signal * mu_i + noise * xi_irt)
//     mu_i ~ N(0, 1) persistent (the direction the data pushes the element), xi ~ N(0, 1)
//     fresh every step (Irwin-Hall, 4 uniforms), c_rt = exp(batch_scale_sigma * z_rt) one
//     factor per step and worker (batches differ in gradient norm);
//   - inner optimizer: PyTorch AdamW (decoupled weight decay, bias correction), fp32 local
//     weights. With warm_optimizer the moments start at their stationary expectations
//     (m = E[g], v = E[g^2]) and bias correction is 1, as deep into a run; otherwise they start
//     at zero at step 1;
//   - window boundary: the real CPU kernels (gate, commit_residual, aggregate, outer_step) and
//     the real encoder (codec::encode_frame) on every chunk of every worker.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include <pulseloco/codec/message.h>
#include "context_entropy.h"
#include "qwen_shapes.h"

namespace pulseloco::bench {

struct GeneratorConfig {
  std::vector<ModelTensor> tensors;
  int workers = 1;
  int windows = 1;
  int inner_steps = 8;  // H
  float lr = 3e-6f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.1f;
  float weight_std = 0.02f;
  float norm_weight = 1.0f;
  float grad_rms = 1e-4f;
  float signal = 0.3f;
  float noise = 0.954f;
  float batch_scale_sigma = 0.5f;
  bool warm_optimizer = true;
  float outer_lr = 0.7f;
  float outer_momentum = 0.9f;
  std::uint64_t chunk_elements = std::uint64_t{1} << 20;
  std::uint64_t seed = 1;
  codec::EncodeOptions codec{};
  // Decode every encoded frame and compare its offsets and value bits with the gate's output.
  bool verify_decode = true;
  // Estimate every frame's information under the context models (context_entropy.h).
  bool estimate_entropy = false;
  unsigned threads = 0;  // 0: all cores
  // When set, called with a chunk's global weights θ_g (tensor index, first element, the
  // number of windows done, the fp32 values): once with 0 windows done (the initial weights) and
  // after every window's outer step, the last window's included. Called from the pool's threads
  // at once, for disjoint chunks. The weights benchmark (bench_patches.cpp) publishes them.
  std::function<void(std::uint32_t tensor, std::uint64_t begin, int windows_done,
                     std::span<const float> global)>
      on_global_weights;
};

// One worker's message of one window.
struct WorkerMessage {
  std::uint64_t entries = 0;      // fired elements
  std::uint64_t ours_bytes = 0;   // the whole encoded message: header + every frame
  std::uint64_t index_bytes = 0;  // index streams + stream directories (verify_decode only)
  std::uint64_t value_bytes = 0;  // value streams (verify_decode only)
  std::uint64_t frames = 0;
  EntropyEstimate entropy;  // estimate_entropy only
};

struct GeneratorResult {
  std::uint64_t parameters = 0;
  std::uint64_t header_bytes = 0;  // the message header (tensor table included)
  // [window][worker]
  std::vector<std::vector<WorkerMessage>> messages;
  double seconds = 0;  // wall time of the whole run
  bool decode_verified = false;
};

// One encoded frame's sizes.
struct EncodedFrame {
  std::uint64_t bytes = 0;
  std::uint64_t index_bytes = 0;  // filled when verified
  std::uint64_t value_bytes = 0;  // filled when verified
};

// Encodes one chunk's entries with `options` (the context encoding against entries.context,
// which decoding uses too). With `verify`, wraps the frame in a one-frame
// message over the tensor table `numels`, decodes it with the reference decoder and compares
// offsets and value bits with `entries` (std::runtime_error naming the chunk on a mismatch).
[[nodiscard]] EncodedFrame encode_frame_checked(const codec::FrameEntries& entries,
                                                const codec::EncodeOptions& options,
                                                const std::vector<std::uint64_t>& numels,
                                                bool verify);

// Runs the simulation. Throws std::invalid_argument for a bad configuration and
// std::runtime_error when a decoded frame differs from what was encoded or the simulation
// diverges (a non-finite pseudo-gradient).
[[nodiscard]] GeneratorResult run_generator(const GeneratorConfig& config);

}  // namespace pulseloco::bench
