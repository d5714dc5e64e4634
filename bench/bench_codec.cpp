// Wire codec: bytes per entry (indices and values separately) and single-thread encode/decode
// throughput for ours (pulse) and the two plain encodings, on window messages produced by the
// window kernels from a synthetic training trace (bench/synthetic_trace.h).
//
//   build/bin/pulseloco_bench_codec            a table
//   build/bin/pulseloco_bench_codec --json     the same as JSON
//   --windows N --dim D --layers L --workers R --min-time SECONDS --levels 1,3,9
//
// Besides the three encodings it measures each index coding forced on every frame and a set of
// zstd levels (how kDefaultZstdLevel was chosen), and the zeroth-order entropy of the value
// byte planes (what an ideal per-byte entropy coder would reach).
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <pulseloco/codec/message.h>
#include "synthetic_trace.h"

namespace {

using pulseloco::bench::ChunkEntries;
using pulseloco::bench::SyntheticTrainer;
using pulseloco::bench::TraceConfig;
namespace codec = pulseloco::codec;
using Clock = std::chrono::steady_clock;

struct Options {
  bool json = false;
  int windows = 4;
  std::uint64_t dim = 512;
  int layers = 3;
  int workers = 2;
  double min_time = 0.3;
  std::optional<float> grad_rms_median;
  std::optional<float> grad_rms_log_sigma;
  std::optional<float> scale_sigma;
  bool trace_only = false;
  std::string only;  // measure only the variant of this name
  std::vector<int> levels = {1, 2, 3, 5, 9, 19};
};

struct Variant {
  std::string name;
  codec::EncodeOptions options;
  bool study = false;  // not one of the three headline encodings
};

// CPU time of the calling thread: on a shared machine this counts only the time the thread
// actually ran, which is what "entries per second per thread" means.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct Rate {
  double cpu = 0;   // entries per second of thread CPU time
  double wall = 0;  // entries per second of wall-clock time
};

struct Result {
  std::string name;
  std::string encoding;
  std::string index_coding;
  int zstd_level = 0;
  bool study = false;
  std::uint64_t entries = 0;
  std::uint64_t frames = 0;
  std::uint64_t message_bytes = 0;
  std::uint64_t index_bytes = 0;
  std::uint64_t value_bytes = 0;
  std::uint64_t framing_bytes = 0;             // headers, frame prefixes, checksums
  std::vector<double> window_bytes_per_entry;  // whole message / entries, per window
  Rate encode;
  Rate decode;
};

std::vector<int> parse_levels(const std::string& text) {
  std::vector<int> levels;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ','))
    levels.push_back(std::stoi(item));
  return levels;
}

Options parse_options(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--json") {
      options.json = true;
    } else if (arg == "--windows") {
      options.windows = std::stoi(value());
    } else if (arg == "--dim") {
      options.dim = std::stoull(value());
    } else if (arg == "--layers") {
      options.layers = std::stoi(value());
    } else if (arg == "--workers") {
      options.workers = std::stoi(value());
    } else if (arg == "--min-time") {
      options.min_time = std::stod(value());
    } else if (arg == "--grad-rms-median") {
      options.grad_rms_median = std::stof(value());
    } else if (arg == "--grad-rms-log-sigma") {
      options.grad_rms_log_sigma = std::stof(value());
    } else if (arg == "--scale-sigma") {
      options.scale_sigma = std::stof(value());
    } else if (arg == "--only") {
      options.only = value();
    } else if (arg == "--trace-only") {
      options.trace_only = true;
    } else if (arg == "--levels") {
      options.levels = parse_levels(value());
    } else if (arg == "--help" || arg == "-h") {
      std::cout << "usage: pulseloco_bench_codec [--json] [--windows N] [--dim D] [--layers L]"
                   " [--workers R] [--min-time SECONDS] [--levels 1,3,9] [--only VARIANT]\n";
      std::exit(0);
    } else {
      throw std::invalid_argument("unknown argument " + arg);
    }
  }
  if (options.windows < 1) throw std::invalid_argument("--windows must be >= 1");
  return options;
}

// One message per window: rank 0's frames.
struct Message {
  codec::MessageHeader header;
  const std::vector<ChunkEntries>* chunks = nullptr;
};

codec::FrameEntries frame_of(const ChunkEntries& chunk) {
  return {.tensor = chunk.tensor,
          .begin = chunk.begin,
          .length = chunk.length,
          .offsets = chunk.offsets,
          .values = chunk.values};
}

std::vector<std::byte> encode_message(const Message& message, const codec::EncodeOptions& opts) {
  codec::MessageHeader header = message.header;
  header.encoding = opts.encoding;
  std::vector<std::byte> bytes =
      codec::encode_header(header, static_cast<std::uint32_t>(message.chunks->size()));
  for (const ChunkEntries& chunk : *message.chunks) {
    const auto frame = codec::encode_frame(frame_of(chunk), opts);
    bytes.insert(bytes.end(), frame.begin(), frame.end());
  }
  return bytes;
}

// Runs `body` (which processes `entries_per_call` entries) until min_time of thread CPU time
// has passed.
template <typename Body>
Rate entries_per_second(double min_time, std::uint64_t entries_per_call, Body&& body) {
  body();  // warm-up: scratch buffers, zstd contexts, caches
  std::uint64_t calls = 0;
  const double cpu_start = thread_cpu_seconds();
  const auto wall_start = Clock::now();
  double cpu = 0;
  do {
    body();
    ++calls;
    cpu = thread_cpu_seconds() - cpu_start;
  } while (cpu < min_time);
  const double wall = std::chrono::duration<double>(Clock::now() - wall_start).count();
  const auto entries = static_cast<double>(calls * entries_per_call);
  return {entries / cpu, entries / wall};
}

Result measure(const Variant& variant, const std::vector<Message>& messages, double min_time) {
  Result result;
  result.name = variant.name;
  result.encoding = std::string(codec::encoding_name(variant.options.encoding));
  result.index_coding =
      variant.options.encoding != codec::Encoding::pulse
          ? "-"
          : (variant.options.index_coding
                 ? std::string(codec::index_coding_name(*variant.options.index_coding))
                 : "smallest");
  result.zstd_level = variant.options.encoding != codec::Encoding::pulse ? 0
                      : variant.options.zstd_level == 0                  ? codec::kDefaultZstdLevel
                                                        : variant.options.zstd_level;
  result.study = variant.study;

  std::vector<std::vector<std::byte>> encoded;
  for (const Message& message : messages) {
    encoded.push_back(encode_message(message, variant.options));
    const auto view = codec::MessageView::parse(encoded.back());
    result.message_bytes += encoded.back().size();
    result.frames += view.frame_count();
    std::uint64_t window_entries = 0;
    for (std::size_t i = 0; i < view.frame_count(); ++i) {
      const codec::FrameInfo& info = view.frame(i);
      window_entries += info.entries;
      result.index_bytes += info.index_bytes;
      result.value_bytes += info.value_bytes;
    }
    result.entries += window_entries;
    result.window_bytes_per_entry.push_back(window_entries == 0
                                                ? 0.0
                                                : static_cast<double>(encoded.back().size()) /
                                                      static_cast<double>(window_entries));
  }
  result.framing_bytes = result.message_bytes - result.index_bytes - result.value_bytes;

  // Lossless: every frame decodes to the same offsets and the same value bits.
  codec::DecodeScratch scratch;
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
  for (std::size_t m = 0; m < messages.size(); ++m) {
    const auto view = codec::MessageView::parse(encoded[m]);
    for (std::size_t i = 0; i < view.frame_count(); ++i) {
      const ChunkEntries& chunk = (*messages[m].chunks)[i];
      offsets.resize(view.frame(i).entries);
      values.resize(view.frame(i).entries);
      const std::uint64_t n = view.decode_frame(i, offsets, values, scratch);
      if (n != chunk.offsets.size() || offsets != chunk.offsets ||
          std::memcmp(values.data(), chunk.values.data(), n * sizeof(float)) != 0) {
        throw std::runtime_error(variant.name + ": round trip is not lossless");
      }
    }
  }

  result.encode = entries_per_second(min_time, result.entries, [&] {
    for (const Message& message : messages) {
      for (const ChunkEntries& chunk : *message.chunks) {
        const auto frame = codec::encode_frame(frame_of(chunk), variant.options);
        if (frame.empty()) throw std::logic_error("empty frame");
      }
    }
  });
  std::uint64_t largest = 0;
  for (const auto& message : messages) {
    for (const auto& chunk : *message.chunks)
      largest = std::max<std::uint64_t>(largest, chunk.offsets.size());
  }
  offsets.resize(largest);
  values.resize(largest);
  std::vector<codec::MessageView> views;
  for (const auto& bytes : encoded)
    views.push_back(codec::MessageView::parse(bytes));
  result.decode = entries_per_second(min_time, result.entries, [&] {
    for (const auto& view : views) {
      for (std::size_t i = 0; i < view.frame_count(); ++i) {
        (void)view.decode_frame(i, offsets, values, scratch);
      }
    }
  });
  return result;
}

// Zeroth-order entropy, in bits per entry, of byte plane k of all values.
double plane_entropy(const std::vector<Message>& messages, int plane) {
  std::uint64_t counts[256] = {};
  std::uint64_t total = 0;
  for (const Message& message : messages) {
    for (const ChunkEntries& chunk : *message.chunks) {
      for (const float value : chunk.values) {
        std::uint32_t bits;
        std::memcpy(&bits, &value, sizeof bits);
        ++counts[(bits >> (8 * plane)) & 0xFF];
        ++total;
      }
    }
  }
  double bits = 0;
  for (const std::uint64_t c : counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / static_cast<double>(total);
    bits -= p * std::log2(p);
  }
  return bits;
}

nlohmann::json to_json(const Result& r) {
  const auto per_entry = [&](std::uint64_t bytes) {
    return r.entries == 0 ? 0.0 : static_cast<double>(bytes) / static_cast<double>(r.entries);
  };
  return {{"name", r.name},
          {"encoding", r.encoding},
          {"index_coding", r.index_coding},
          {"zstd_level", r.zstd_level},
          {"study", r.study},
          {"entries", r.entries},
          {"frames", r.frames},
          {"message_bytes", r.message_bytes},
          {"index_bytes_per_entry", per_entry(r.index_bytes)},
          {"value_bytes_per_entry", per_entry(r.value_bytes)},
          {"framing_bytes_per_entry", per_entry(r.framing_bytes)},
          {"bytes_per_entry", per_entry(r.message_bytes)},
          {"window_bytes_per_entry", r.window_bytes_per_entry},
          {"encode_M_entries_per_s_per_thread", r.encode.cpu / 1e6},
          {"decode_M_entries_per_s_per_thread", r.decode.cpu / 1e6},
          {"encode_M_entries_per_s_wall", r.encode.wall / 1e6},
          {"decode_M_entries_per_s_wall", r.decode.wall / 1e6}};
}

}  // namespace

int main(int argc, char** argv) try {
  const Options options = parse_options(argc, argv);
  TraceConfig config;
  config.tensors = pulseloco::bench::transformer_tensors(options.dim, options.layers, 1);
  config.workers = options.workers;
  if (options.grad_rms_median) config.grad_rms_median = *options.grad_rms_median;
  if (options.grad_rms_log_sigma) config.grad_rms_log_sigma = *options.grad_rms_log_sigma;
  if (options.scale_sigma) config.scale_sigma = *options.scale_sigma;
  SyntheticTrainer trainer(config);

  std::vector<pulseloco::bench::WindowMessages> windows;
  nlohmann::json window_stats = nlohmann::json::array();
  for (int w = 0; w < options.windows; ++w) {
    windows.push_back(trainer.run_window());
    const double density = static_cast<double>(windows.back().entries(0)) /
                           static_cast<double>(trainer.total_elements());
    window_stats.push_back(
        {{"window", w}, {"entries", windows.back().entries(0)}, {"density", density}});
  }
  if (options.trace_only) {
    std::cout << window_stats.dump() << '\n';
    return 0;
  }
  std::vector<Message> messages;
  for (const auto& window : windows) {
    Message message;
    message.header.window = window.window;
    message.header.sender_rank = 0;
    for (const auto& tensor : config.tensors)
      message.header.tensor_numels.push_back(tensor.numel);
    message.chunks = &window.workers[0];
    messages.push_back(message);
  }

  std::vector<Variant> variants = {
      {"pulse", {.encoding = codec::Encoding::pulse}, false},
      {"plain_i64_f32", {.encoding = codec::Encoding::plain_i64_f32}, false},
      {"plain_i32_f32", {.encoding = codec::Encoding::plain_i32_f32}, false},
  };
  for (const auto coding :
       {codec::IndexCoding::varint, codec::IndexCoding::bitpack, codec::IndexCoding::elias_fano}) {
    variants.push_back({"pulse/" + std::string(codec::index_coding_name(coding)),
                        {.encoding = codec::Encoding::pulse, .index_coding = coding},
                        true});
  }
  for (const int level : options.levels) {
    variants.push_back({"pulse/zstd-" + std::to_string(level),
                        {.encoding = codec::Encoding::pulse, .zstd_level = level},
                        true});
  }

  std::vector<Result> results;
  for (const Variant& variant : variants) {
    if (!options.only.empty() && variant.name != options.only) continue;
    results.push_back(measure(variant, messages, options.min_time));
  }

  nlohmann::json planes = nlohmann::json::array();
  for (int k = 0; k < 4; ++k)
    planes.push_back(plane_entropy(messages, k));

  if (options.json) {
    nlohmann::json out;
    out["trace"] = {{"elements", trainer.total_elements()},
                    {"tensors", config.tensors.size()},
                    {"workers", config.workers},
                    {"inner_steps", config.inner_steps},
                    {"lr", config.lr},
                    {"windows", window_stats},
                    {"chunk_elements", config.chunk_elements}};
    out["value_plane_entropy_bits_per_entry"] = planes;
    out["results"] = nlohmann::json::array();
    for (const Result& r : results)
      out["results"].push_back(to_json(r));
    std::cout << out.dump(2) << '\n';
    return 0;
  }
  fmt::print("trace: {} elements in {} tensors, {} workers, H={}, lr={}\n",
             trainer.total_elements(), config.tensors.size(), config.workers, config.inner_steps,
             config.lr);
  for (const auto& w : window_stats) {
    fmt::print("  window {}: {} entries from rank 0 (density {:.3f}%)\n", w["window"].get<int>(),
               w["entries"].get<std::uint64_t>(), 100 * w["density"].get<double>());
  }
  fmt::print("value byte planes, zeroth-order entropy (bits/entry): {:.2f} {:.2f} {:.2f} {:.2f}\n",
             planes[0].get<double>(), planes[1].get<double>(), planes[2].get<double>(),
             planes[3].get<double>());
  fmt::print("\n{:<22} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12}\n", "variant", "index B/e",
             "value B/e", "frame B/e", "total B/e", "enc M e/s", "dec M e/s");
  for (const Result& r : results) {
    const auto j = to_json(r);
    fmt::print("{:<22} {:>9.3f} {:>9.3f} {:>9.3f} {:>9.3f} {:>12.1f} {:>12.1f}\n", r.name,
               j["index_bytes_per_entry"].get<double>(), j["value_bytes_per_entry"].get<double>(),
               j["framing_bytes_per_entry"].get<double>(), j["bytes_per_entry"].get<double>(),
               r.encode.cpu / 1e6, r.decode.cpu / 1e6);
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << "pulseloco_bench_codec: " << e.what() << '\n';
  return 1;
}
