// pulseloco_bench_context: the context encoding (values coded against θ_g) against pulse on the
// same messages, both in one run (docs/benchmarks.md, "Context-coded messages"):
//
//   --trace DIR [--trace-label L]   traced windows of a pulseloco_train run (--trace-dir): for
//                                   every window and rank, the gate re-run exactly as the engine
//                                   ran it, the entries encoded with both codecs and decoded again
//                                   (bit-exact), bytes per entry split into index and value, and
//                                   entropy estimates beside them;
//   --parameters 2e7,1e8            a synthetic state of that many parameters (bf16-rounded
//                                   N(0, 0.02²) θ_g, fp32 θ_l moved so that about --density of
//                                   the elements fire; with --locals bf16-authors fp32 θ_g and
//                                   bf16 θ_l, the authors' Δ): gate, encode, decode and apply timed
//                                   chunk by chunk, the two codecs alternating which goes first,
//                                   on one thread and on all cores; beside them one read of θ_g,
//                                   the least a decoder modelling the indices by θ_g adds to
//                                   pulse's work.
//
// --json prints one JSON record per line.
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/tensor_view.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/codec/context_coding.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/engine/replay.h>
#include <pulseloco/engine/state_files.h>
#include <pulseloco/kernels/window_kernels.h>
#include "context_entropy.h"
#include "traced_window.h"

namespace {

using namespace pulseloco;
using namespace pulseloco::bench;
using Clock = std::chrono::steady_clock;

constexpr std::array<codec::Encoding, 2> kCodecs = {codec::Encoding::pulse,
                                                    codec::Encoding::context};

// --- encoding and checking one chunk -------------------------------------------------------------

struct Sizes {
  std::uint64_t entries = 0;
  std::uint64_t bytes = 0;
  std::uint64_t index_bytes = 0;
  std::uint64_t value_bytes = 0;
  std::uint64_t context_frames = 0;  // frames that went context-coded (not the fallback)
  std::uint64_t residue_frames = 0;  // ... of them, with values coded less θ_g's cast residue
};

// Encodes, decodes again and compares; adds the frame's sizes to `sizes`.
void encode_checked(const codec::FrameEntries& entries, codec::Encoding encoding,
                    const std::vector<std::uint64_t>& numels, Sizes& sizes) {
  const std::vector<std::byte> frame = codec::encode_frame(entries, {.encoding = encoding});
  codec::MessageHeader header{.encoding = encoding, .tensor_numels = numels};
  std::vector<std::byte> message = codec::encode_header(header, 1);
  message.insert(message.end(), frame.begin(), frame.end());
  const codec::MessageView view = codec::MessageView::parse(message);
  thread_local codec::DecodeScratch scratch;
  thread_local std::vector<std::uint32_t> offsets;
  thread_local std::vector<float> values;
  offsets.resize(entries.offsets.size());
  values.resize(entries.offsets.size());
  if (view.decode_frame(0, offsets, values, scratch, entries.context) != offsets.size() ||
      !std::equal(offsets.begin(), offsets.end(), entries.offsets.begin()) ||
      (!values.empty() &&
       std::memcmp(values.data(), entries.values.data(), values.size() * sizeof(float)) != 0)) {
    throw std::runtime_error("a frame did not decode to the bits it was encoded from");
  }
  sizes.entries += entries.offsets.size();
  sizes.bytes += frame.size();
  sizes.index_bytes += view.frame(0).index_bytes;
  sizes.value_bytes += view.frame(0).value_bytes;
  if (view.frame(0).encoding == codec::Encoding::context) ++sizes.context_frames;
  if (view.frame(0).values_less_residue) ++sizes.residue_frames;
}

nlohmann::json sizes_json(const Sizes& s) {
  const double n = std::max<double>(1.0, static_cast<double>(s.entries));
  return {{"bytes", s.bytes},
          {"bytes_per_entry", static_cast<double>(s.bytes) / n},
          {"index_bytes_per_entry", static_cast<double>(s.index_bytes) / n},
          {"value_bytes_per_entry", static_cast<double>(s.value_bytes) / n},
          {"context_frames", s.context_frames},
          {"residue_frames", s.residue_frames}};
}

// --- traces
// -----------------------------------------------------------------------------------------

void run_traces(const std::string& dir, const std::string& label, ThreadPool& pool, bool json) {
  for (const std::uint64_t window : traced_windows(dir)) {
    for (int rank = 0;; ++rank) {
      if (!std::filesystem::exists(state_files::trace_file(dir, window, rank, true))) break;
      const TracedWindow traced = load_traced_window(dir, window, rank);
      const std::size_t chunks = traced.chunks.size();
      std::vector<std::array<Sizes, 2>> sizes(chunks);
      std::vector<EntropyEstimate> entropy(chunks);
      pool.parallel_for(chunks, [&](std::size_t c) {
        const TracedChunk& chunk = traced.chunks[c];
        std::vector<std::uint32_t> offsets(chunk.length);
        std::vector<float> values(chunk.length);
        const kernels::GateResult result =
            kernels::gate(traced.gate_chunk(c), offsets.data(), values.data());
        if (result.non_finite_offset) throw std::runtime_error("a traced window diverged");
        const codec::FrameEntries entries = traced.frame_entries(
            c, std::span(offsets.data(), result.fired), std::span(values.data(), result.fired));
        for (std::size_t k = 0; k < kCodecs.size(); ++k)
          encode_checked(entries, kCodecs[k], traced.numels, sizes[c][k]);
        entropy[c] = estimate_entropy(entries.offsets, entries.values, entries.context);
      });
      std::array<Sizes, 2> total{};
      EntropyEstimate h;
      for (std::size_t c = 0; c < chunks; ++c) {
        for (std::size_t k = 0; k < 2; ++k) {
          total[k].entries += sizes[c][k].entries;
          total[k].bytes += sizes[c][k].bytes;
          total[k].index_bytes += sizes[c][k].index_bytes;
          total[k].value_bytes += sizes[c][k].value_bytes;
          total[k].context_frames += sizes[c][k].context_frames;
          total[k].residue_frames += sizes[c][k].residue_frames;
        }
        h += entropy[c];
      }
      std::uint64_t parameters = 0;
      for (const std::uint64_t n : traced.numels)
        parameters += n;
      const double n = std::max<double>(1.0, static_cast<double>(total[0].entries));
      const nlohmann::json record = {
          {"benchmark", "context-trace"},
          {"label", label},
          {"trace_dir", dir},
          {"window", window},
          {"rank", rank},
          {"local_dtype", dtype_name(traced.local_dtypes.front())},
          {"bf16_delta", kernels::bf16_delta_name(traced.options.bf16_delta)},
          {"parameters", parameters},
          {"entries", total[0].entries},
          {"density", static_cast<double>(total[0].entries) / static_cast<double>(parameters)},
          {"chunks", chunks},
          {"pulse", sizes_json(total[0])},
          {"context", sizes_json(total[1])},
          {"ratio_pulse_over_context",
           static_cast<double>(total[0].bytes) / static_cast<double>(total[1].bytes)},
          {"entropy_bytes_per_entry", entropy_json(h, total[0].entries)}};
      if (json) {
        fmt::print("{}\n", record.dump());
      } else {
        fmt::print(
            "{} w{} r{} {} {}: density {:.3f}%  pulse {:.3f} (idx {:.3f} val {:.3f})  context "
            "{:.3f} (idx {:.3f} val {:.3f})  x{:.3f}  H idx {:.3f}/{:.3f} val {:.3f} / {:.3f}  "
            "context frames {} ({} less the residue) of {}\n",
            label, window, rank, record["local_dtype"].get<std::string>(),
            record["bf16_delta"].get<std::string>(), 100 * record["density"].get<double>(),
            record["pulse"]["bytes_per_entry"].get<double>(),
            record["pulse"]["index_bytes_per_entry"].get<double>(),
            record["pulse"]["value_bytes_per_entry"].get<double>(),
            record["context"]["bytes_per_entry"].get<double>(),
            record["context"]["index_bytes_per_entry"].get<double>(),
            record["context"]["value_bytes_per_entry"].get<double>(),
            record["ratio_pulse_over_context"].get<double>(), h.index_positions / 8 / n,
            h.index_exponent / 8 / n, h.value_context / 8 / n, h.value_boundary / 8 / n,
            total[1].context_frames, total[1].residue_frames, chunks);
      }
    }
  }
}

// --- speed: a synthetic state --------------------------------------------------------------------

// The local weights of a synthetic state: fp32, or bf16 with the authors' Δ = θ_g − θ_l (the
// PULSE authors' configuration, where every s carries θ_g's bf16 cast residue).
enum class Locals { fp32, bf16_authors };

const char* locals_name(Locals locals) {
  return locals == Locals::fp32 ? "fp32" : "bf16-authors";
}

struct SyntheticState {
  std::uint64_t chunk = std::uint64_t{1} << 20;
  Locals locals = Locals::fp32;
  std::vector<float> global, local, residual, momentum;
  std::vector<std::uint16_t> local_bf16;
  [[nodiscard]] std::size_t chunks() const { return (global.size() + chunk - 1) / chunk; }
  [[nodiscard]] std::uint64_t begin(std::size_t c) const { return c * chunk; }
  [[nodiscard]] std::uint64_t length(std::size_t c) const {
    return std::min<std::uint64_t>(chunk, global.size() - begin(c));
  }
};

// fp32 locals: θ_g ~ bf16(N(0, 0.02²)); θ_l = θ_g - Δ with Δ = scale * exp(1.5 z) * N(0, 1) (a
// log-normal spread of step sizes, as Adam's across elements), the scale set so that about
// `density` of the elements move by at least half a bf16 ulp of θ_g.
// bf16 locals (authors): θ_g ~ N(0, 0.02²) in fp32, off the bf16 grid as after outer steps;
// θ_l = bf16(θ_g - Δ), the scale set so that about `density` of the elements cross a bf16
// rounding boundary.
SyntheticState make_state(std::uint64_t parameters, double density, Locals locals,
                          ThreadPool& pool) {
  SyntheticState s;
  s.locals = locals;
  s.global.resize(parameters);
  s.local.resize(parameters);
  s.residual.assign(parameters, 0.0f);
  s.momentum.assign(parameters, 0.0f);
  std::vector<float> step(parameters);
  pool.parallel_for(s.chunks(), [&](std::size_t c) {
    std::mt19937_64 rng(1000 + c);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (std::uint64_t i = s.begin(c); i < s.begin(c) + s.length(c); ++i) {
      s.global[i] = 0.02f * normal(rng);
      if (locals == Locals::fp32) s.global[i] = round_to_bf16(s.global[i]);
      step[i] = std::exp(1.5f * normal(rng)) * normal(rng);
    }
  });
  // The ratio |step| / (the distance at which the element fires) over a sample; its
  // (1 - density) quantile sets the scale. fp32 locals: half a bf16 ulp of θ_g; bf16 locals: the
  // distance from θ_g to its bf16 cell's boundary on the step's side.
  std::vector<double> ratio;
  for (std::uint64_t i = 0; i < parameters; i += std::max<std::uint64_t>(1, parameters / 200000)) {
    const float theta = s.global[i];
    if (theta == 0.0f) continue;
    const double half_ulp = std::ldexp(1.0, std::ilogb(theta) - 8);
    const double centre = round_to_bf16(theta);
    // θ_l = θ_g - scale * step: a positive step moves θ_g down.
    const double distance = locals == Locals::fp32 ? half_ulp
                            : step[i] > 0          ? theta - (centre - half_ulp)
                                                   : (centre + half_ulp) - theta;
    ratio.push_back(std::abs(static_cast<double>(step[i])) / std::max(distance, 1e-30));
  }
  const auto at = static_cast<std::ptrdiff_t>((1.0 - density) * static_cast<double>(ratio.size()));
  std::nth_element(ratio.begin(), ratio.begin() + at, ratio.end());
  const auto scale = static_cast<float>(1.0 / ratio[static_cast<std::size_t>(at)]);
  pool.parallel_for(s.chunks(), [&](std::size_t c) {
    for (std::uint64_t i = s.begin(c); i < s.begin(c) + s.length(c); ++i)
      s.local[i] = s.global[i] - scale * step[i];
  });
  if (locals == Locals::bf16_authors) {
    s.local_bf16.resize(parameters);
    float_to_bf16(s.local, s.local_bf16);
    s.local = {};
  }
  return s;
}

double seconds_of(const std::function<void()>& f) {
  const auto start = Clock::now();
  f();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void run_speed(std::uint64_t parameters, double density, Locals locals, unsigned threads,
               int repetitions, bool json) {
  ThreadPool pool(threads);
  const unsigned used = threads == 0 ? std::max(1u, std::thread::hardware_concurrency()) : threads;
  SyntheticState s = make_state(parameters, density, locals, pool);
  const bool bf16 = locals == Locals::bf16_authors;
  const DType local_dtype = bf16 ? DType::bfloat16 : DType::float32;
  const auto local_of = [&](std::size_t c) -> void* {
    return bf16 ? static_cast<void*>(s.local_bf16.data() + s.begin(c))
                : static_cast<void*>(s.local.data() + s.begin(c));
  };
  SyntheticState pristine = s;
  const std::size_t chunks = s.chunks();
  const std::vector<std::uint64_t> numels = {parameters};
  std::vector<std::vector<std::uint32_t>> offsets(chunks);
  std::vector<std::vector<float>> values(chunks);
  std::vector<std::uint64_t> fired(chunks);
  std::array<std::vector<std::vector<std::byte>>, 2> frames;
  std::array<std::vector<double>, 2> encode_s, decode_s;
  std::array<std::uint64_t, 2> bytes{};
  std::array<std::uint64_t, 2> context_frames{}, residue_frames{};
  std::vector<double> gate_s, apply_s, theta_read_s;
  struct Scratch {
    std::uint32_t theta_bits = 0;  // keeps the read of θ_g from being optimised away
    std::vector<std::uint32_t> offsets;
    std::vector<float> values, g;
    codec::DecodeScratch decode;
  };
  std::vector<Scratch> scratch(chunks);
  const auto kernel_chunk = [&](std::size_t c) {
    return kernels::GateChunk{.global = s.global.data() + s.begin(c),
                              .local = local_of(c),
                              .local_dtype = local_dtype,
                              .residual = s.residual.data() + s.begin(c),
                              .count = s.length(c),
                              .bf16_delta = kernels::Bf16Delta::authors};
  };
  const auto entries_of = [&](std::size_t c) {
    return codec::FrameEntries{.tensor = 0,
                               .begin = s.begin(c),
                               .length = s.length(c),
                               .offsets = std::span(offsets[c].data(), fired[c]),
                               .values = std::span(values[c].data(), fired[c]),
                               .context = std::span(s.global).subspan(s.begin(c), s.length(c))};
  };
  for (int rep = 0; rep < repetitions; ++rep) {
    gate_s.push_back(seconds_of([&] {
      pool.parallel_for(chunks, [&](std::size_t c) {
        offsets[c].resize(s.length(c));
        values[c].resize(s.length(c));
        fired[c] = kernels::gate(kernel_chunk(c), offsets[c].data(), values[c].data()).fired;
      });
    }));
    // One read of θ_g that keeps nothing but a word: the least a decoder that models the indices
    // by θ_g's exponents does beyond pulse's work (an encoder could take them from the gate).
    theta_read_s.push_back(seconds_of([&] {
      pool.parallel_for(chunks, [&](std::size_t c) {
        const std::uint64_t length = s.length(c);
        const auto* bits = reinterpret_cast<const std::uint32_t*>(s.global.data() + s.begin(c));
        std::uint32_t any = 0;
        for (std::uint64_t i = 0; i < length; ++i)
          any |= bits[i];
        scratch[c].theta_bits = any;
      });
    }));
    for (int turn = 0; turn < 2; ++turn) {
      const std::size_t k = static_cast<std::size_t>((turn + rep) % 2);  // alternate the order
      frames[k].resize(chunks);
      encode_s[k].push_back(seconds_of([&] {
        pool.parallel_for(chunks, [&](std::size_t c) {
          frames[k][c] = codec::encode_frame(entries_of(c), {.encoding = kCodecs[k]});
        });
      }));
      std::vector<std::byte> message = codec::encode_header(
          {.encoding = kCodecs[k], .tensor_numels = numels}, static_cast<std::uint32_t>(chunks));
      for (const auto& f : frames[k])
        message.insert(message.end(), f.begin(), f.end());
      bytes[k] = message.size();
      decode_s[k].push_back(seconds_of([&] {
        const codec::MessageView view = codec::MessageView::parse(message);
        pool.parallel_for(chunks, [&](std::size_t c) {
          Scratch& sc = scratch[c];
          sc.offsets.resize(view.frame(c).entries);
          sc.values.resize(view.frame(c).entries);
          (void)view.decode_frame(c, sc.offsets, sc.values, sc.decode, entries_of(c).context);
        });
      }));
      if (rep == 0) {
        const codec::MessageView view = codec::MessageView::parse(message);
        for (std::size_t c = 0; c < chunks; ++c) {
          context_frames[k] += view.frame(c).encoding == codec::Encoding::context ? 1 : 0;
          residue_frames[k] += view.frame(c).values_less_residue ? 1 : 0;
          if (scratch[c].offsets.size() != fired[c] ||
              std::memcmp(scratch[c].values.data(), values[c].data(), fired[c] * 4) != 0) {
            throw std::runtime_error("a decoded chunk differs from the gate's entries");
          }
        }
      }
    }
    apply_s.push_back(seconds_of([&] {
      pool.parallel_for(chunks, [&](std::size_t c) {
        Scratch& sc = scratch[c];
        sc.g.resize(s.length(c));
        const kernels::SparseEntries own{std::span(offsets[c].data(), fired[c]),
                                         std::span(values[c].data(), fired[c])};
        kernels::aggregate(std::span(&own, 1), sc.g.data(), s.length(c));
        kernels::commit_and_outer_step({.global = s.global.data() + s.begin(c),
                                        .momentum = s.momentum.data() + s.begin(c),
                                        .residual = s.residual.data() + s.begin(c),
                                        .local = local_of(c),
                                        .local_dtype = local_dtype,
                                        .count = s.length(c),
                                        .bf16_delta = kernels::Bf16Delta::authors},
                                       sc.g.data(), {.first_step = false});
      });
    }));
    // Back to the same state for the next repetition (untimed).
    pool.parallel_for(chunks, [&](std::size_t c) {
      const std::uint64_t b = s.begin(c);
      const std::uint64_t n = s.length(c);
      std::copy_n(pristine.global.begin() + b, n, s.global.begin() + b);
      if (bf16) {
        std::copy_n(pristine.local_bf16.begin() + b, n, s.local_bf16.begin() + b);
      } else {
        std::copy_n(pristine.local.begin() + b, n, s.local.begin() + b);
      }
      std::copy_n(pristine.residual.begin() + b, n, s.residual.begin() + b);
      std::copy_n(pristine.momentum.begin() + b, n, s.momentum.begin() + b);
    });
  }
  std::uint64_t entries = 0;
  for (const std::uint64_t f : fired)
    entries += f;
  const double compute = median(gate_s) + median(apply_s);
  nlohmann::json record = {
      {"benchmark", "context-speed"},
      {"locals", locals_name(locals)},
      {"parameters", parameters},
      {"threads", used},
      {"repetitions", repetitions},
      {"entries", entries},
      {"density", static_cast<double>(entries) / static_cast<double>(parameters)},
      {"gate_s", median(gate_s)},
      {"apply_s", median(apply_s)},
      {"theta_read_s", median(theta_read_s)},
      {"theta_read_over_compute", median(theta_read_s) / compute}};
  for (std::size_t k = 0; k < 2; ++k) {
    const double codec_s = median(encode_s[k]) + median(decode_s[k]);
    record[std::string(codec::encoding_name(kCodecs[k]))] = {
        {"bytes_per_entry", static_cast<double>(bytes[k]) / static_cast<double>(entries)},
        {"encode_s", median(encode_s[k])},
        {"decode_s", median(decode_s[k])},
        {"codec_over_compute", codec_s / compute},
        {"context_frames", context_frames[k]},
        {"residue_frames", residue_frames[k]},
        {"chunks", chunks}};
  }
  if (json) {
    fmt::print("{}\n", record.dump());
  } else {
    fmt::print(
        "{:.0e} params, {} locals, {} threads, density {:.3f}%: gate {:.4f} s apply {:.4f} s, one "
        "read of θ_g {:.4f} s ({:.1f}% of gate+apply)\n",
        static_cast<double>(parameters), locals_name(locals), used, 100 * record["density"].get<double>(),
        median(gate_s), median(apply_s), median(theta_read_s),
        100 * record["theta_read_over_compute"].get<double>());
    for (const codec::Encoding e : kCodecs) {
      const auto& r = record[std::string(codec::encoding_name(e))];
      fmt::print(
          "  {:8} {:.3f} B/entry  encode {:.4f} s  decode {:.4f} s  (encode+decode) / "
          "(gate+apply) = {:.1f}%  context frames {} ({} less the residue) of {}\n",
          codec::encoding_name(e), r["bytes_per_entry"].get<double>(), r["encode_s"].get<double>(),
          r["decode_s"].get<double>(), 100 * r["codec_over_compute"].get<double>(),
          r["context_frames"].get<std::uint64_t>(), r["residue_frames"].get<std::uint64_t>(),
          chunks);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> traces;
  std::vector<std::string> labels;
  std::vector<double> parameters;
  std::vector<unsigned> threads = {1, 0};
  double density = 0.02;
  int repetitions = 3;
  std::vector<std::string> locals = {"fp32"};
  bool json = false;
  CLI::App app{"The context encoding against pulse on the same messages"};
  app.add_option("--trace", traces, "a pulseloco_train --trace-dir directory (repeatable)");
  app.add_option("--trace-label", labels, "a label for each --trace, in order");
  app.add_option("--parameters", parameters, "synthetic states of these sizes (speed)")
      ->delimiter(',');
  app.add_option("--threads", threads, "thread counts for the speed runs (0: all cores)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--density", density, "synthetic state: fraction of elements that fire")
      ->capture_default_str();
  app.add_option("--repetitions", repetitions, "speed: repetitions (the median is reported)")
      ->capture_default_str();
  app.add_option("--locals", locals,
                 "synthetic states' local weights: fp32, bf16-authors (bf16 with the authors' Δ)")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16-authors"}))
      ->capture_default_str();
  app.add_flag("--json", json, "one JSON record per line");
  CLI11_PARSE(app, argc, argv);
  try {
    if (!labels.empty() && labels.size() != traces.size()) {
      throw std::invalid_argument("give one --trace-label per --trace");
    }
    ThreadPool pool(0);
    for (std::size_t i = 0; i < traces.size(); ++i)
      run_traces(traces[i], labels.empty() ? traces[i] : labels[i], pool, json);
    for (const std::string& l : locals) {
      for (const double p : parameters) {
        for (const unsigned t : threads)
          run_speed(static_cast<std::uint64_t>(p), density,
                    l == "fp32" ? Locals::fp32 : Locals::bf16_authors, t, repetitions, json);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pulseloco_bench_context: %s\n", e.what());
    return 2;
  }
}
