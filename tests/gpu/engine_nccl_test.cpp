// The engine over a one-rank NCCL transport, with its state on the device and in host memory,
// against the same engine over the in-process transport: every mode (pulse, diloco, ddp) gives
// the same digests, θ_g, m and θ_l bit for bit (one rank's all-reduce is its own Δ, whatever
// the backend's summation order), and with state on the device the same digests and averaged
// gradients as with state in host memory. With the state on the transport's device the dense
// buckets handed to the all-reduce are device memory (nothing for the transport to stage); with the
// state in host memory they are host memory. Skips without a CUDA device; NCCL cannot give two
// ranks of one communicator the same GPU, so one GPU runs world size 1.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <pulseloco/engine/engine.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/transport/forwarding.h>
#include <pulseloco/transport/inproc/inproc.h>
#include <pulseloco/transport/native_collectives.h>
#include "gpu/device_model.h"
#include "gpu/gpu_test_util.h"

namespace pulseloco {
namespace {

using testing::LocalModel;
using testing::TestRank;
using transport::Deadline;
using transport::Transport;

const std::vector<std::uint64_t> kSizes{2500, 1, 3000};
constexpr int kWindows = 3;

bool is_device_memory(const void* pointer) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();  // host memory unknown to CUDA: not an error to carry on
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice;
}

// Forwards everything to the NCCL transport and records where the all-reduce's buffers live.
class RecordingTransport final : public transport::ForwardingTransport,
                                 public transport::NativeCollectives {
 public:
  explicit RecordingTransport(std::unique_ptr<Transport> inner)
      : ForwardingTransport(std::move(inner)),
        native_(transport::native_collectives(this->inner())) {}

  void retire_tag(transport::Tag tag) noexcept override { inner().retire_tag(tag); }

  bool allgatherv(std::span<const std::byte> mine, std::span<const std::uint64_t> counts,
                  std::span<std::byte> out, Deadline deadline) override {
    return native_->allgatherv(mine, counts, out, deadline);
  }
  bool allgather_into(std::span<const std::byte> mine, std::span<const std::span<std::byte>> out,
                      Deadline deadline) override {
    return native_->allgather_into(mine, out, deadline);
  }
  bool allreduce_sum(std::span<const float> input, std::span<float> output,
                     Deadline deadline) override {
    ++allreduces;
    if (!is_device_memory(input.data()) || !is_device_memory(output.data())) ++host_allreduces;
    return native_->allreduce_sum(input, output, deadline);
  }
  void broadcast(int root, std::span<std::byte> data, Deadline deadline) override {
    native_->broadcast(root, data, deadline);
  }
  void barrier(Deadline deadline) override { native_->barrier(deadline); }

  int allreduces = 0;
  int host_allreduces = 0;  // calls with a buffer outside device memory (staged by NCCL)

 private:
  transport::NativeCollectives* native_;
};

std::unique_ptr<Transport> one_rank_nccl() {
  group::TransportOptions options;
  options.backend = transport::Backend::nccl;
  options.world_size = 1;
  options.nccl_bootstrap = group::NcclBootstrap::tcp;
  return group::make_transport(options);
}

struct EngineRun {
  std::vector<Digest> digests;                       // per window
  std::vector<std::vector<float>> global, momentum;  // per tensor (not in ddp)
  LocalModel model;                                  // θ_l at the end
  std::vector<std::vector<float>> averaged;          // ddp: the last averaged gradients
  int allreduces = 0, host_allreduces = 0;           // over NCCL only
};

// A gradient per tensor for step `step` (fp32 or bf16 like the parameter), where the engine's
// memory reads it: on the device with device state, on the host otherwise.
class Gradients {
 public:
  Gradients(DType dtype, std::uint32_t seed, bool on_device)
      : model_(testing::make_model(kSizes, dtype, seed)) {
    if (on_device) device_ = std::make_unique<testing::DeviceModel>(model_);
  }
  [[nodiscard]] std::vector<TensorView> views() {
    std::vector<TensorView> views;
    for (const NamedTensor& named : device_ ? device_->views(model_) : testing::views_of(model_)) {
      views.push_back(named.view);
    }
    return views;
  }
  // The averaged gradients, as fp32 (after average_gradients).
  [[nodiscard]] std::vector<std::vector<float>> read() {
    if (device_) device_->download(model_);
    std::vector<std::vector<float>> values;
    for (const testing::LocalTensor& tensor : model_) {
      std::vector<float>& out = values.emplace_back(tensor.numel());
      for (std::size_t i = 0; i < out.size(); ++i)
        out[i] = tensor.get(i);
    }
    return values;
  }

 private:
  LocalModel model_;
  std::unique_ptr<testing::DeviceModel> device_;
};

EngineRun run_engine(Mode mode, DType dtype, bool on_device, bool over_nccl) {
  EngineOptions options = testing::small_options(mode);
  std::unique_ptr<Transport> transport;
  RecordingTransport* recording = nullptr;
  if (over_nccl) {
    auto wrapped = std::make_unique<RecordingTransport>(one_rank_nccl());
    recording = wrapped.get();
    transport = std::move(wrapped);
  } else {
    transport = std::move(transport::inproc::make_group(1).front());
  }
  TestRank me(testing::make_model(kSizes, dtype, 11), on_device);
  Engine engine(me.views(), options, std::move(transport));
  me.after_window();
  EXPECT_EQ(engine.state_location(), on_device ? "cuda:0" : "host");
  EngineRun run;
  for (int w = 0; w < kWindows; ++w) {
    const auto seed = 1000 * static_cast<std::uint32_t>(w + 1);
    me.train(1e-3f, 4, seed);
    if (mode == Mode::ddp) {
      std::optional<WindowReport> report;
      for (std::uint32_t step = 0; step < options.steps_per_window; ++step) {
        Gradients gradients(dtype, seed + step, on_device);
        engine.average_gradients(gradients.views());
        run.averaged = gradients.read();
        report = engine.after_optimizer_step();
      }
      EXPECT_TRUE(report.has_value());
      if (report) run.digests.push_back(report->digest);
    } else {
      run.digests.push_back(engine.run_window().digest);
    }
    me.after_window();
  }
  if (mode != Mode::ddp) {
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      run.global.push_back(engine.copy_state(Engine::StateTensor::global_weights, t));
      run.momentum.push_back(engine.copy_state(Engine::StateTensor::momentum, t));
    }
  }
  run.model = me.model();
  if (recording != nullptr) {
    run.allreduces = recording->allreduces;
    run.host_allreduces = recording->host_allreduces;
  }
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct NcclCase {
  Mode mode;
  DType dtype;
  bool on_device;
};

std::string case_name(const ::testing::TestParamInfo<NcclCase>& info) {
  const NcclCase& c = info.param;
  return std::string(mode_name(c.mode)) + (c.dtype == DType::float32 ? "_fp32" : "_bf16") +
         (c.on_device ? "_DeviceState" : "_HostState");
}

class EngineOverNccl : public ::testing::TestWithParam<NcclCase> {
 protected:
  void SetUp() override { PULSELOCO_SKIP_WITHOUT_GPU(); }
};

TEST_P(EngineOverNccl, MatchesTheInProcessTransportBitForBit) {
  const auto [mode, dtype, on_device] = GetParam();
  const EngineRun inproc = run_engine(mode, dtype, on_device, /*over_nccl=*/false);
  const EngineRun nccl = run_engine(mode, dtype, on_device, /*over_nccl=*/true);
  ASSERT_EQ(nccl.digests.size(), static_cast<std::size_t>(kWindows));
  EXPECT_EQ(nccl.digests, inproc.digests);
  for (std::size_t t = 0; t < nccl.global.size(); ++t) {
    EXPECT_TRUE(same_bits(nccl.global[t], inproc.global[t])) << "θ_g tensor " << t;
    EXPECT_TRUE(same_bits(nccl.momentum[t], inproc.momentum[t])) << "m tensor " << t;
  }
  for (std::size_t t = 0; t < kSizes.size(); ++t) {
    const testing::LocalTensor& x = nccl.model[t];
    const testing::LocalTensor& y = inproc.model[t];
    EXPECT_TRUE(x.f32 == y.f32 && x.bf16 == y.bf16) << "θ_l tensor " << t;
  }
  ASSERT_EQ(nccl.averaged.size(), inproc.averaged.size());
  for (std::size_t t = 0; t < nccl.averaged.size(); ++t) {
    EXPECT_TRUE(same_bits(nccl.averaged[t], inproc.averaged[t])) << "gradient tensor " << t;
  }
  if (!on_device) return;
  // The device's bucket operations (ddp's gradients in and out included) against the host's.
  const EngineRun host = run_engine(mode, dtype, /*on_device=*/false, /*over_nccl=*/false);
  EXPECT_EQ(nccl.digests, host.digests);
  ASSERT_EQ(nccl.averaged.size(), host.averaged.size());
  for (std::size_t t = 0; t < nccl.averaged.size(); ++t) {
    EXPECT_TRUE(same_bits(nccl.averaged[t], host.averaged[t])) << "gradient tensor " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(ModesAndMemories, EngineOverNccl,
                         ::testing::Values(NcclCase{Mode::pulse, DType::float32, true},
                                           NcclCase{Mode::pulse, DType::bfloat16, true},
                                           NcclCase{Mode::pulse, DType::float32, false},
                                           NcclCase{Mode::diloco, DType::float32, true},
                                           NcclCase{Mode::diloco, DType::bfloat16, true},
                                           NcclCase{Mode::diloco, DType::float32, false},
                                           NcclCase{Mode::ddp, DType::float32, true},
                                           NcclCase{Mode::ddp, DType::bfloat16, true},
                                           NcclCase{Mode::ddp, DType::float32, false}),
                         case_name);

// The dense buckets live where the transport takes them: device memory when the state is on
// the transport's device (no payload staged through the host), host memory otherwise.
class DenseBucketsOverNccl : public EngineOverNccl {};

TEST_P(DenseBucketsOverNccl, AreDeviceMemoryExactlyWhenTheStateIsOnTheDevice) {
  const auto [mode, dtype, on_device] = GetParam();
  const EngineRun nccl = run_engine(mode, dtype, on_device, /*over_nccl=*/true);
  EXPECT_GT(nccl.allreduces, 0);
  EXPECT_EQ(nccl.host_allreduces, on_device ? 0 : nccl.allreduces);
}

INSTANTIATE_TEST_SUITE_P(DenseModes, DenseBucketsOverNccl,
                         ::testing::Values(NcclCase{Mode::diloco, DType::float32, true},
                                           NcclCase{Mode::diloco, DType::float32, false},
                                           NcclCase{Mode::ddp, DType::bfloat16, true},
                                           NcclCase{Mode::ddp, DType::float32, false}),
                         case_name);

}  // namespace
}  // namespace pulseloco
