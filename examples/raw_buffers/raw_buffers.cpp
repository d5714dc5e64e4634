// pulseloco without libtorch: the Engine over the training program's own float buffers. Each
// worker fits a linear model y = <w, x> + b to its own shard of a regression problem with plain
// SGD, and calls after_optimizer_step() after each step; every H = 4 steps a window exchanges
// the workers' progress and writes the new weights into the same buffers.
//
//   mpirun -np 2 build/bin/pulseloco_raw_buffers                 # ranks from mpirun
//   RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 build/bin/pulseloco_raw_buffers &
//   RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 build/bin/pulseloco_raw_buffers
//
// It links pulseloco::core only. Every window checks that the replicas are bit-identical (exit
// 3 if not).
#include <fmt/format.h>

#include <cstdio>
#include <exception>
#include <random>
#include <vector>

#include <pulseloco/pulseloco.h>

int main() try {
  constexpr std::size_t kFeatures = 16;
  // The model: the engine reads and writes these buffers in place (no copy); they must outlive
  // it and keep their addresses.
  std::vector<float> weights(kFeatures, 0.0f);
  std::vector<float> bias(1, 0.0f);

  auto transport = pulseloco::group::make_transport(pulseloco::group::from_environment());
  const int rank = transport->rank();
  pulseloco::EngineOptions options;  // mode pulse
  options.steps_per_window = 4;      // H
  // Every rank passes the same tensors (names, sizes, dtypes) in the same order; rank 0's values
  // become everyone's here.
  pulseloco::Engine engine(
      {
          {"weights", pulseloco::TensorView{weights.data(), weights.size(),
                                            pulseloco::DType::float32, pulseloco::Device{}}},
          {"bias", pulseloco::TensorView{bias.data(), bias.size(), pulseloco::DType::float32,
                                         pulseloco::Device{}}},
      },
      options, std::move(transport));

  // Each worker's data: y = <w_true, x> + 0.5 + noise, from its own random stream.
  std::mt19937 rng(1000 + static_cast<unsigned>(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(kFeatures);
  constexpr float kLearningRate = 0.05f;
  for (int step = 0; step < 40; ++step) {
    // One SGD step on one example: the local (inner) optimizer is the program's own.
    float target = 0.5f + 0.01f * normal(rng);
    for (std::size_t i = 0; i < kFeatures; ++i) {
      x[i] = normal(rng);
      target += (static_cast<float>(i) / kFeatures - 0.5f) * x[i];
    }
    float prediction = bias[0];
    for (std::size_t i = 0; i < kFeatures; ++i)
      prediction += weights[i] * x[i];
    const float error = prediction - target;
    for (std::size_t i = 0; i < kFeatures; ++i)
      weights[i] -= kLearningRate * error * x[i];
    bias[0] -= kLearningRate * error;

    if (auto report = engine.after_optimizer_step()) {  // every H-th call: a window ran
      if (rank == 0) {
        fmt::print("window {}: squared error {:.4f}, sent {} of {} elements, replicas {}\n",
                   report->window, error * error, report->entries_sent, report->parameters,
                   report->replicas_identical ? "identical" : "DIFFER");
      }
    }
  }
  if (rank == 0) fmt::print("done: digest {:016x}\n", engine.state_digest());
  return 0;
} catch (const std::exception& error) {
  std::fprintf(stderr, "pulseloco_raw_buffers: %s\n", error.what());
  return 1;
}
