// The smallest useful pulseloco program: an ordinary libtorch training loop, plus the lines
// marked "pulseloco" that make several processes train one model with PULSELoCo.
//
//   mpirun -np 4 build/bin/pulseloco_embed                       # ranks from mpirun
//   RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 build/bin/pulseloco_embed &
//   RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 build/bin/pulseloco_embed
//
// Every worker fits the same two-layer network to its own shard of a regression problem; every
// H = 4 steps the workers exchange the bf16-visible part of their progress and continue from the
// same averaged weights. Every window checks that the replicas are bit-identical (DivergenceError
// if not: exit 1). libtorch: just the parts this program uses (<torch/torch.h> works too; it
// compiles slower).
#include <fmt/format.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/types.h>
#include <torch/utils.h>

#include <cstdio>
#include <exception>

#include <pulseloco/pulseloco.h>  // pulseloco
#include <pulseloco/torch.h>      // pulseloco

int main() try {
  torch::manual_seed(0);  // the same initial weights everywhere (rank 0's are broadcast anyway)
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 1));
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(1e-3));

  // pulseloco: join the group (mpirun or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) and wrap the
  // parameters. Rank 0's weights are broadcast to every worker here.
  auto transport = pulseloco::group::make_transport(pulseloco::group::from_environment());
  const int rank = transport->rank();
  pulseloco::EngineOptions options;
  options.steps_per_window = 4;  // H
  pulseloco::libtorch::Synchronizer sync(model->named_parameters(), options, std::move(transport));

  // Each worker's data: y = <w, x> + noise, from its own random stream.
  torch::manual_seed(1000 + rank);
  const torch::Tensor w_true = torch::linspace(-1, 1, 32);
  for (int step = 0; step < 40; ++step) {
    const torch::Tensor x = torch::randn({64, 32});
    const torch::Tensor y = (x.matmul(w_true) + 0.01 * torch::randn({64})).unsqueeze(1);
    optimizer.zero_grad();
    const torch::Tensor loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    sync.before_optimizer_step();  // pulseloco (averages gradients in mode ddp; else nothing)
    optimizer.step();
    if (auto report = sync.after_optimizer_step()) {  // pulseloco: a window ran
      if (rank == 0) {
        fmt::print(
            "window {}: loss {:.4f}, sent {} of {} elements ({:.1f}%), {} bytes "
            "(DiLoCo {}), replicas {}\n",
            report->window, loss.item<double>(), report->entries_sent, report->parameters,
            100.0 * report->density, report->payload_bytes, report->diloco_bytes,
            report->replicas_identical ? "identical" : "DIFFER");
      }
    }
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "pulseloco_embed: %s\n", e.what());
  return 1;
}
