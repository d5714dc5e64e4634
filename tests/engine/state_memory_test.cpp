// The engine's state behind its memory interface (state_memory.h): the host memory with host
// access in small pieces (what a device memory does through its pinned staging) writes
// checkpoints and traces byte-identical to the host memory's whole-buffer path and keeps the same
// digests; the choice of memory refuses what it cannot hold, naming the tensor.
#include <gtest/gtest.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/attached_group.h>
#include <pulseloco/engine/checkpoint.h>
#include <pulseloco/engine/group_join.h>
#include <pulseloco/engine/host_state_memory.h>
#include <pulseloco/engine/replicated_state.h>
#include <pulseloco/engine/state_files.h>
#include <pulseloco/engine/trace.h>
#include <pulseloco/engine/window_strategy.h>
#include "engine/engine_test_util.h"

namespace pulseloco::state_memory_test {
namespace {

namespace fs = std::filesystem;
using engine_detail::HostStateMemory;
using engine_detail::ReplicatedState;
using engine_detail::StateMemory;
using engine_detail::StateTensors;

constexpr int kWorld = 2;
constexpr int kWindows = 3;
const std::vector<std::uint64_t> kSizes{2500, 1, 700};

struct RunResult {
  std::vector<Digest> digests;  // per rank, after the last window
};

// kWorld ranks on threads, over ReplicatedState with the memory `piece_bytes` makes: the first
// group (rank 0's weights broadcast), kWindows windows, then a checkpoint and a trace of the
// next window's inputs under `dir`.
RunResult run_group(Mode mode, DType dtype, std::uint64_t piece_bytes, const fs::path& dir) {
  EngineOptions options = testing::small_options(mode);
  options.trace_dir = (dir / "trace").string();
  auto transports = transport::inproc::make_group(kWorld);
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < kWorld; ++r)
    models.push_back(testing::make_model(kSizes, dtype, 7 + static_cast<std::uint32_t>(r)));
  RunResult result;
  result.digests.resize(kWorld);
  testing::rethrow_first(testing::run_ranks(kWorld, [&](int rank) {
    ThreadPool pool(2);
    const auto memory = [piece_bytes](StateTensors tensors) -> std::unique_ptr<StateMemory> {
      return std::make_unique<HostStateMemory>(std::move(tensors), piece_bytes);
    };
    testing::LocalModel& model = models[static_cast<std::size_t>(rank)];
    ReplicatedState state(testing::views_of(model), options, memory);
    const engine_detail::AttachedGroup group(*transports[static_cast<std::size_t>(rank)], options,
                                             GroupInfo{}, nullptr, nullptr);
    (void)engine_detail::join_group(group, state, options, pool, nullptr);
    const auto strategy = engine_detail::make_window_strategy(state, options, pool);
    for (int w = 0; w < kWindows; ++w) {
      testing::local_training(
          model, 1e-3f, 4,
          100 * static_cast<std::uint32_t>(w + 1) + static_cast<std::uint32_t>(rank));
      WindowReport report;
      strategy->run(group, report);
      state.commit_window();
    }
    (void)engine_detail::save_checkpoint(state, options, group, pool, dir / "checkpoint",
                                         /*root_is_this_runs=*/false);
    if (mode == Mode::pulse)
      engine_detail::write_trace_inputs(state, options, group, state.committed_windows());
    result.digests[static_cast<std::size_t>(rank)] = state.digest(pool);
  }));
  return result;
}

struct PiecewiseCase {
  Mode mode;
  DType dtype;
};

class PiecewiseHostAccess : public ::testing::TestWithParam<PiecewiseCase> {};

TEST_P(PiecewiseHostAccess, WritesTheSameFilesAndDigestsAsWholeBuffers) {
  const auto [mode, dtype] = GetParam();
  // Both runs write under the same path (the options in the files' metadata name it).
  const fs::path run_dir = testing::fresh_test_dir("state_memory_run");
  const fs::path whole_dir = testing::fresh_test_dir("state_memory_whole");
  const fs::path piece_dir = testing::fresh_test_dir("state_memory_pieces");
  const RunResult whole = run_group(mode, dtype, 0, run_dir);
  fs::rename(run_dir, whole_dir);
  // 36 bytes: pieces that end inside tensors, and a bf16 θ_l split between elements' words.
  const RunResult pieces = run_group(mode, dtype, 36, run_dir);
  fs::rename(run_dir, piece_dir);
  EXPECT_EQ(whole.digests, pieces.digests);
  EXPECT_EQ(whole.digests[0], whole.digests[1]);
  std::vector<fs::path> files;
  for (const auto& entry : fs::recursive_directory_iterator(whole_dir)) {
    if (entry.is_regular_file()) files.push_back(fs::relative(entry.path(), whole_dir));
  }
  ASSERT_GE(files.size(), mode == Mode::pulse ? 5u : 3u);
  for (const fs::path& file : files) {
    ASSERT_TRUE(fs::exists(piece_dir / file)) << file;
    EXPECT_EQ(testing::file_bytes(whole_dir / file), testing::file_bytes(piece_dir / file)) << file;
  }
  fs::remove_all(whole_dir);
  fs::remove_all(piece_dir);
}

INSTANTIATE_TEST_SUITE_P(ModesAndDtypes, PiecewiseHostAccess,
                         ::testing::Values(PiecewiseCase{Mode::pulse, DType::float32},
                                           PiecewiseCase{Mode::pulse, DType::bfloat16},
                                           PiecewiseCase{Mode::diloco, DType::float32}),
                         [](const ::testing::TestParamInfo<PiecewiseCase>& param_info) {
                           return std::string(mode_name(param_info.param.mode)) + "_" +
                                  std::string(dtype_name(param_info.param.dtype));
                         });

TEST(PiecewiseHostAccess, LoadsACheckpointAndATraceInPieces) {
  const fs::path dir = testing::fresh_test_dir("state_memory_load");
  const RunResult written = run_group(Mode::pulse, DType::float32, 0, dir);
  EngineOptions options = testing::small_options(Mode::pulse);
  auto transports = transport::inproc::make_group(kWorld);
  std::vector<testing::LocalModel> models;
  for (int r = 0; r < kWorld; ++r)
    models.push_back(testing::make_model(kSizes, DType::float32, 99));
  std::vector<Digest> loaded(kWorld);
  std::vector<std::vector<float>> residuals(kWorld);
  testing::rethrow_first(testing::run_ranks(kWorld, [&](int rank) {
    ThreadPool pool(2);
    const auto memory = [](StateTensors tensors) -> std::unique_ptr<StateMemory> {
      return std::make_unique<HostStateMemory>(std::move(tensors), 20);
    };
    ReplicatedState state(testing::views_of(models[static_cast<std::size_t>(rank)]), options,
                          memory);
    const engine_detail::AttachedGroup group(*transports[static_cast<std::size_t>(rank)], options,
                                             GroupInfo{}, nullptr, nullptr);
    (void)engine_detail::join_group(group, state, options, pool, nullptr);
    engine_detail::load_checkpoint(state, options, group, pool, dir / "checkpoint");
    loaded[static_cast<std::size_t>(rank)] = state.digest(pool);
    // The trace holds the same state as the checkpoint (both after the last window).
    engine_detail::load_trace_inputs(
        state, rank, kWorld,
        state_files::trace_file(dir / "trace", kWindows, rank, /*inputs=*/true));
    EXPECT_EQ(state.digest(pool), loaded[static_cast<std::size_t>(rank)]);
    residuals[static_cast<std::size_t>(rank)] =
        state.copy_values(engine_detail::StateBuffer::residual, 0);
  }));
  EXPECT_EQ(loaded, written.digests);
  EXPECT_EQ(residuals[0].size(), kSizes[0]);
  fs::remove_all(dir);
}

// --- where the state lives ---------------------------------------------------------------------

std::vector<NamedTensor> tensors_on(std::vector<float>& a, std::vector<float>& b, Device first,
                                    Device second) {
  return {{"w1", TensorView{a.data(), a.size(), DType::float32, first}},
          {"w2", TensorView{b.data(), b.size(), DType::float32, second}}};
}

TEST(StateLocation, HostTensorsKeepTheirStateInHostMemory) {
  std::vector<float> a(100, 0.5f), b(50, 0.25f);
  Engine engine(tensors_on(a, b, Device{}, Device{}), testing::small_options());
  EXPECT_EQ(engine.state_location(), "host");
  EXPECT_EQ(engine.copy_state(Engine::StateTensor::global_weights, 0).size(), 100u);
}

TEST(StateLocation, WindowReportsAndTheirJsonNameIt) {
  testing::LocalModel model = testing::make_model({3000}, DType::float32, 5);
  Engine engine(testing::views_of(model), testing::small_options(),
                std::move(transport::inproc::make_group(1)[0]));
  const WindowReport report = engine.run_window();
  EXPECT_EQ(report.state_location, "host");
  EXPECT_EQ(to_json(report).at("state_location"), "host");
}

TEST(StateLocation, DeviceStateForCpuTensorsIsRefusedNamingTheTensor) {
  std::vector<float> a(100), b(50);
  EngineOptions options = testing::small_options();
  options.state_location = StateLocation::device;
  try {
    Engine engine(tensors_on(a, b, Device{}, Device{}), options);
    FAIL() << "state_location=device with CPU tensors was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.context().tensor, "w1");
  }
}

TEST(StateLocation, ParametersOnSeveralDevicesAreRefusedNamingTheTensor) {
  std::vector<float> a(100), b(50);
  try {
    Engine engine(tensors_on(a, b, Device{}, Device{DeviceKind::cuda, 0}),
                  testing::small_options());
    FAIL() << "parameters on the CPU and on cuda:0 were accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.context().tensor, "w2");
  }
}

TEST(StateLocation, CudaTensorsWithoutTheDeviceMemoryAreRefusedNamingWhatToLink) {
  if (device_state_available()) {
    GTEST_SKIP() << "this program links pulseloco_engine_cuda (the GPU tests cover it)";
  }
  // The pointers are never dereferenced: the tensors are refused first.
  std::vector<float> a(100), b(50);
  const Device cuda{DeviceKind::cuda, 0};
  try {
    Engine engine(tensors_on(a, b, cuda, cuda), testing::small_options());
    FAIL() << "CUDA tensors were accepted without pulseloco_engine_cuda";
  } catch (const InvalidArgument& e) {
    EXPECT_EQ(e.context().tensor, "w1");
    EXPECT_NE(std::string(e.what()).find("pulseloco_engine_cuda"), std::string::npos) << e.what();
  }
}

TEST(StateLocation, HostStateForCudaTensorsAsksForStaging) {
  std::vector<float> a(100), b(50);
  const Device cuda{DeviceKind::cuda, 0};
  EngineOptions options = testing::small_options();
  options.state_location = StateLocation::host;
  EXPECT_THROW(Engine(tensors_on(a, b, cuda, cuda), options), InvalidArgument);
}

TEST(StateLocation, NamesParseAndPrint) {
  for (StateLocation location :
       {StateLocation::automatic, StateLocation::device, StateLocation::host}) {
    EXPECT_EQ(parse_state_location(state_location_name(location)), location);
  }
  EXPECT_EQ(parse_state_location("auto"), StateLocation::automatic);
  EXPECT_THROW((void)parse_state_location("gpu"), InvalidArgument);
}

}  // namespace
}  // namespace pulseloco::state_memory_test
