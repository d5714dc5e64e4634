// pulseloco_train: the training demo. Post-trains the example transformer (pretrained first,
// cached) with AdamW at an RL-like learning rate on several workers, synchronised by pulseloco
// in mode pulse (default), diloco or ddp, and prints a live per-window table.
//
//   mpirun -np 4 build/bin/pulseloco_train --mode pulse             # ranks from mpirun
//   build/bin/pulseloco_train --local-workers 4 --mode pulse        # spawns 4 TCP workers here
//   RANK=1 WORLD_SIZE=4 MASTER_ADDR=host MASTER_PORT=29500 build/bin/pulseloco_train ...
//
// --local-dtype bf16 stores the model's weights in bf16 (example::Bf16Weights), as users of
// torch bf16 models hold them; --bf16-delta chooses the pseudo-gradient of such weights
// (EngineOptions::bf16_delta, docs/algorithm.md).
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/types.h>
#include <torch/utils.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include <pulseloco/adapters/torch/synchronizer.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/cli/flag_checks.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/bucket_transport.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/engine/report.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/io/atomic_file.h>
#include "model.h"
#include "pretrain.h"
#include "task.h"

namespace {

namespace fs = std::filesystem;
using namespace pulseloco;

struct Settings {
  std::string exchange_bucket;  // s3://bucket/prefix: the group exchanges through it, no ports
  std::string mode = "pulse";
  std::string local_dtype = "fp32";
  std::string bf16_delta = "exact";
  std::string overlap = "blocking";
  std::string exchange = "auto";
  std::string encoding = "pulse";
  bool node_aware = true;
  std::string transport = "auto";
  int windows = 10;
  std::uint32_t steps_per_window = 8;
  double lr = 3e-6;
  float outer_lr = 0.7f;
  float outer_momentum = 0.9f;
  int batch_size = 4;
  int eval_batch_size = 64;
  std::uint64_t seed = 1234;
  int threads = 1;
  int timeout_ms = 120'000;
  std::uint64_t pipeline_chunk_bytes = EngineOptions{}.pipeline_chunk_bytes;
  int local_workers = 0;
  std::string json_path;
  std::string json_lines_path;
  std::string checkpoint_dir;
  int checkpoint_every = 0;
  std::uint32_t checkpoint_keep = CheckpointSave{}.keep;
  std::string resume_dir;
  std::string trace_dir;
  std::string publish_dir;
  std::uint64_t publish_every = EngineOptions{}.publish_every;
  bool publish_continue = false;
  std::uint64_t anchor_every = EngineOptions{}.anchor_every;
  std::string state_location = "automatic";
  std::string final_weights_dir;
  bool pretrain_only = false;
  example::PretrainOptions pretrain;
};

fs::path default_cache_dir() {
  std::error_code error;
  const auto exe = fs::read_symlink("/proc/self/exe", error);
  if (error) return fs::path("cache");
  return exe.parent_path().parent_path() / "cache";  // build/bin/.. -> build/cache
}

// --- --local-workers: one process per rank over TCP on this machine --------------------------

std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw IoError("socket() failed while choosing a port");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof address;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    ::close(fd);
    throw IoError("could not find a free TCP port on 127.0.0.1");
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

int run_local_workers(int workers, int argc, char** argv) {
  const std::uint16_t port = free_port();
  const std::string run_id = "local-" + std::to_string(::getpid()) + "-" + std::to_string(port);
  std::vector<std::string> arguments;
  for (int i = 0; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument == "--local-workers") {
      ++i;  // skip its value
      continue;
    }
    if (argument.rfind("--local-workers=", 0) == 0) continue;
    arguments.push_back(argument);
  }
  std::vector<pid_t> children;
  for (int rank = 0; rank < workers; ++rank) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      // The workers started so far would wait in the rendezvous for ranks that never come.
      const int error = errno;
      for (const pid_t child : children) {
        ::kill(child, SIGTERM);
        ::waitpid(child, nullptr, 0);
      }
      throw IoError(
          fmt::format("fork() of worker {} of {} failed: {}", rank, workers, std::strerror(error)));
    }
    if (pid == 0) {
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(workers).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("PULSELOCO_RENDEZVOUS", "env", 1);
      // A single-host run: nothing listens beyond loopback (no secret needed), and this run's
      // processes never accept another local run's.
      ::setenv("PULSELOCO_LISTEN_ADDR", "127.0.0.1", 1);
      ::setenv("PULSELOCO_RUN_ID", run_id.c_str(), 0);
      std::vector<char*> child_argv;
      for (auto& a : arguments)
        child_argv.push_back(a.data());
      child_argv.push_back(nullptr);
      ::execv("/proc/self/exe", child_argv.data());
      std::perror("execv");
      std::_Exit(127);
    }
    children.push_back(pid);
  }
  int failures = 0;
  for (pid_t child : children) {
    int status = 0;
    if (::waitpid(child, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      ++failures;
    }
  }
  if (failures > 0) std::fprintf(stderr, "pulseloco_train: %d worker(s) failed\n", failures);
  return failures == 0 ? 0 : 1;
}

// --- one worker ------------------------------------------------------------------------------

std::unique_ptr<transport::Transport> connect(const Settings& settings) {
  group::TransportOptions options = group::from_environment();
  if (!settings.exchange_bucket.empty()) {
    // No rendezvous and no sockets: rank and world size from the launcher, the job id and
    // secret from the group's variables, objects in the bucket for everything else.
    if (settings.transport != "auto") {
      throw InvalidArgument(fmt::format("--exchange-bucket and --transport {} exclude each other",
                                        settings.transport));
    }
    BucketGroupOptions bucket;
    bucket.address = settings.exchange_bucket;
    bucket.job_id = options.run_id;
    bucket.secret = options.tcp.secret;
    bucket.rank = options.rank;
    bucket.world_size = options.world_size;
    bucket.form_timeout = options.connect_timeout;
    return join_bucket_group(std::move(bucket));
  }
  if (settings.transport != "auto") {
    const auto backend = transport::parse_backend(settings.transport);
    if (!backend) throw InvalidArgument("--transport must be auto, tcp or mpi");
    options.backend = *backend;
  } else if (std::getenv("PULSELOCO_TRANSPORT") == nullptr) {
    options.backend = transport::Backend::tcp;  // commodity-internet default, also under mpirun
  }
  return group::make_transport(options);
}

struct WindowRow {
  WindowReport report;
  double train_loss = 0;      // this rank's mean loss over the window's H steps
  double eval_loss = 0;       // held-out loss of the synchronised model (rank 0)
  double eval_loss_bf16 = 0;  // ... with its weights rounded to bf16 (rank 0)
};

void print_header(const Settings& settings, int world, const Engine& engine) {
  const bool publishing = !settings.publish_dir.empty();
  fmt::print(
      "pulseloco_train: mode {}, {} workers, {} parameters, H = {}, inner lr {:g}, "
      "outer lr {:g}, outer momentum {:g}, state on {}{}{}\n",
      settings.mode, world, engine.parameter_count(), settings.steps_per_window, settings.lr,
      settings.outer_lr, settings.outer_momentum, engine.state_location(),
      settings.mode == "pulse" ? fmt::format(", encoding {}", settings.encoding) : std::string(),
      settings.local_dtype == "bf16"
          ? fmt::format(", bf16 local weights (bf16 delta {})", settings.bf16_delta)
          : std::string());
  if (publishing) {
    fmt::print("publishing θ_g to {} every {} window(s), an anchor every {} versions\n",
               settings.publish_dir, settings.publish_every, settings.anchor_every);
  }
  fmt::print("{:>6} {:>10} {:>10} {:>9} {:>12} {:>12} {:>9} {:>12} {:>9} {:>9} {:>9}{}\n", "window",
             "train", "eval", "density", "payload", "vs DiLoCo", "vs DDP", "received", "sync s",
             "digest", "replicas",
             publishing ? fmt::format(" {:>8} {:>9} {:>10} {:>10} {:>6}", "version", "patch %",
                                      "patch", "delta", "anchor")
                        : std::string());
}

// The publishing columns of a row: the version, its density, compact and TRL delta sizes.
std::string publish_columns(const WindowReport& r) {
  if (!r.publish_error.empty()) return "  NOT PUBLISHED: " + r.publish_error;
  if (!r.published_version) return fmt::format(" {:>8}", "-");
  const char* anchor = r.patch_anchor_bytes > 0 ? "yes" : "no";
  // The first version is an anchor alone: no patch.
  if (r.patch_delta_bytes == 0)
    return fmt::format(" {:>8} {:>9} {:>10} {:>10} {:>6}", *r.published_version, "-", "-", "-",
                       anchor);
  return fmt::format(" {:>8} {:>8.3f}% {:>10} {:>10} {:>6}", *r.published_version,
                     100.0 * r.patch_density,
                     human_bytes(static_cast<double>(r.patch_compact_bytes)),
                     human_bytes(static_cast<double>(r.patch_delta_bytes)), anchor);
}

void print_row(const WindowRow& row, bool publishing) {
  const auto& r = row.report;
  const double payload = static_cast<double>(r.payload_bytes);
  fmt::print(
      "{:>6} {:>10.5f} {:>10.5f} {:>8.3f}% {:>12} {:>11.1f}x {:>8.1f}x {:>12} {:>9.3f} "
      "{:>9} {:>9}{}\n",
      r.window, row.train_loss, row.eval_loss, 100.0 * r.density, human_bytes(payload),
      payload > 0 ? static_cast<double>(r.diloco_bytes) / payload : 0.0,
      payload > 0 ? static_cast<double>(r.ddp_bytes) / payload : 0.0,
      human_bytes(static_cast<double>(r.received_bytes)), r.seconds.total,
      digest_hex(r.digest).substr(0, 8), r.replicas_identical ? "identical" : "DIFFER",
      publishing ? publish_columns(r) : std::string());
  std::fflush(stdout);
}

// Held-out loss of the synchronised weights θ_g, each tensor rounded to its local dtype as the
// engine's reset rounds it (so blocking runs evaluate exactly their local weights): with
// overlap = eager the local weights differ from θ_g between boundaries. Restores the model.
// Mode ddp keeps no θ_g: its replicas' weights are the local ones.
std::pair<double, double> evaluate_global(example::TransformerLM& model,
                                          const std::vector<torch::Tensor>& local_tensors,
                                          const Engine& engine, const example::Batch& batch) {
  if (engine.options().mode == Mode::ddp) {
    return {model.evaluate(batch), model.evaluate_bf16_weights(batch)};
  }
  torch::NoGradGuard no_grad;
  auto parameters = model.parameters();
  std::vector<torch::Tensor> saved;
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    saved.push_back(parameters[i].clone());
    std::vector<float> global = engine.copy_state(Engine::StateTensor::global_weights, i);
    const torch::Tensor view =
        torch::from_blob(global.data(), {static_cast<std::int64_t>(global.size())});
    parameters[i].copy_(
        view.to(local_tensors[i].scalar_type()).to(torch::kFloat32).view_as(parameters[i]));
  }
  const std::pair<double, double> losses{model.evaluate(batch), model.evaluate_bf16_weights(batch)};
  for (std::size_t i = 0; i < parameters.size(); ++i)
    parameters[i].copy_(saved[i]);
  return losses;
}

nlohmann::json window_json(const WindowRow& row) {
  const auto& r = row.report;
  nlohmann::json digests = nlohmann::json::array();
  for (Digest d : r.rank_digests)
    digests.push_back(digest_hex(d));
  nlohmann::json out{{"window", r.window},
                     {"loss", row.eval_loss},
                     {"loss_bf16_weights", row.eval_loss_bf16},
                     {"train_loss", row.train_loss},
                     {"density", r.density},
                     {"entries", r.entries_sent},
                     {"payload_bytes", r.payload_bytes},
                     {"received_bytes", r.received_bytes},
                     {"wire_bytes_sent", r.wire_bytes_sent},
                     {"wire_bytes_received", r.wire_bytes_received},
                     {"diloco_bytes", r.diloco_bytes},
                     {"ddp_bytes", r.ddp_bytes},
                     {"sync_seconds", r.seconds.total},
                     {"digests", digests}};
  // The publishing fields as the engine's report has them (null version: not published).
  const nlohmann::json report = to_json(r);
  for (const char* key :
       {"applied_window", "overlap", "exchange", "union_entries", "group_entries", "union_ratio",
        "published_version", "patch_changed", "patch_density", "patch_delta_bytes",
        "patch_compact_bytes", "patch_anchor_bytes", "patch_anchor", "publish_error", "seconds"})
    out[key] = report.at(key);
  return out;
}

// --json-lines: one JSON object per window, the engine's report (docs/operations.md, "The
// per-window report") with the example's losses, appended and flushed as each window completes,
// so a run that dies keeps every completed window.
class JsonLines {
 public:
  explicit JsonLines(const std::string& path) {
    if (path.empty()) return;
    file_.open(path, std::ios::app);
    if (!file_) throw IoError("could not open --json-lines file " + path + " for appending");
    path_ = path;
  }
  void write(const WindowRow& row) {
    if (path_.empty()) return;
    nlohmann::json line = to_json(row.report);
    line["loss"] = row.eval_loss;
    line["loss_bf16_weights"] = row.eval_loss_bf16;
    line["train_loss"] = row.train_loss;
    file_ << line.dump() << '\n' << std::flush;
    if (!file_) throw IoError("could not write --json-lines file " + path_);
  }

 private:
  std::string path_;
  std::ofstream file_;
};

// Creates the directory an output flag names (nothing when empty); IoError naming the flag.
void create_output_directory(const fs::path& directory, std::string_view flag) {
  std::error_code error;
  if (!directory.empty()) fs::create_directories(directory, error);
  if (error) {
    throw IoError(fmt::format("cannot create the {} directory {}: {}", flag, directory.string(),
                              error.message()));
  }
}

// The places a run writes to, checked before it pretrains or trains: a run must not fail after
// its work is done, nor save where another run's checkpoints would be removed.
void check_output_places(const Settings& settings) {
  if (settings.checkpoint_dir.empty() != (settings.checkpoint_every == 0)) {
    throw InvalidArgument(
        "--checkpoint-dir and --checkpoint-every (windows between checkpoints, at least 1) go "
        "together");
  }
  create_output_directory(settings.pretrain.cache_dir, "--cache-dir");
  if (!settings.final_weights_dir.empty()) {
    create_output_directory(settings.final_weights_dir, "--final-weights");
    const io::AtomicFile probe(fs::path(settings.final_weights_dir) / "global-rank-probe");
  }
  if (settings.checkpoint_dir.empty()) return;
  const auto newest = newest_checkpoint(settings.checkpoint_dir);
  if (!newest) return;
  std::error_code error;
  const fs::path root = fs::weakly_canonical(settings.checkpoint_dir, error);
  const fs::path resume =
      settings.resume_dir.empty() ? fs::path() : fs::weakly_canonical(settings.resume_dir, error);
  if (!resume.empty() && (resume == root || resume.parent_path() == root)) return;
  throw InvalidArgument(fmt::format(
      "--checkpoint-dir {} holds another run's checkpoints (newest: {}): continue that run with "
      "--resume {}, or choose another directory",
      settings.checkpoint_dir, newest->filename().string(), settings.checkpoint_dir));
}

EngineOptions engine_options(const Settings& settings) {
  EngineOptions options;
  options.mode = parse_mode(settings.mode);
  options.steps_per_window = settings.steps_per_window;
  options.outer_lr = settings.outer_lr;
  options.outer_momentum = settings.outer_momentum;
  options.threads = static_cast<std::uint32_t>(settings.threads);
  options.timeout = std::chrono::milliseconds(settings.timeout_ms);
  options.pipeline_chunk_bytes = settings.pipeline_chunk_bytes;
  options.trace_dir = settings.trace_dir;
  options.publish_dir = settings.publish_dir;
  options.publish_every = settings.publish_every;
  options.publish_continue = settings.publish_continue;
  options.anchor_every = settings.anchor_every;
  options.bf16_delta = kernels::parse_bf16_delta(settings.bf16_delta);
  options.overlap = parse_overlap(settings.overlap);
  options.exchange = parse_exchange(settings.exchange);
  options.codec.encoding = parse_encoding(settings.encoding);
  options.node_aware = settings.node_aware;
  options.state_location = parse_state_location(settings.state_location);
  return options;
}

// The engine's options, checked before anything starts. --outer-lr and --outer-momentum are
// floats: a value their checks accept as a double may round to 0, infinity or 1.
void check_engine_flags(const Settings& settings) {
  if (!std::isfinite(settings.outer_lr) || settings.outer_lr <= 0) {
    throw InvalidArgument(
        fmt::format("--outer-lr: {} as a float, not a finite positive number", settings.outer_lr));
  }
  if (settings.outer_momentum >= 1) {
    throw InvalidArgument(
        fmt::format("--outer-momentum: {} as a float, not below 1", settings.outer_momentum));
  }
  engine_options(settings).validate();
}

int run_worker(const Settings& settings) {
  auto transport = connect(settings);
  const int rank = transport->rank();
  const int world = transport->size();
  torch::set_num_threads(settings.threads);

  const example::ModelConfig config;
  example::TransformerLM model(config, settings.seed);
  // Only rank 0 needs the pretrained weights (the engine broadcasts them); the others wait.
  if (rank == 0) {
    example::PretrainOptions pretrain = settings.pretrain;
    pretrain.seed = settings.seed;
    const auto result = example::load_or_pretrain(model, pretrain);
    if (result.loaded_from_cache) {
      fmt::print("pretrained state loaded from {}\n", result.checkpoint.string());
    } else {
      fmt::print("pretrained {} steps in {:.1f} s (held-out loss {:.4f} -> {:.4f}), cached in {}\n",
                 result.steps, result.seconds, result.eval_loss_initial, result.eval_loss_final,
                 result.checkpoint.string());
    }
  }
  {
    collectives::CollectiveOptions wait;
    wait.timeout = std::chrono::hours(2);  // pretraining on rank 0 may take minutes
    wait.tag = 1;
    collectives::barrier(*transport, wait);
  }

  const EngineOptions options = engine_options(settings);

  // bf16 local weights: the synchronizer sees the bf16 tensors; the model computes on their
  // values (loaded before each forward pass, rounded back after each optimizer step).
  std::optional<example::Bf16Weights> bf16_weights;
  if (settings.local_dtype == "bf16") bf16_weights.emplace(model);
  const auto load_local_weights = [&] {
    if (bf16_weights) bf16_weights->load_into_model();
  };
  torch::OrderedDict<std::string, torch::Tensor> named;
  const auto names = model.parameter_names();
  const auto parameters = bf16_weights ? bf16_weights->tensors() : model.parameters();
  for (std::size_t i = 0; i < names.size(); ++i)
    named.insert(names[i], parameters[i]);
  libtorch::Synchronizer sync(named, options, std::move(transport));
  load_local_weights();  // start-up broadcast rank 0's weights into the synchronizer's tensors

  example::OptimizerSettings optimizer;
  optimizer.lr = settings.lr;
  example::Trainer trainer(model, optimizer);
  const example::TaskMix mix = example::post_training_mix();
  const example::Batch eval_batch =
      example::make_eval_batch(mix, settings.seed, settings.eval_batch_size, config.context);

  int first_window = 0;
  if (!settings.resume_dir.empty()) {
    const std::string optimizer_file = "optimizer.pt";
    const LoadedCheckpoint loaded =
        sync.load_checkpoint(settings.resume_dir, std::span(&optimizer_file, 1));
    libtorch::load_optimizer(trainer.optimizer(), loaded);
    // Where the data continues: one past the window in flight with overlapped windows.
    first_window = static_cast<int>(loaded.next_window);
    load_local_weights();
    if (rank == 0) fmt::print("resumed at window {} from {}\n", first_window, loaded.dir.string());
  }

  double initial_loss = 0;
  double initial_loss_bf16 = 0;
  if (rank == 0) {
    initial_loss = model.evaluate(eval_batch);
    initial_loss_bf16 = model.evaluate_bf16_weights(eval_batch);
    print_header(settings, world, sync.engine());
    fmt::print("{:>6} {:>10} {:>10.5f}   (held-out loss before post-training)\n", "start", "",
               initial_loss);
  }
  std::vector<WindowRow> rows;
  JsonLines json_lines(rank == 0 ? settings.json_lines_path : std::string());
  // The report is written at the end, atomically, its directory created as needed; a place it
  // cannot be written fails the run before it starts.
  if (rank == 0 && !settings.json_path.empty()) {
    create_output_directory(fs::path(settings.json_path).parent_path(), "--json");
    const io::AtomicFile probe(settings.json_path);  // removed again: never committed
  }
  bool identical = true;
  for (int window = first_window; window < settings.windows; ++window) {
    double loss_sum = 0;
    std::optional<WindowReport> report;
    for (std::uint32_t h = 0; h < settings.steps_per_window; ++h) {
      const std::uint64_t step = static_cast<std::uint64_t>(window) * settings.steps_per_window + h;
      const example::Batch batch =
          example::make_batch(mix, settings.seed, rank, step, settings.batch_size, config.context);
      load_local_weights();
      loss_sum += trainer.forward_backward(batch);
      sync.before_optimizer_step();
      trainer.optimizer_step();
      if (bf16_weights) bf16_weights->round_from_model();
      report = sync.after_optimizer_step();
    }
    load_local_weights();  // the window reset the local weights
    if (!report) throw InvalidArgument("internal: a window did not run after H steps");
    WindowRow row{*report, loss_sum / settings.steps_per_window, 0.0};
    if (rank == 0) {
      std::tie(row.eval_loss, row.eval_loss_bf16) =
          evaluate_global(model, parameters, sync.engine(), eval_batch);
    }
    identical = identical && report->replicas_identical;
    if (rank == 0) print_row(row, !settings.publish_dir.empty());
    json_lines.write(row);
    rows.push_back(row);
    if (!settings.checkpoint_dir.empty() && settings.checkpoint_every > 0 &&
        (window + 1) % settings.checkpoint_every == 0) {
      // The optimizer's state is one more file of the checkpoint, committed and verified with it.
      (void)sync.save_checkpoint(settings.checkpoint_dir,
                                 {.keep = settings.checkpoint_keep,
                                  .files = {libtorch::optimizer_file(trainer.optimizer())}});
    }
  }
  // Overlapped windows: the last window is still in flight; apply it so θ_g includes every window.
  std::optional<double> completed_loss;
  if (const auto completed = sync.engine().complete_in_flight(); completed && rank == 0) {
    completed_loss = evaluate_global(model, parameters, sync.engine(), eval_batch).first;
    fmt::print("{:>6} {:>10} {:>10.5f}   (window {} applied after the last boundary)\n", "final",
               "", *completed_loss, completed->applied_window.value_or(completed->window));
  }
  if (!settings.final_weights_dir.empty()) {
    sync.engine().save_global_weights(fs::path(settings.final_weights_dir) /
                                      fmt::format("global-rank-{:05}.safetensors", rank));
  }

  if (rank == 0) {
    std::uint64_t payload = 0, diloco = 0, ddp = 0;
    for (const auto& row : rows) {
      payload += row.report.payload_bytes;
      diloco += row.report.diloco_bytes;
      ddp += row.report.ddp_bytes;
    }
    const double final_loss = completed_loss ? *completed_loss
                              : rows.empty() ? model.evaluate(eval_batch)
                                             : rows.back().eval_loss;
    fmt::print(
        "summary: {} windows, final held-out loss {:.5f}, payload per worker {} in total "
        "(DiLoCo would send {} = {:.1f}x, DDP {} = {:.1f}x), replicas {}\n",
        rows.size(), final_loss, human_bytes(static_cast<double>(payload)),
        human_bytes(static_cast<double>(diloco)),
        payload > 0 ? static_cast<double>(diloco) / static_cast<double>(payload) : 0.0,
        human_bytes(static_cast<double>(ddp)),
        payload > 0 ? static_cast<double>(ddp) / static_cast<double>(payload) : 0.0,
        identical ? "bit-identical every window" : "DIFFERED");
    if (!settings.json_path.empty()) {
      nlohmann::json windows = nlohmann::json::array();
      for (const auto& row : rows)
        windows.push_back(window_json(row));
      const nlohmann::json out{{"mode", settings.mode},
                               {"local_dtype", settings.local_dtype},
                               {"bf16_delta", settings.bf16_delta},
                               {"overlap", settings.overlap},
                               {"exchange", settings.exchange},
                               {"encoding", settings.encoding},
                               {"world_size", world},
                               {"params", sync.engine().parameter_count()},
                               {"H", settings.steps_per_window},
                               {"lr", settings.lr},
                               {"seed", settings.seed},
                               {"windows", windows},
                               {"replicas_identical", identical},
                               {"initial_loss", initial_loss},
                               {"initial_loss_bf16_weights", initial_loss_bf16},
                               {"first_window", first_window},
                               {"publish_dir", settings.publish_dir},
                               {"windows_applied", sync.engine().committed_windows()},
                               {"final_loss", final_loss}};
      const std::string text = out.dump(2) + '\n';
      (void)io::write_file_atomically(settings.json_path, std::as_bytes(std::span(text)));
    }
  }
  return identical ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  Settings settings;
  settings.pretrain.cache_dir = default_cache_dir();
  CLI::App app{"pulseloco training demo: post-train a small transformer on several workers"};
  app.add_option("--mode", settings.mode, "pulse, diloco or ddp")
      ->check(CLI::IsMember({"pulse", "diloco", "ddp"}))
      ->capture_default_str();
  app.add_option("--local-dtype", settings.local_dtype,
                 "dtype the model's weights are stored in: fp32, or bf16 (forward and backward "
                 "in fp32 on the bf16 values, AdamW with fp32 moments, each update rounded to "
                 "bf16; modes pulse and diloco)")
      ->check(flags::one_of({"fp32", "bf16"}))
      ->capture_default_str();
  app.add_option("--bf16-delta", settings.bf16_delta,
                 "pseudo-gradient of bf16 weights: exact (float(bf16(θ_g)) − θ_l) or authors "
                 "(θ_g − θ_l, as the PULSE authors' code; keeps the cast residue)")
      ->check(flags::one_of({"exact", "authors"}))
      ->capture_default_str();
  app.add_option("--overlap", settings.overlap,
                 "when a window's exchange runs: blocking (at its boundary), delayed (during the "
                 "next window's inner steps, applied one window late) or eager (delayed, and "
                 "each worker restarts from its own pseudo-gradient applied; mode pulse)")
      ->check(flags::one_of({"blocking", "delayed", "eager"}))
      ->capture_default_str();
  app.add_option("--exchange", settings.exchange,
                 "how pulse windows combine the messages (the same bits either way): auto "
                 "(chosen per window from the last window's overlap), allgather, or reduction "
                 "(each rank sums one range of the model, then the ranges are all-gathered)")
      ->check(flags::one_of({"auto", "allgather", "reduction"}))
      ->capture_default_str();
  app.add_option("--encoding", settings.encoding,
                 "wire encoding of pulse messages: pulse, context (values and indices coded "
                 "against θ_g, which every receiver holds; smaller, slower), plain_i64_f32 (the "
                 "PULSE authors' 12 B per entry) or plain_i32_f32 (the same bits either way)")
      ->check(flags::one_of({"pulse", "context", "plain_i64_f32", "plain_i32_f32"}))
      ->capture_default_str();
  app.add_option("--node-aware", settings.node_aware,
                 "when ranks share nodes (PULSELOCO_NODE, else the host name): each message "
                 "crosses into each other node once, not once per rank there (the same bits "
                 "either way)")
      ->capture_default_str();
  app.add_option("--exchange-bucket", settings.exchange_bucket,
                 "s3://bucket/prefix: exchange every window through this bucket (no rank "
                 "listens on a port; needs RANK, WORLD_SIZE, PULSELOCO_RUN_ID and the secret)");
  app.add_option("--transport", settings.transport, "auto (tcp), tcp or mpi")
      ->check(CLI::IsMember({"auto", "tcp", "mpi"}))
      ->capture_default_str();
  app.add_option("--windows", settings.windows, "windows to run")
      ->check(flags::at_least(0))
      ->capture_default_str();
  app.add_option("-H,--steps-per-window", settings.steps_per_window, "inner steps per window")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--lr", settings.lr, "inner AdamW learning rate")
      ->check(flags::above(0))
      ->capture_default_str();
  app.add_option("--outer-lr", settings.outer_lr, "outer Nesterov learning rate")
      ->check(flags::above(0))
      ->capture_default_str();
  app.add_option("--outer-momentum", settings.outer_momentum, "outer Nesterov momentum")
      ->check(flags::at_least_and_below(0, 1))
      ->capture_default_str();
  app.add_option("--batch", settings.batch_size, "sequences per inner step and worker")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--eval-batch", settings.eval_batch_size, "sequences in the held-out batch")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--seed", settings.seed, "weights and data seed")->capture_default_str();
  app.add_option("--threads", settings.threads, "libtorch and engine threads per worker")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--timeout-ms", settings.timeout_ms, "deadline of every collective")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--pipeline-chunk-bytes", settings.pipeline_chunk_bytes,
                 "pipelining granularity of the collectives (smaller for slow links)")
      ->check(flags::between(std::uint64_t{4096}, std::uint64_t{1} << 30))
      ->capture_default_str();
  app.add_option("--local-workers", settings.local_workers,
                 "spawn this many workers on this machine over TCP (no mpirun needed)")
      ->check(flags::at_least(0));
  app.add_option("--json", settings.json_path, "rank 0 writes the run's report here");
  app.add_option("--json-lines", settings.json_lines_path,
                 "rank 0 appends one JSON object per window here as each window completes");
  app.add_option("--checkpoint-dir", settings.checkpoint_dir,
                 "checkpoint root: each checkpoint is a window-NNNNNN directory in it");
  app.add_option("--checkpoint-every", settings.checkpoint_every, "windows between checkpoints")
      ->check(flags::at_least(0));
  app.add_option("--checkpoint-keep", settings.checkpoint_keep,
                 "committed checkpoints kept in the checkpoint root")
      ->check(flags::at_least(std::uint32_t{1}))
      ->capture_default_str();
  app.add_option("--resume", settings.resume_dir,
                 "resume from this checkpoint root's newest committed checkpoint, or from one "
                 "checkpoint directory");
  app.add_option("--trace-dir", settings.trace_dir, "write window traces here");
  app.add_option("--publish-dir", settings.publish_dir,
                 "rank 0 publishes θ_g as bf16 versions here (docs/patches.md)");
  app.add_option("--publish-every", settings.publish_every, "windows between published versions")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_flag("--publish-continue", settings.publish_continue,
               "publish after the versions --publish-dir already holds from an earlier run");
  app.add_option("--anchor-every", settings.anchor_every, "published versions between anchors")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--state-location", settings.state_location,
                 "where θ_g, m and e live: automatic, device or host (docs/operations.md)")
      ->capture_default_str()
      ->check(flags::one_of({"automatic", "auto", "device", "host"}));
  app.add_option("--final-weights", settings.final_weights_dir,
                 "every rank writes its final θ_g here (global-rank-NNNNN.safetensors)");
  app.add_option("--cache-dir", settings.pretrain.cache_dir, "pretrained-state cache")
      ->capture_default_str();
  app.add_option("--pretrain-steps", settings.pretrain.steps, "pretraining steps")
      ->check(flags::at_least(0))
      ->capture_default_str();
  app.add_flag("--pretrain-only", settings.pretrain_only,
               "pretrain (or check the cache) in this process and exit");
  CLI11_PARSE(app, argc, argv);

  try {
    if (settings.local_dtype == "bf16" && settings.mode == "ddp") {
      // ddp averages the gradients of the synchronizer's tensors, which bf16 weights do not
      // carry here (the model computes on fp32 copies).
      throw InvalidArgument("--local-dtype bf16 needs --mode pulse or diloco");
    }
    check_engine_flags(settings);
    check_output_places(settings);
    if (settings.pretrain_only) {
      torch::set_num_threads(settings.threads);
      example::TransformerLM model(example::ModelConfig{}, settings.seed);
      example::PretrainOptions pretrain = settings.pretrain;
      pretrain.seed = settings.seed;
      const auto result = example::load_or_pretrain(model, pretrain);
      fmt::print(
          "pretrained state {} ({})\n", result.checkpoint.string(),
          result.loaded_from_cache ? "cached" : fmt::format("built in {:.1f} s", result.seconds));
      return 0;
    }
    if (settings.local_workers > 0) return run_local_workers(settings.local_workers, argc, argv);
    return run_worker(settings);
  } catch (const pulseloco::Error& e) {
    std::fprintf(stderr, "pulseloco_train: %s\n", e.what());
    return 1;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "pulseloco_train: libtorch: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pulseloco_train: error: %s\n", e.what());
    return 1;
  }
}
