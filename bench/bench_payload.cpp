// pulseloco_bench_payload: payload per worker per window of dense DDP, DiLoCo, PULSELoCo in the
// authors' exchange format (int64 index + fp32 value, 12 B per entry), int32 + fp32 (8 B per
// entry) and ours (the real encoder, src/codec), on two sources of messages:
//
//   --trace DIR --trace-lr LR   window traces of a pulseloco_train run (--trace-dir): every
//                               rank's message is re-derived from the traced inputs exactly as
//                               the engine derives it (same chunks, kernels and codec options)
//                               and checked against the size the engine recorded;
//   --qwen 0.5B,1.5B,3B,7B      the real tensor shapes of Qwen2.5 models, filled by the
//                               streaming synthetic generator (bench/payload_generator.h).
//
// Every encoded frame is decoded again and compared with the gate's entries. --json prints one
// JSON record per line (scripts/bench_payload collects them; docs/benchmarks.md, "Payload").
// Exits with status 1 when ours is not at least --min-ratio times smaller than the 12-byte
// format on some message.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/cli/flag_checks.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/engine/options.h>
#include <pulseloco/engine/replay.h>
#include <pulseloco/engine/state_files.h>
#include <pulseloco/io/safetensors.h>
#include <pulseloco/kernels/window_kernels.h>
#include "payload_generator.h"
#include "qwen_shapes.h"
#include "traced_window.h"

namespace {

using namespace pulseloco;
using namespace pulseloco::bench;
namespace fs = std::filesystem;

struct Settings {
  std::vector<std::string> qwen = {"0.5B", "1.5B", "3B", "7B"};
  std::vector<std::string> traces;
  std::vector<double> trace_lrs;
  GeneratorConfig generator;
  bool json = false;
  double min_ratio = 3.0;
  std::string label = "qwen-synthetic";  // the "source" of the generator's records
  std::string encoding;                  // empty: the traced runs' own, pulse for the generator
};

// One worker's message of one window, whatever its source.
struct Message {
  int rank = 0;
  std::uint64_t entries = 0;
  std::uint64_t ours_bytes = 0;
  std::uint64_t index_bytes = 0;
  std::uint64_t value_bytes = 0;
  std::optional<std::uint64_t> engine_bytes;  // what the engine recorded (traces)
};

struct Row {
  std::string source;  // "trace" or "qwen-synthetic"
  std::string model;
  std::uint64_t parameters = 0;
  double lr = 0;
  std::uint64_t H = 0;
  std::uint64_t window = 0;
  std::vector<Message> messages;  // every worker's (traces) or the simulated ones
  double seconds = 0;
  nlohmann::json extra = nlohmann::json::object();
};

double mean_of(const std::vector<Message>& messages, std::uint64_t Message::*field) {
  double sum = 0;
  for (const Message& m : messages)
    sum += static_cast<double>(m.*field);
  return sum / static_cast<double>(messages.size());
}

nlohmann::json row_json(const Row& row) {
  const double p = static_cast<double>(row.parameters);
  const double entries = mean_of(row.messages, &Message::entries);
  const double ours = mean_of(row.messages, &Message::ours_bytes);
  std::uint64_t max_entries = 0;
  for (const Message& m : row.messages)
    max_entries = std::max(max_entries, m.entries);
  const double authors = 12.0 * entries;
  nlohmann::json ranks = nlohmann::json::array();
  for (const Message& m : row.messages) {
    nlohmann::json r = {{"rank", m.rank},
                        {"entries", m.entries},
                        {"density", static_cast<double>(m.entries) / p},
                        {"ours_bytes", m.ours_bytes},
                        {"authors_12B_bytes", 12 * m.entries},
                        {"int32_fp32_bytes", 8 * m.entries},
                        {"ratio_authors_over_ours",
                         static_cast<double>(12 * m.entries) / static_cast<double>(m.ours_bytes)}};
    if (m.engine_bytes) r["engine_payload_bytes"] = *m.engine_bytes;
    ranks.push_back(r);
  }
  nlohmann::json j = {
      {"benchmark", "payload"},
      {"source", row.source},
      {"model", row.model},
      {"parameters", row.parameters},
      {"lr", row.lr},
      {"H", row.H},
      {"window", row.window},
      {"workers", row.messages.size()},
      {"entries", entries},
      {"density", entries / p},
      {"bytes",
       {{"ddp", static_cast<double>(row.H) * 4.0 * p},
        {"diloco", 4.0 * p},
        {"authors_12B", authors},
        {"authors_12B_padded", 12.0 * static_cast<double>(max_entries)},
        {"int32_fp32", 8.0 * entries},
        {"ours", ours}}},
      {"bytes_per_entry",
       {{"authors_12B", 12.0},
        {"int32_fp32", 8.0},
        {"ours", entries > 0 ? ours / entries : 0.0},
        {"ours_index", entries > 0 ? mean_of(row.messages, &Message::index_bytes) / entries : 0.0},
        {"ours_values",
         entries > 0 ? mean_of(row.messages, &Message::value_bytes) / entries : 0.0}}},
      {"ratio",
       {{"authors_over_ours", authors / ours},
        {"int32_over_ours", 8.0 * entries / ours},
        {"diloco_over_ours", 4.0 * p / ours},
        {"ddp_over_ours", static_cast<double>(row.H) * 4.0 * p / ours}}},
      {"ranks", ranks},
      {"seconds", row.seconds},
      {"decode_verified", true},
  };
  j.update(row.extra);
  return j;
}

std::string gb(double bytes) {
  if (bytes >= 1e9) return fmt::format("{:.2f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.2f} MB", bytes / 1e6);
  return fmt::format("{:.1f} kB", bytes / 1e3);
}

void print_row(const nlohmann::json& j, bool json) {
  if (json) {
    fmt::print("{}\n", j.dump());
  } else {
    const auto& b = j["bytes"];
    fmt::print(
        "{:<15} {:<13} {:>7.0e} {:>3} {:>3} {:>7.3f}% {:>10} {:>10} {:>10} {:>10} {:>10} "
        "{:>7.3f} {:>6.2f}x\n",
        j["source"].get<std::string>(), j["model"].get<std::string>(), j["lr"].get<double>(),
        j["H"].get<std::uint64_t>(), j["window"].get<std::uint64_t>(),
        100.0 * j["density"].get<double>(), gb(b["ddp"].get<double>()),
        gb(b["diloco"].get<double>()), gb(b["authors_12B"].get<double>()),
        gb(b["int32_fp32"].get<double>()), gb(b["ours"].get<double>()),
        j["bytes_per_entry"]["ours"].get<double>(), j["ratio"]["authors_over_ours"].get<double>());
  }
  std::fflush(stdout);
}

void print_header(bool json) {
  if (json) return;
  fmt::print(
      "{:<15} {:<13} {:>7} {:>3} {:>3} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>7} {:>7}\n",
      "source", "model", "lr", "H", "win", "density", "DDP", "DiLoCo", "12 B/entry", "8 B/entry",
      "ours", "B/entry", "12B/ours");
}

// --- real traces -------------------------------------------------------------------------------

// Re-derives one rank's message of one traced window from its inputs (θ_g, e, θ_l), exactly as
// Engine::Impl::gate_and_encode does: the engine's chunks, the gate kernel and the run's codec
// options; every frame decoded again and compared.
Message rederive(const fs::path& trace_dir, std::uint64_t window, int rank, ThreadPool& pool,
                 std::optional<codec::Encoding> encoding) {
  const TracedWindow traced = load_traced_window(trace_dir, window, rank);
  const EngineOptions& options = traced.options;
  // The run's codec options, or another encoding of the same entries (then there is no engine
  // record to compare with).
  codec::EncodeOptions codec = options.codec;
  if (encoding) codec.encoding = *encoding;
  const bool as_sent = codec.encoding == options.codec.encoding;
  const auto& chunks = traced.chunks;
  const auto& numels = traced.numels;
  std::vector<EncodedFrame> frames(chunks.size());
  std::vector<std::uint64_t> fired(chunks.size());
  pool.parallel_for(chunks.size(), [&](std::size_t c) {
    const TracedChunk& chunk = chunks[c];
    thread_local std::vector<std::uint32_t> offsets;
    thread_local std::vector<float> values;
    offsets.resize(chunk.length);
    values.resize(chunk.length);
    const kernels::GateChunk gate_chunk = traced.gate_chunk(c);
    const kernels::GateResult result = kernels::gate(gate_chunk, offsets.data(), values.data());
    if (result.non_finite_offset) {
      throw std::runtime_error("traced window has a non-finite pseudo-gradient");
    }
    fired[c] = result.fired;
    const codec::FrameEntries entries = traced.frame_entries(
        c, std::span(offsets.data(), result.fired), std::span(values.data(), result.fired));
    frames[c] = encode_frame_checked(entries, codec, numels, true);
  });
  codec::MessageHeader header;
  header.window = window;
  header.sender_rank = static_cast<std::uint32_t>(rank);
  header.encoding = codec.encoding;
  header.tensor_numels = numels;
  Message message;
  message.rank = rank;
  message.ours_bytes =
      codec::encode_header(header, static_cast<std::uint32_t>(chunks.size())).size();
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    message.entries += fired[c];
    message.ours_bytes += frames[c].bytes;
    message.index_bytes += frames[c].index_bytes;
    message.value_bytes += frames[c].value_bytes;
  }
  // What the engine itself sent in this window (recorded in the outputs' report).
  const fs::path out_path = state_files::trace_file(trace_dir, window, rank, false);
  if (as_sent && fs::exists(out_path)) {
    const io::SafetensorsReader out(out_path);
    const auto report =
        nlohmann::json::parse(state_files::require(out.metadata(), "report", out.path()));
    message.engine_bytes = report.at("payload_bytes").get<std::uint64_t>();
    if (*message.engine_bytes != message.ours_bytes ||
        report.at("entries").get<std::uint64_t>() != message.entries) {
      throw std::runtime_error(fmt::format(
          "{}: re-derived message ({} entries, {} B) differs from the engine's ({} entries, {} B)",
          out_path.string(), message.entries, message.ours_bytes,
          report.at("entries").get<std::uint64_t>(), *message.engine_bytes));
    }
  }
  return message;
}

std::vector<Row> trace_rows(const fs::path& dir, double lr, ThreadPool& pool,
                            std::optional<codec::Encoding> encoding) {
  std::vector<Row> rows;
  for (std::uint64_t window : traced_windows(dir)) {
    const auto start = std::chrono::steady_clock::now();
    const io::SafetensorsReader first(state_files::trace_file(dir, window, 0, true));
    const auto world =
        static_cast<int>(state_files::require_u64(first.metadata(), "world_size", first.path()));
    const EngineOptions options = options_from_json(
        nlohmann::json::parse(state_files::require(first.metadata(), "options", first.path())));
    Row row;
    row.source = "trace";
    row.model = "example-5M";
    row.lr = lr;
    row.H = options.steps_per_window;
    row.window = window;
    for (const io::TensorInfo& info : first.tensors()) {
      if (info.spec.name.rfind(state_files::kLocal, 0) == 0) row.parameters += info.spec.numel();
    }
    for (int r = 0; r < world; ++r)
      row.messages.push_back(rederive(dir, window, r, pool, encoding));
    row.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // rederive() throws on a mismatch, so every message with the engine's record matched it.
    const bool all_recorded =
        std::all_of(row.messages.begin(), row.messages.end(),
                    [](const Message& m) { return m.engine_bytes.has_value(); });
    row.extra = {{"trace_dir", dir.string()},
                 {"engine_bytes_checked", all_recorded},
                 {"encoding", codec::encoding_name(encoding.value_or(options.codec.encoding))},
                 {"bf16_delta", kernels::bf16_delta_name(options.bf16_delta)}};
    rows.push_back(std::move(row));
  }
  if (rows.empty()) throw InvalidArgument("no traced windows in " + dir.string());
  return rows;
}

// --- Qwen shapes, synthetic generator ----------------------------------------------------------

nlohmann::json generator_json(const GeneratorConfig& g) {
  return {{"workers", g.workers},
          {"windows", g.windows},
          {"beta1", g.beta1},
          {"beta2", g.beta2},
          {"eps", g.eps},
          {"weight_decay", g.weight_decay},
          {"weight_std", g.weight_std},
          {"norm_weight", g.norm_weight},
          {"grad_rms", g.grad_rms},
          {"signal", g.signal},
          {"noise", g.noise},
          {"batch_scale_sigma", g.batch_scale_sigma},
          {"warm_optimizer", g.warm_optimizer},
          {"outer_lr", g.outer_lr},
          {"outer_momentum", g.outer_momentum},
          {"chunk_elements", g.chunk_elements},
          {"seed", g.seed},
          {"threads", g.threads}};
}

std::vector<Row> qwen_rows(const QwenConfig& model, const GeneratorConfig& base,
                           const std::string& label) {
  GeneratorConfig config = base;
  config.tensors = qwen2_tensors(model);
  const GeneratorResult result = run_generator(config);
  std::vector<Row> rows;
  for (std::size_t w = 0; w < result.messages.size(); ++w) {
    Row row;
    row.source = label;
    row.model = std::string(model.name);
    row.parameters = result.parameters;
    row.lr = config.lr;
    row.H = static_cast<std::uint64_t>(config.inner_steps);
    row.window = w;
    for (std::size_t r = 0; r < result.messages[w].size(); ++r) {
      const WorkerMessage& m = result.messages[w][r];
      row.messages.push_back(
          {static_cast<int>(r), m.entries, m.ours_bytes, m.index_bytes, m.value_bytes, {}});
    }
    row.seconds = result.seconds;  // the whole run (every window)
    row.extra = {{"generator", generator_json(config)},
                 {"encoding", codec::encoding_name(config.codec.encoding)},
                 {"tensors", config.tensors.size()},
                 {"published_parameters", model.published_parameters}};
    if (config.estimate_entropy) {
      EntropyEstimate bits;
      std::uint64_t entries = 0;
      for (const WorkerMessage& m : result.messages[w]) {
        bits += m.entropy;
        entries += m.entries;
      }
      row.extra["entropy_bytes_per_entry"] = entropy_json(bits, entries);
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  GeneratorConfig& g = s.generator;
  CLI::App app{
      "Payload per worker per window: DDP, DiLoCo, the authors' 12-byte format, "
      "int32+fp32 and ours"};
  app.add_option("--qwen", s.qwen, "Qwen2.5 scales (0.5B,1.5B,3B,7B, tiny; 'none' for none)")
      ->delimiter(',');
  app.add_option("--trace", s.traces, "a pulseloco_train --trace-dir directory (repeatable)");
  app.add_option("--trace-lr", s.trace_lrs, "the inner lr of each --trace run, in order");
  app.add_option("--lr", g.lr, "generator: inner AdamW learning rate")
      ->check(flags::above(0))
      ->capture_default_str();
  app.add_option("-H,--steps-per-window", g.inner_steps, "generator: inner steps per window")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--workers", g.workers, "generator: simulated workers")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--windows", g.windows, "generator: windows")
      ->check(flags::at_least(1))
      ->capture_default_str();
  app.add_option("--weight-std", g.weight_std, "generator: std of matrix/embedding/bias weights")
      ->capture_default_str();
  app.add_option("--grad-rms", g.grad_rms, "generator: gradient rms per element")
      ->capture_default_str();
  app.add_option("--signal", g.signal, "generator: weight of the persistent gradient direction")
      ->capture_default_str();
  app.add_option("--noise", g.noise, "generator: weight of the per-step gradient noise")
      ->capture_default_str();
  app.add_flag("!--cold-optimizer", g.warm_optimizer,
               "generator: AdamW moments start at zero (step 1) instead of stationary");
  app.add_option("--seed", g.seed, "generator: seed")->capture_default_str();
  app.add_option("--threads", g.threads, "threads (0: all cores)")->capture_default_str();
  app.add_option("--min-ratio", s.min_ratio,
                 "fail unless ours is this many times smaller than the 12-byte format")
      ->capture_default_str();
  app.add_option("--label", s.label, "the 'source' field of the generator's records")
      ->capture_default_str();
  app.add_option("--encoding", s.encoding,
                 "encode with this encoding (pulse, context, ...) instead of the traced run's "
                 "(traces) or pulse (generator)");
  app.add_flag("--json", s.json, "one JSON record per line");
  CLI11_PARSE(app, argc, argv);

  try {
    if (s.traces.size() != s.trace_lrs.size()) {
      throw InvalidArgument("give one --trace-lr per --trace");
    }
    if (s.qwen.size() == 1 && s.qwen[0] == "none") s.qwen.clear();
    std::vector<const QwenConfig*> models;
    for (const std::string& scale : s.qwen)
      models.push_back(&qwen_config_or_tiny(scale));

    print_header(s.json);
    double worst_ratio = 1e300;
    auto emit = [&](const Row& row) {
      const nlohmann::json j = row_json(row);
      for (const auto& rank : j["ranks"]) {
        if (rank["entries"].get<std::uint64_t>() > 0) {
          worst_ratio = std::min(worst_ratio, rank["ratio_authors_over_ours"].get<double>());
        }
      }
      print_row(j, s.json);
    };
    std::optional<codec::Encoding> encoding;
    if (!s.encoding.empty()) {
      encoding = parse_encoding(s.encoding);
      g.codec.encoding = *encoding;
      g.estimate_entropy = *encoding == codec::Encoding::context;
    }
    ThreadPool pool(g.threads);
    for (std::size_t i = 0; i < s.traces.size(); ++i) {
      for (const Row& row : trace_rows(s.traces[i], s.trace_lrs[i], pool, encoding))
        emit(row);
    }
    for (const QwenConfig* model : models) {
      for (const Row& row : qwen_rows(*model, g, s.label))
        emit(row);
    }
    const bool ok = worst_ratio >= s.min_ratio;
    const std::string verdict = fmt::format(
        "ours vs the 12-byte format on equal messages: at least {:.2f}x smaller on "
        "every message (target {:.1f}x): {}",
        worst_ratio, s.min_ratio, ok ? "met" : "NOT met");
    if (s.json) {
      fmt::print("{}\n", nlohmann::json{{"benchmark", "payload-summary"},
                                        {"min_ratio_authors_over_ours", worst_ratio},
                                        {"target", s.min_ratio},
                                        {"met", ok}}
                             .dump());
      std::fprintf(stderr, "pulseloco_bench_payload: %s\n", verdict.c_str());
    } else {
      fmt::print("{}\n", verdict);
    }
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pulseloco_bench_payload: %s\n", e.what());
    return 2;
  }
}
