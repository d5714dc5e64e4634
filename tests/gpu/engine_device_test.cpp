// The engine with its state on the device (CudaStateMemory) against the engine with its state in
// host memory, on the same inputs: every window's digest, θ_g, m, e and θ_l bit for bit, in
// pulse and diloco, with fp32 and bf16 local weights, blocking and with overlapped windows
// (delayed and eager, pulse); a group mixing device and host ranks
// keeps one set of bits; checkpoints and traces from device ranks are byte-identical to host
// ranks'. Ranks are threads over the in-process transport (the multi-process tests over TCP are
// engine_device_process_test.cpp). Skips without a CUDA device.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/io/safetensors.h>
#include "gpu/device_model.h"
#include "gpu/gpu_test_util.h"

namespace pulseloco {
namespace {

namespace fs = std::filesystem;
using testing::TestRank;

const std::vector<std::uint64_t> kSizes{2500, 1, 3000};

struct GroupRun {
  std::vector<std::vector<Digest>> window_digests;                          // per window, per rank
  std::vector<std::vector<std::vector<float>>> global, momentum, residual;  // per rank, tensor
  std::vector<testing::LocalModel> models;                                  // θ_l at the end
  std::vector<std::string> locations;                                       // per rank
};

// `on_device[r]`: rank r keeps its state on cuda:0. Every rank trains the same way whatever its
// memory, so two runs that differ only there must agree bit for bit.
// `publish`: rank 0 also publishes θ_g after every window into files / "versions".
GroupRun run_group(Mode mode, DType dtype, const std::vector<bool>& on_device, int windows,
                   const fs::path& files = {}, Overlap overlap = Overlap::blocking,
                   bool publish = false) {
  const int world = static_cast<int>(on_device.size());
  EngineOptions options = testing::small_options(mode);
  options.overlap = overlap;
  if (publish) {
    options.publish_dir = (files / "versions").string();
    options.publish_every = 1;
  }
  if (!files.empty()) options.trace_dir = mode == Mode::pulse ? (files / "trace").string() : "";
  auto transports = transport::inproc::make_group(world);
  GroupRun run;
  run.window_digests.assign(static_cast<std::size_t>(windows), std::vector<Digest>(world));
  run.global.resize(world);
  run.momentum.resize(world);
  run.residual.resize(world);
  run.models.resize(world);
  run.locations.resize(world);
  testing::rethrow_first(testing::run_ranks(world, [&](int rank) {
    const auto r = static_cast<std::size_t>(rank);
    TestRank me(testing::make_model(kSizes, dtype, 11 + static_cast<std::uint32_t>(rank)),
                on_device[r]);
    Engine engine(me.views(), options, std::move(transports[r]));
    me.after_window();  // the broadcast wrote rank 0's weights
    run.locations[r] = engine.state_location();
    for (int w = 0; w < windows; ++w) {
      me.train(1e-3f, 4,
               1000 * static_cast<std::uint32_t>(w + 1) + static_cast<std::uint32_t>(rank));
      const WindowReport report = engine.run_window();
      me.after_window();
      run.window_digests[static_cast<std::size_t>(w)][r] = report.digest;
      EXPECT_EQ(report.state_location, run.locations[r]);
    }
    if (overlap != Overlap::blocking) {  // the last window's outer step
      ASSERT_TRUE(engine.complete_in_flight().has_value());
      me.after_window();
    }
    if (!files.empty()) engine.save_checkpoint(files / "checkpoint");
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      run.global[r].push_back(engine.copy_state(Engine::StateTensor::global_weights, t));
      run.momentum[r].push_back(engine.copy_state(Engine::StateTensor::momentum, t));
      run.residual[r].push_back(engine.copy_state(Engine::StateTensor::residual, t));
    }
    run.models[r] = me.model();
  }));
  return run;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void expect_same_state(const GroupRun& a, const GroupRun& b) {
  ASSERT_EQ(a.window_digests, b.window_digests);
  for (std::size_t r = 0; r < a.global.size(); ++r) {
    for (std::size_t t = 0; t < kSizes.size(); ++t) {
      EXPECT_TRUE(same_bits(a.global[r][t], b.global[r][t])) << "θ_g rank " << r << " tensor " << t;
      EXPECT_TRUE(same_bits(a.momentum[r][t], b.momentum[r][t]))
          << "m rank " << r << " tensor " << t;
      EXPECT_TRUE(same_bits(a.residual[r][t], b.residual[r][t]))
          << "e rank " << r << " tensor " << t;
      const testing::LocalTensor& x = a.models[r][t];
      const testing::LocalTensor& y = b.models[r][t];
      EXPECT_TRUE(x.f32 == y.f32 && x.bf16 == y.bf16) << "θ_l rank " << r << " tensor " << t;
    }
  }
}

struct DeviceCase {
  Mode mode;
  DType dtype;
};

class EngineDeviceState : public ::testing::TestWithParam<DeviceCase> {
 protected:
  void SetUp() override { PULSELOCO_SKIP_WITHOUT_GPU(); }
};

TEST_P(EngineDeviceState, WindowsMatchTheHostStateBitForBit) {
  const auto [mode, dtype] = GetParam();
  const GroupRun host = run_group(mode, dtype, {false, false}, 4);
  const GroupRun device = run_group(mode, dtype, {true, true}, 4);
  EXPECT_EQ(host.locations[0], "host");
  EXPECT_EQ(device.locations[0], "cuda:0");
  expect_same_state(host, device);
}

TEST_P(EngineDeviceState, AMixedGroupKeepsOneSetOfBits) {
  const auto [mode, dtype] = GetParam();
  // Two device ranks and a host rank for 5 windows; the engine compares every window's digests
  // (a difference throws DivergenceError), and the group matches an all-host group.
  const GroupRun mixed = run_group(mode, dtype, {true, false, true}, 5);
  const GroupRun host = run_group(mode, dtype, {false, false, false}, 5);
  for (const auto& digests : mixed.window_digests) {
    EXPECT_EQ(digests[0], digests[1]);
    EXPECT_EQ(digests[1], digests[2]);
  }
  expect_same_state(host, mixed);
}

INSTANTIATE_TEST_SUITE_P(ModesAndDtypes, EngineDeviceState,
                         ::testing::Values(DeviceCase{Mode::pulse, DType::float32},
                                           DeviceCase{Mode::pulse, DType::bfloat16},
                                           DeviceCase{Mode::diloco, DType::float32},
                                           DeviceCase{Mode::diloco, DType::bfloat16}),
                         [](const ::testing::TestParamInfo<DeviceCase>& param_info) {
                           return std::string(mode_name(param_info.param.mode)) + "_" +
                                  std::string(dtype_name(param_info.param.dtype));
                         });

struct OverlapCase {
  Overlap overlap;
  DType dtype;
};

class EngineDeviceOverlap : public ::testing::TestWithParam<OverlapCase> {
 protected:
  void SetUp() override { PULSELOCO_SKIP_WITHOUT_GPU(); }
};

// Overlapped windows with the state on the device (the eager start point S there too): every
// boundary's digest, and θ_g, m, e and θ_l after the last window, equal the host state's; a
// mixed group agrees with both.
TEST_P(EngineDeviceOverlap, WindowsMatchTheHostStateBitForBit) {
  const auto [overlap, dtype] = GetParam();
  const GroupRun host = run_group(Mode::pulse, dtype, {false, false}, 4, {}, overlap);
  const GroupRun device = run_group(Mode::pulse, dtype, {true, true}, 4, {}, overlap);
  EXPECT_EQ(device.locations[0], "cuda:0");
  expect_same_state(host, device);
  const GroupRun mixed = run_group(Mode::pulse, dtype, {true, false}, 4, {}, overlap);
  expect_same_state(host, mixed);
}

INSTANTIATE_TEST_SUITE_P(VariantsAndDtypes, EngineDeviceOverlap,
                         ::testing::Values(OverlapCase{Overlap::delayed, DType::float32},
                                           OverlapCase{Overlap::delayed, DType::bfloat16},
                                           OverlapCase{Overlap::eager, DType::float32},
                                           OverlapCase{Overlap::eager, DType::bfloat16}),
                         [](const ::testing::TestParamInfo<OverlapCase>& param_info) {
                           return std::string(overlap_name(param_info.param.overlap)) + "_" +
                                  std::string(dtype_name(param_info.param.dtype));
                         });

// A trace of a window's outputs records that window's report in its metadata: its timings and
// where the state lives differ between any two runs. Such files must agree in everything else
// (every tensor's bytes, every other metadata key); all other files byte for byte.
void expect_same_file(const fs::path& host, const fs::path& device, const fs::path& relative) {
  if (!relative.string().ends_with(".out.safetensors")) {
    EXPECT_EQ(testing::file_bytes(host), testing::file_bytes(device)) << relative;
    return;
  }
  const io::SafetensorsReader host_file(host);
  const io::SafetensorsReader device_file(device);
  io::Metadata host_metadata = host_file.metadata();
  io::Metadata device_metadata = device_file.metadata();
  EXPECT_EQ(host_metadata.erase("report"), 1u) << relative;
  EXPECT_EQ(device_metadata.erase("report"), 1u) << relative;
  EXPECT_EQ(host_metadata, device_metadata) << relative;
  ASSERT_EQ(host_file.tensors().size(), device_file.tensors().size()) << relative;
  for (const io::TensorInfo& tensor : host_file.tensors()) {
    const io::TensorInfo& other = device_file.tensor(tensor.spec.name);
    ASSERT_EQ(tensor.spec.dtype, other.spec.dtype) << relative << " " << tensor.spec.name;
    ASSERT_EQ(tensor.spec.shape, other.spec.shape) << relative << " " << tensor.spec.name;
    std::vector<std::byte> host_bytes(tensor.byte_size());
    std::vector<std::byte> device_bytes(other.byte_size());
    host_file.read(tensor.spec.name, host_bytes);
    device_file.read(tensor.spec.name, device_bytes);
    EXPECT_TRUE(host_bytes == device_bytes) << relative << " " << tensor.spec.name;
  }
}

TEST(EngineDeviceFiles, CheckpointsAndTracesMatchAHostRankByteForByte) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  for (const DType dtype : {DType::float32, DType::bfloat16}) {
    // Both runs write under the same path (the options in the files' metadata name it).
    const fs::path run_dir = testing::fresh_test_dir("device_files_run");
    const fs::path host_dir = testing::fresh_test_dir("device_files_host");
    const fs::path device_dir = testing::fresh_test_dir("device_files_device");
    (void)run_group(Mode::pulse, dtype, {false, false}, 3, run_dir);
    fs::rename(run_dir, host_dir);
    (void)run_group(Mode::pulse, dtype, {true, true}, 3, run_dir);
    fs::rename(run_dir, device_dir);
    std::size_t compared = 0;
    for (const auto& entry : fs::recursive_directory_iterator(host_dir)) {
      if (!entry.is_regular_file()) continue;
      const fs::path relative = fs::relative(entry.path(), host_dir);
      ASSERT_TRUE(fs::exists(device_dir / relative)) << relative;
      expect_same_file(entry.path(), device_dir / relative, relative);
      ++compared;
    }
    // global + 2 rank files, and per window 2 ranks x (in, out, message).
    EXPECT_EQ(compared, 3u + 3u * 2u * 3u) << dtype_name(dtype);
    fs::remove_all(host_dir);
    fs::remove_all(device_dir);
  }
}

// Publishing from device state, where only the elements whose bf16 bits changed leave the device
// (StateMemory::update_bf16_mirror), writes the versions that publishing from host state writes,
// file for file.
TEST(EngineDeviceFiles, PublishingFromDeviceStateWritesTheHostStatesVersions) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  for (const DType dtype : {DType::float32, DType::bfloat16}) {
    const fs::path run_dir = testing::fresh_test_dir("device_publish_run");
    const fs::path host_dir = testing::fresh_test_dir("device_publish_host");
    const fs::path device_dir = testing::fresh_test_dir("device_publish_device");
    fs::create_directories(host_dir);
    fs::create_directories(device_dir);
    (void)run_group(Mode::pulse, dtype, {false, false}, 4, run_dir, Overlap::blocking, true);
    fs::rename(run_dir / "versions", host_dir / "versions");
    fs::remove_all(run_dir);
    (void)run_group(Mode::pulse, dtype, {true, false}, 4, run_dir, Overlap::blocking, true);
    fs::rename(run_dir / "versions", device_dir / "versions");
    fs::remove_all(run_dir);
    std::size_t compared = 0;
    for (const auto& entry : fs::recursive_directory_iterator(host_dir)) {
      if (!entry.is_regular_file()) continue;
      const fs::path relative = fs::relative(entry.path(), host_dir);
      ASSERT_TRUE(fs::exists(device_dir / relative)) << relative;
      EXPECT_EQ(testing::file_bytes(entry.path()), testing::file_bytes(device_dir / relative))
          << relative;
      ++compared;
    }
    EXPECT_GE(compared, 5u) << dtype_name(dtype);  // the manifest, an anchor, the deltas
    fs::remove_all(host_dir);
    fs::remove_all(device_dir);
  }
}

TEST(EngineDeviceFiles, ADeviceRankResumesFromAHostRanksCheckpoint) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  const fs::path dir = testing::fresh_test_dir("device_resume");
  const GroupRun host = run_group(Mode::pulse, DType::float32, {false, false}, 2, dir);
  auto transports = transport::inproc::make_group(2);
  std::vector<Digest> loaded(2);
  testing::rethrow_first(testing::run_ranks(2, [&](int rank) {
    const auto r = static_cast<std::size_t>(rank);
    TestRank me(testing::make_model(kSizes, DType::float32, 50), /*on_device=*/rank == 0);
    EngineOptions options = testing::small_options(Mode::pulse);
    Engine engine(me.views(), options, std::move(transports[r]));
    engine.load_checkpoint(dir / "checkpoint");
    loaded[r] = engine.state_digest();
    EXPECT_TRUE(
        same_bits(engine.copy_state(Engine::StateTensor::residual, 0), host.residual[r][0]));
  }));
  EXPECT_EQ(loaded[0], host.window_digests.back()[0]);
  EXPECT_EQ(loaded[1], host.window_digests.back()[0]);
  fs::remove_all(dir);
}

TEST(EngineDeviceState, HostReadAccessorsRefuseDeviceStateAndCopiesWork) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  testing::LocalModel model = testing::make_model({1000}, DType::float32, 3);
  testing::DeviceModel device(model);
  Engine engine(device.views(model), testing::small_options(),
                std::move(transport::inproc::make_group(1)[0]));
  EXPECT_EQ(engine.state_location(), "cuda:0");
  EXPECT_THROW((void)engine.global_weights(0), InvalidArgument);
  const std::vector<float> global = engine.copy_state(Engine::StateTensor::global_weights, 0);
  EXPECT_TRUE(same_bits(global, model[0].f32));  // θ_g = θ_l at start-up
}

TEST(EngineDeviceState, ParametersOnAnotherDeviceThanTheFirstAreRefused) {
  PULSELOCO_SKIP_WITHOUT_GPU();
  if (kernels::cuda_device_count() < 2) GTEST_SKIP() << "one CUDA device: nothing to mix";
  testing::LocalModel model = testing::make_model({1000, 1000}, DType::float32, 3);
  testing::DeviceModel first(model, 0);
  testing::DeviceModel second(model, 1);
  std::vector<NamedTensor> views = first.views(model);
  views[1] = second.views(model)[1];
  EXPECT_THROW(Engine(std::move(views), testing::small_options()), InvalidArgument);
}

}  // namespace
}  // namespace pulseloco
