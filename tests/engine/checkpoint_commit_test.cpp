// Checkpoints commit as a whole: a write that fails on one rank (a full disk, injected or real)
// is the same io error on every rank and leaves the last committed checkpoint loadable; resume
// takes the newest committed checkpoint and verifies every file against the manifest; the
// newest K are kept and leftovers of failed saves are ignored, then removed.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/io/safetensors.h>
#include <pulseloco/transport/inproc/inproc.h>
#include "engine/training_run.h"

namespace pulseloco {
namespace {

namespace fs = std::filesystem;
using testing::kWorld;
using testing::ScopedVariable;
using testing::TrainingRun;

// The entries of a checkpoint root, by name.
std::set<std::string> entries(const fs::path& root) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(root))
    names.insert(entry.path().filename().string());
  return names;
}

// Every file under `root`, recursively (temporary files included).
std::vector<std::string> all_files(const fs::path& root) {
  std::vector<std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(root))
    files.push_back(fs::relative(entry.path(), root).string());
  return files;
}

// This rank's own file (an inner optimizer's state, say), different on every rank and window.
CheckpointFile optimizer_file(int rank, std::uint64_t window) {
  CheckpointFile file{"optimizer.pt", {}};
  for (int i = 0; i < 3000; ++i)
    file.bytes.push_back(static_cast<std::byte>((i * 7 + rank * 31 + window) & 0xFF));
  return file;
}

std::function<CheckpointSave(int)> with_optimizer(const TrainingRun& run) {
  return [&run](int r) {
    return CheckpointSave{.files = {optimizer_file(
                              r, run.engines[static_cast<std::size_t>(r)]->committed_windows())}};
  };
}

// Every rank failed with an error of `kind` whose text holds each of `parts`.
void expect_error_everywhere(const std::vector<std::exception_ptr>& errors, ErrorKind kind,
                             const std::vector<std::string>& parts) {
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(errors[static_cast<std::size_t>(r)]) << "rank " << r << " succeeded";
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), kind) << "rank " << r << ": " << e.what();
      for (const std::string& part : parts)
        EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
            << "rank " << r << ": " << e.what();
    }
  }
}

// Loads `path` on every rank and returns each rank's result.
std::vector<LoadedCheckpoint> load_all(TrainingRun& run, const fs::path& path) {
  std::vector<LoadedCheckpoint> loaded(kWorld);
  testing::rethrow_first(testing::run_ranks(kWorld, [&](int r) {
    loaded[static_cast<std::size_t>(r)] =
        run.engines[static_cast<std::size_t>(r)]->load_checkpoint(path);
  }));
  return loaded;
}

std::vector<std::exception_ptr> try_load(TrainingRun& run, const fs::path& path) {
  return testing::run_ranks(kWorld, [&](int r) {
    (void)run.engines[static_cast<std::size_t>(r)]->load_checkpoint(path);
  });
}

std::vector<std::exception_ptr> try_save(TrainingRun& run, const fs::path& root) {
  const auto save_of = with_optimizer(run);
  return testing::run_ranks(kWorld, [&](int r) {
    (void)run.engines[static_cast<std::size_t>(r)]->save_checkpoint(root, save_of(r));
  });
}

// A full disk while rank 1 writes its files: every rank reports it, nothing of the new
// checkpoint stays, and the previous checkpoint loads with the state of its window.
TEST(CheckpointCommit, AFullDiskOnOneRankIsAnIoErrorOnEveryRankAndThePreviousCheckpointLoads) {
  const fs::path root = testing::fresh_dir("commit_enospc");
  std::optional<TrainingRun> run_holder;
  {
    const ScopedVariable fault("PULSELOCO_FAULT", "window=2,phase=checkpoint,action=enospc,rank=1");
    run_holder.emplace(testing::options_for_test(), 70);
  }
  TrainingRun& run = *run_holder;
  run.window(0);
  const fs::path first = run.save(root, with_optimizer(run));
  const std::vector<Digest> at_window_1 = run.digests();
  run.window(1);
  const std::vector<Digest> at_window_2 = run.digests();

  expect_error_everywhere(try_save(run, root), ErrorKind::io,
                          {"the checkpoint of window 2", "rank 1: ", "No space left on device",
                           "the committed checkpoints are unchanged"});
  EXPECT_EQ(run.digests(), at_window_2);
  for (const auto& engine : run.engines)
    EXPECT_EQ(engine->committed_windows(), 2u);
  EXPECT_EQ(entries(root), std::set<std::string>{"window-000001"});
  for (const std::string& file : all_files(root))
    EXPECT_EQ(file.find(".tmp."), std::string::npos) << file;

  const std::vector<LoadedCheckpoint> loaded = load_all(run, root);
  EXPECT_EQ(run.digests(), at_window_1);
  for (int r = 0; r < kWorld; ++r) {
    const auto& mine = loaded[static_cast<std::size_t>(r)];
    EXPECT_EQ(mine.dir, first);
    EXPECT_EQ(mine.window, 1u);
    ASSERT_EQ(mine.files.size(), 1u);
    EXPECT_EQ(mine.files[0].name, "optimizer.pt");
    EXPECT_EQ(mine.files[0].bytes, optimizer_file(r, 1).bytes);
  }
  // The fault fired once: the next save commits.
  run.window(1);
  EXPECT_EQ(run.save(root, with_optimizer(run)), root / "window-000002");
  fs::remove_all(root);
}

// Resume takes the newest committed checkpoint; a directory without a manifest (a save that
// was interrupted) is no checkpoint, and the next successful save removes it.
TEST(CheckpointCommit, ResumeTakesTheNewestCommittedCheckpointAndLeftoversAreIgnored) {
  const fs::path root = testing::fresh_dir("commit_newest");
  TrainingRun run(testing::options_for_test(), 80);
  run.window(0);
  (void)run.save(root);
  run.window(1);
  const fs::path newest = run.save(root);
  const std::vector<Digest> at_window_2 = run.digests();
  // An interrupted save of window 3: some files, no manifest.
  fs::create_directories(root / "window-000003");
  fs::copy_file(newest / "global.safetensors", root / "window-000003" / "global.safetensors");
  std::ofstream(root / "window-000003" / "rank-00000.safetensors.tmp.1.0") << "partial";
  fs::create_directories(root / "unrelated");  // not ours: never touched

  run.window(2);
  for (const LoadedCheckpoint& loaded : load_all(run, root)) {
    EXPECT_EQ(loaded.dir, newest);
    EXPECT_EQ(loaded.window, 2u);
  }
  EXPECT_EQ(run.digests(), at_window_2);

  // The next save of window 3 takes another name, commits and removes the leftover.
  run.window(2);
  EXPECT_EQ(run.save(root), root / "window-000003.1");
  EXPECT_EQ(entries(root),
            (std::set<std::string>{"unrelated", "window-000002", "window-000003.1"}));
  EXPECT_EQ(load_all(run, root)[0].dir, root / "window-000003.1");
  fs::remove_all(root);
}

// `dir` as builds before manifests saved a checkpoint (the flat layout): the safetensors files of
// the committed checkpoint `committed` directly in it, for the first `ranks` ranks, and
// global.safetensors without committed_by, which only saves that commit with a manifest record.
void write_flat_checkpoint(const fs::path& committed, const fs::path& dir, int ranks = kWorld) {
  fs::create_directories(dir);
  fs::copy_file(committed / "global.safetensors", dir / "global.safetensors");
  testing::rewrite_metadata(dir / "global.safetensors", [](io::Metadata& metadata, const auto&) {
    EXPECT_EQ(metadata.erase("committed_by"), 1u);
  });
  for (int r = 0; r < ranks; ++r) {
    const std::string name = fmt::format("rank-{:05}.safetensors", r);
    fs::copy_file(committed / name, dir / name);
  }
}

// A checkpoint of the flat layout (files directly in the directory, no manifest) still loads,
// its files verified by the digests they record; a damaged one is refused naming the file.
TEST(CheckpointCommit, AFlatCheckpointWithoutAManifestLoadsVerifiedByItsOwnDigests) {
  const fs::path root = testing::fresh_dir("commit_flat");
  TrainingRun run(testing::options_for_test(), 85);
  run.window(0);
  const fs::path committed = run.save(root);
  const std::vector<Digest> at_window_1 = run.digests();
  const fs::path flat = root / "flat";
  write_flat_checkpoint(committed, flat);
  run.window(1);
  for (const LoadedCheckpoint& loaded : load_all(run, flat)) {
    EXPECT_EQ(loaded.dir, flat);
    EXPECT_EQ(loaded.window, 1u);
    EXPECT_TRUE(loaded.files.empty());
  }
  EXPECT_EQ(run.digests(), at_window_1);

  // One flipped byte in the last tensor's data: the recorded digest catches it.
  const fs::path damaged = flat / "global.safetensors";
  std::vector<char> bytes(static_cast<std::size_t>(fs::file_size(damaged)));
  std::ifstream(damaged, std::ios::binary)
      .read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  bytes[bytes.size() - 3] ^= 0x10;
  std::ofstream(damaged, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  run.window(1);
  const std::vector<Digest> before = run.digests();
  expect_error_everywhere(try_load(run, flat), ErrorKind::protocol, {"global.safetensors"});
  EXPECT_EQ(run.digests(), before);
  fs::remove_all(root);
}

// A save interrupted after every rank wrote its files, before rank 0 wrote the manifest, leaves
// every file of a checkpoint but the manifest. It never loads: not by its directory's name (with
// or without a trailing separator), not copied under another name, not as its root's newest.
TEST(CheckpointCommit, ADirectoryWithoutItsManifestNeverLoadsEvenNamedExplicitly) {
  const fs::path root = testing::fresh_dir("commit_uncommitted");
  TrainingRun run(testing::options_for_test(), 120);
  run.window(0);
  const fs::path committed = run.save(root, with_optimizer(run));
  const std::vector<Digest> at_window_1 = run.digests();
  run.window(1);
  const fs::path interrupted = root / "window-000002";
  const fs::path copied = root / "copied";
  for (const fs::path& dir : {interrupted, copied}) {
    fs::create_directories(dir);
    for (const auto& entry : fs::directory_iterator(committed)) {
      if (entry.path().filename() != "manifest.json")
        fs::copy_file(entry.path(), dir / entry.path().filename());
    }
  }
  const std::vector<Digest> before = run.digests();
  for (const fs::path& named : {interrupted, interrupted / ""}) {
    expect_error_everywhere(try_load(run, named), ErrorKind::io,
                            {named.string() + "' holds no manifest.json: its save did not commit",
                             "so it is no checkpoint and never loads; load its root"});
  }
  expect_error_everywhere(
      try_load(run, copied), ErrorKind::io,
      {copied.string() + "' holds no manifest.json, and its global.safetensors was written by a "
                         "save that commits with one: that save did not commit"});
  EXPECT_EQ(run.digests(), before);
  for (const LoadedCheckpoint& loaded : load_all(run, root))
    EXPECT_EQ(loaded.dir, committed);
  EXPECT_EQ(run.digests(), at_window_1);
  fs::remove_all(root);
}

// Without a manifest, only what the flat layout alone has makes a checkpoint: a global file
// without committed_by and the file of every rank beside it. A directory with less is named with
// what it lacks; a root whose own files are of the flat layout (saved to before manifests)
// resumes from the newer committed checkpoints under it.
TEST(CheckpointCommit, OnlyACompleteFlatLayoutLoadsWithoutAManifest) {
  const fs::path root = testing::fresh_dir("commit_flat_only");
  TrainingRun run(testing::options_for_test(), 130);
  run.window(0);
  const fs::path committed = run.save(root / "first");
  run.window(1);
  const std::vector<Digest> before = run.digests();

  const fs::path partial = root / "partial";
  write_flat_checkpoint(committed, partial, 1);
  expect_error_everywhere(
      try_load(run, partial), ErrorKind::io,
      {partial.string() +
       "' is no checkpoint: it holds no manifest.json, and as a checkpoint of "
       "the flat layout (from before manifests) it lacks rank-00001.safetensors, "
       "the file of rank 1 of its 3 ranks"});
  const fs::path lonely = root / "lonely";
  fs::create_directories(lonely);
  fs::copy_file(committed / "global.safetensors", lonely / "global.safetensors");
  expect_error_everywhere(try_load(run, lonely), ErrorKind::io,
                          {lonely.string() + "' holds no manifest.json, and its global.safetensors "
                                             "was written by a save that commits with one"});
  EXPECT_EQ(run.digests(), before);

  // A root that was a flat checkpoint of window 1 and has since held a committed one of window 2.
  const fs::path upgraded = root / "upgraded";
  write_flat_checkpoint(committed, upgraded);
  const fs::path newer = run.save(upgraded);
  const std::vector<Digest> at_window_2 = run.digests();
  run.window(2);
  for (const LoadedCheckpoint& loaded : load_all(run, upgraded)) {
    EXPECT_EQ(loaded.dir, newer);
    EXPECT_EQ(loaded.window, 2u);
  }
  EXPECT_EQ(run.digests(), at_window_2);
  fs::remove_all(root);
}

// The newest checkpoint is the one committed last, not the one of the highest window: after a
// run resumed from an older checkpoint saves, that save is what the root resumes from.
TEST(CheckpointCommit, AfterResumingFromAnOlderCheckpointTheNextSaveIsTheNewest) {
  const fs::path root = testing::fresh_dir("commit_rollback");
  TrainingRun run(testing::options_for_test(), 95);
  const auto keep_3 = [](int) { return CheckpointSave{.keep = 3}; };
  for (int w = 0; w < 3; ++w) {
    run.window(w);
    (void)run.save(root, keep_3);
  }
  for (const LoadedCheckpoint& loaded : load_all(run, root / "window-000001"))
    EXPECT_EQ(loaded.window, 1u);
  run.window(5);  // another trajectory from window 1
  const fs::path after = run.save(root, keep_3);
  EXPECT_EQ(after, root / "window-000002.1");
  const std::vector<Digest> at_after = run.digests();
  // The oldest commit goes, although its window is the lowest of those kept.
  EXPECT_EQ(entries(root),
            (std::set<std::string>{"window-000002", "window-000002.1", "window-000003"}));
  run.window(6);
  for (const LoadedCheckpoint& loaded : load_all(run, root)) {
    EXPECT_EQ(loaded.dir, after);
    EXPECT_EQ(loaded.window, 2u);
  }
  EXPECT_EQ(run.digests(), at_after);

  // A damaged manifest of an older checkpoint: which one is the newest cannot be told, so
  // resuming from the root is an error naming it, while a named directory still loads; saves
  // go on and leave the damaged checkpoint in place.
  const fs::path damaged = root / "window-000003" / "manifest.json";
  std::string text = testing::file_bytes(damaged);
  text[text.find("\"sequence\": ") + 12] ^= 0x01;
  std::ofstream(damaged, std::ios::binary | std::ios::trunc) << text;
  expect_error_everywhere(
      try_load(run, root), ErrorKind::protocol,
      {"cannot tell which checkpoint", damaged.string() + ": the manifest is damaged"});
  (void)load_all(run, after);
  run.window(6);
  const fs::path next = run.save(root, [](int) { return CheckpointSave{.keep = 1}; });
  EXPECT_EQ(entries(root), (std::set<std::string>{"window-000003", next.filename().string()}));
  fs::remove_all(root);
}

// A root is one run's: a run that neither resumed from nor saved under a root that holds
// checkpoints must not save there, since removing the old ones (keep) would delete the other
// run's. Resuming from that root makes it this run's.
TEST(CheckpointCommit, ARootHoldingAnotherRunsCheckpointsIsRefusedAndKeepsThem) {
  const fs::path root = testing::fresh_dir("commit_other_run");
  const fs::path other_root = testing::fresh_dir("commit_other_run_own");
  TrainingRun first(testing::options_for_test(), 97);
  for (int w = 0; w < 2; ++w) {
    first.window(w);
    (void)first.save(root);
  }
  const std::set<std::string> before{"window-000001", "window-000002"};
  ASSERT_EQ(entries(root), before);

  TrainingRun second(testing::options_for_test(), 98);
  second.window(0);
  expect_error_everywhere(try_save(second, root), ErrorKind::invalid_argument,
                          {root.string() + " holds checkpoints (newest: window-000002)",
                           "neither resumed from nor saved", "was not saved"});
  EXPECT_EQ(entries(root), before);
  // Its own root: a new one (named with a trailing separator before it exists), then again once
  // it holds this run's checkpoint.
  const fs::path own = other_root / "runs";
  (void)second.save(own / "");
  second.window(1);
  (void)second.save(own);
  EXPECT_EQ(entries(own), (std::set<std::string>{"window-000001", "window-000002"}));

  // Resumed from the root, the run saves there, and the oldest checkpoint goes (keep 2).
  (void)load_all(second, root);
  second.window(2);
  const fs::path saved = second.save(root);
  EXPECT_EQ(entries(root), (std::set<std::string>{"window-000002", saved.filename().string()}));
  fs::remove_all(root);
  fs::remove_all(other_root);
}

// A checkpoint holds every rank's residual: a group of another size cannot resume from it, and
// the error names both sizes before anything changes.
TEST(CheckpointCommit, ACheckpointOfAnotherWorldSizeIsRefusedNamingBoth) {
  const fs::path root = testing::fresh_dir("commit_world_size");
  TrainingRun run(testing::options_for_test(), 99);
  run.window(0);
  const fs::path saved = run.save(root);

  testing::LocalModel model = testing::make_model(testing::kCheckpointSizes, DType::float32, 99);
  auto transports = transport::inproc::make_group(1);
  Engine single(testing::views_of(model), testing::options_for_test(), std::move(transports[0]));
  const Digest before = single.state_digest();
  try {
    (void)single.load_checkpoint(root);
    ADD_FAILURE() << "a checkpoint of " << kWorld << " ranks loaded into a group of 1";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(fmt::format("{} was written by {} ranks; this group has 1",
                                                     saved.string(), kWorld)),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(single.state_digest(), before);
  EXPECT_EQ(single.committed_windows(), 0u);
  fs::remove_all(root);
}

TEST(CheckpointCommit, ARequiredOwnFileMissingOnOneRankIsRefusedOnEveryRankAndNothingChanges) {
  const fs::path root = testing::fresh_dir("commit_required_file");
  TrainingRun run(testing::options_for_test(), 98);
  run.window(0);
  // Rank 1 saves its optimizer's state, rank 0 does not.
  const fs::path saved = run.save(root, [&](int r) {
    return r == 1 ? CheckpointSave{.files = {optimizer_file(r, 1)}} : CheckpointSave{};
  });
  run.window(1);
  const std::vector<Digest> at_window_2 = run.digests();
  const std::string optimizer = "optimizer.pt";
  const auto errors = testing::run_ranks(kWorld, [&](int r) {
    (void)run.engines[static_cast<std::size_t>(r)]->load_checkpoint(root, std::span(&optimizer, 1));
  });
  expect_error_everywhere(errors, ErrorKind::invalid_argument,
                          {fmt::format("{} holds no file 'optimizer.pt' of rank 0", saved.string()),
                           "nothing changed"});
  EXPECT_EQ(run.digests(), at_window_2);
  for (const auto& engine : run.engines)
    EXPECT_EQ(engine->committed_windows(), 2u);
  // Without the requirement it loads, rank 1 with its file.
  const std::vector<LoadedCheckpoint> loaded = load_all(run, root);
  EXPECT_TRUE(loaded[0].files.empty());
  ASSERT_EQ(loaded[1].files.size(), 1u);
  EXPECT_EQ(loaded[1].files[0].bytes, optimizer_file(1, 1).bytes);
  fs::remove_all(root);
}

TEST(CheckpointCommit, TheNewestKCommittedCheckpointsAreKept) {
  const fs::path root = testing::fresh_dir("commit_keep");
  TrainingRun run(testing::options_for_test(), 90);
  const auto keep = [](std::uint32_t k) { return [k](int) { return CheckpointSave{.keep = k}; }; };
  for (int w = 0; w < 3; ++w) {
    run.window(w);
    (void)run.save(root);  // the default keeps 2
  }
  EXPECT_EQ(entries(root), (std::set<std::string>{"window-000002", "window-000003"}));
  run.window(3);
  (void)run.save(root, keep(3));
  EXPECT_EQ(entries(root),
            (std::set<std::string>{"window-000002", "window-000003", "window-000004"}));
  run.window(4);
  (void)run.save(root, keep(1));
  EXPECT_EQ(entries(root), std::set<std::string>{"window-000005"});
  for (const LoadedCheckpoint& loaded : load_all(run, root))
    EXPECT_EQ(loaded.window, 5u);

  expect_error_everywhere(
      testing::run_ranks(kWorld,
                         [&](int r) {
                           (void)run.engines[static_cast<std::size_t>(r)]->save_checkpoint(
                               root, {.keep = 0});
                         }),
      ErrorKind::invalid_argument, {"keep must be at least 1"});
  EXPECT_EQ(entries(root), std::set<std::string>{"window-000005"});
  fs::remove_all(root);
}

// One flipped bit in any file of the checkpoint, the engine's or a rank's own, is an error on
// every rank that names the file, and nothing changes.
TEST(CheckpointCommit, AFlippedBitInAnyFileIsAnErrorNamingItOnEveryRank) {
  const fs::path root = testing::fresh_dir("commit_flipped");
  TrainingRun run(testing::options_for_test(), 100);
  run.window(0);
  const fs::path dir = run.save(root, with_optimizer(run));
  run.window(1);
  const std::vector<Digest> before = run.digests();
  for (const std::string name : {"global.safetensors", "rank-00002.safetensors",
                                 "rank-00001.optimizer.pt", "manifest.json"}) {
    const fs::path file = dir / name;
    const std::string original = testing::file_bytes(file);
    std::string flipped = original;
    flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x04);
    std::ofstream(file, std::ios::binary | std::ios::trunc) << flipped;
    // The manifest itself: a flipped bit in its JSON text is caught by its parser or by its own
    // checksum.
    const std::string says = name == "manifest.json" ? ": " : ": the file is damaged";
    expect_error_everywhere(try_load(run, root), ErrorKind::protocol, {file.string() + says});
    EXPECT_EQ(run.digests(), before) << name;
    std::ofstream(file, std::ios::binary | std::ios::trunc) << original;
  }
  (void)load_all(run, root);
  fs::remove_all(root);
}

TEST(CheckpointCommit, ARootWithoutACommittedCheckpointIsAClearError) {
  const fs::path root = testing::fresh_dir("commit_empty");
  fs::create_directories(root / "window-000004");  // uncommitted: no manifest
  TrainingRun run(testing::options_for_test(), 110);
  const std::vector<Digest> before = run.digests();
  expect_error_everywhere(try_load(run, root), ErrorKind::io,
                          {root.string() + "' holds no committed checkpoint"});
  expect_error_everywhere(try_load(run, root / "missing"), ErrorKind::io,
                          {"does not exist or is not a directory"});
  expect_error_everywhere(try_load(run, root / "window-000004"), ErrorKind::io,
                          {"window-000004' holds no manifest.json: its save did not commit"});
  EXPECT_EQ(run.digests(), before);
  fs::remove_all(root);
}

// A launcher's check before a run: a root that does not exist holds nothing; one that is a file
// is an error naming it (a save there could only fail later).
TEST(CheckpointCommit, TheNewestCheckpointOfARootThatIsAFileIsAnIoError) {
  const fs::path root = testing::fresh_dir("commit_root_file");
  EXPECT_EQ(newest_checkpoint(root / "missing"), std::nullopt);
  EXPECT_EQ(newest_checkpoint(root), std::nullopt);
  const fs::path file = root / "a-file";
  std::ofstream(file) << "not a directory";
  try {
    (void)newest_checkpoint(file);
    ADD_FAILURE() << "a file was taken for an empty checkpoint root";
  } catch (const IoError& error) {
    EXPECT_NE(std::string(error.what()).find(file.string() + "' is not a directory"),
              std::string::npos)
        << error.what();
  }
  fs::remove_all(root);
}

// A small tmpfs mounted for the test (root only), unmounted when it goes out of scope.
class SmallTmpfs {
 public:
  SmallTmpfs(const fs::path& dir, std::uint64_t bytes) : dir_(dir) {
    fs::create_directories(dir_);
    const std::string options = fmt::format("size={}", bytes);
    mounted_ = ::geteuid() == 0 && ::mount("tmpfs", dir_.c_str(), "tmpfs", 0, options.c_str()) == 0;
  }
  ~SmallTmpfs() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
    std::error_code error;
    fs::remove_all(dir_, error);
  }
  SmallTmpfs(const SmallTmpfs&) = delete;
  SmallTmpfs& operator=(const SmallTmpfs&) = delete;
  [[nodiscard]] bool mounted() const noexcept { return mounted_; }

  // Bytes still free.
  [[nodiscard]] std::uint64_t available() const {
    struct statvfs stats {};
    if (::statvfs(dir_.c_str(), &stats) != 0) return 0;
    return static_cast<std::uint64_t>(stats.f_bavail) * stats.f_frsize;
  }

 private:
  fs::path dir_;
  bool mounted_ = false;
};

// The same on a real full disk: a tmpfs that a filler leaves too little room for the next
// checkpoint. Which rank runs out first is not fixed; every rank reports the failure.
TEST(CheckpointCommit, ARealFullDiskLeavesTheLastCommittedCheckpointLoadable) {
  const fs::path mount_dir = testing::fresh_test_dir("commit_tmpfs");
  const SmallTmpfs tmpfs(mount_dir, std::uint64_t{1} << 20);
  if (!tmpfs.mounted()) GTEST_SKIP() << "needs root and mount -t tmpfs";
  const fs::path root = mount_dir / "checkpoints";
  TrainingRun run(testing::options_for_test(), 120);
  run.window(0);
  (void)run.save(root, with_optimizer(run));
  const std::vector<Digest> at_window_1 = run.digests();
  run.window(1);
  const std::vector<Digest> at_window_2 = run.digests();
  {
    // Leave 16 KiB: less than the new checkpoint's global file alone.
    const std::uint64_t filler = tmpfs.available() - 16 * 1024;
    std::ofstream(mount_dir / "filler", std::ios::binary) << std::string(filler, 'x');
  }
  expect_error_everywhere(
      try_save(run, root), ErrorKind::io,
      {"the checkpoint of window 2", (root / "window-000002").string(), "No space left on device"});
  EXPECT_EQ(run.digests(), at_window_2);
  EXPECT_EQ(entries(root), std::set<std::string>{"window-000001"});

  (void)load_all(run, root);
  EXPECT_EQ(run.digests(), at_window_1);
  fs::remove(mount_dir / "filler");
  run.window(1);
  EXPECT_EQ(run.save(root, with_optimizer(run)), root / "window-000002");
}

}  // namespace
}  // namespace pulseloco
