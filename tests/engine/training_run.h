// Engine tests of checkpoints: kWorld engines over an in-process group, trained window by
// window with deterministic local steps.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <pulseloco/engine/checkpoint_commit.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/io/atomic_file.h>
#include <pulseloco/io/safetensors.h>
#include "engine/engine_test_util.h"

namespace pulseloco::testing {

inline constexpr int kWorld = 3;
inline const std::vector<std::uint64_t> kCheckpointSizes{2500, 1, 700};

inline EngineOptions options_for_test() {
  EngineOptions options;
  options.steps_per_window = 2;
  options.chunk_elements = 1024;
  options.threads = 2;
  options.timeout = std::chrono::milliseconds(20'000);
  return options;
}

// An empty directory for this test process (created).
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir = fresh_test_dir(name);
  std::filesystem::create_directories(dir);
  return dir;
}

// After a test rewrote `file` of a checkpoint: its manifest records the new size and xxh3-64, as
// if the file had been saved so (tests of what the files' own digests catch).
inline void record_in_manifest(const std::filesystem::path& file) {
  engine_detail::Manifest manifest = engine_detail::read_manifest(file.parent_path());
  const io::FileChecksum checksum = io::file_checksum(file);
  for (auto& record : manifest.files) {
    if (record.name != file.filename().string()) continue;
    record.size = checksum.size;
    record.xxh3 = checksum.digest;
  }
  engine_detail::write_manifest(file.parent_path(), manifest);
}

// Rewrites a safetensors file with the same tensors and its metadata changed by
// edit(metadata, data), `data` being the tensors' bytes in file order (tests of files written
// otherwise than this build writes them).
inline void rewrite_metadata(
    const std::filesystem::path& file,
    const std::function<void(io::Metadata&, const std::vector<std::vector<std::byte>>&)>& edit) {
  std::vector<io::TensorSpec> specs;
  std::vector<std::vector<std::byte>> data;
  io::Metadata metadata;
  {
    const io::SafetensorsReader reader(file);
    metadata = reader.metadata();
    for (const io::TensorInfo& info : reader.tensors()) {
      specs.push_back(info.spec);
      data.emplace_back(info.data_end - info.data_begin);
      reader.read_range(info.spec.name, 0, data.back());
    }
  }
  edit(metadata, data);
  io::SafetensorsWriter writer(file, metadata, specs);
  for (std::size_t t = 0; t < specs.size(); ++t)
    writer.write(specs[t].name, std::span<const std::byte>(data[t]));
  writer.finish();
}

struct TrainingRun {
  std::vector<LocalModel> models;
  std::vector<std::unique_ptr<Engine>> engines;
  float inner_lr = 3e-5f;

  TrainingRun(const EngineOptions& options, std::uint32_t seed, DType dtype = DType::float32)
      : inner_lr(dtype == DType::float32 ? 3e-5f : 3e-3f) {  // bf16 needs visible steps
    for (int r = 0; r < kWorld; ++r) {
      models.push_back(make_model(kCheckpointSizes, dtype, seed + static_cast<std::uint32_t>(r)));
    }
    auto transports = transport::inproc::make_group(kWorld);
    engines.resize(kWorld);
    rethrow_first(run_ranks(kWorld, [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      engines[i] = std::make_unique<Engine>(views_of(models[i]), options, std::move(transports[i]));
    }));
  }

  // Local training (deterministic per window and rank) followed by a window, on every rank.
  void window(int index) {
    for (int r = 0; r < kWorld; ++r) {
      local_training(models[static_cast<std::size_t>(r)], inner_lr, 2,
                     static_cast<std::uint32_t>(1000 * index + r));
    }
    rethrow_first(run_ranks(
        kWorld, [&](int r) { (void)engines[static_cast<std::size_t>(r)]->run_window(); }));
  }

  // Saves a checkpoint under `root` on every rank (`save_of(rank)`: that rank's arguments) and
  // returns the directory, the same on every rank.
  std::filesystem::path save(const std::filesystem::path& root,
                             const std::function<CheckpointSave(int)>& save_of = {}) {
    std::vector<std::filesystem::path> dirs(kWorld);
    rethrow_first(run_ranks(kWorld, [&](int r) {
      const auto i = static_cast<std::size_t>(r);
      dirs[i] = engines[i]->save_checkpoint(root, save_of ? save_of(r) : CheckpointSave{});
    }));
    for (const auto& dir : dirs)
      EXPECT_EQ(dir, dirs[0]);
    return dirs[0];
  }

  // Every rank's state digest.
  [[nodiscard]] std::vector<Digest> digests() const {
    std::vector<Digest> all;
    for (const auto& engine : engines)
      all.push_back(engine->state_digest());
    return all;
  }

  void on_all(const std::function<void(Engine&)>& fn) {
    rethrow_first(run_ranks(kWorld, [&](int r) { fn(*engines[static_cast<std::size_t>(r)]); }));
  }
};

}  // namespace pulseloco::testing
