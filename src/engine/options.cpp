#include <pulseloco/engine/options.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>

namespace pulseloco {

std::string_view mode_name(Mode mode) noexcept {
  switch (mode) {
    case Mode::pulse:
      return "pulse";
    case Mode::diloco:
      return "diloco";
    case Mode::ddp:
      return "ddp";
  }
  return "unknown";
}

Mode parse_mode(std::string_view name) {
  if (name == "pulse") return Mode::pulse;
  if (name == "diloco") return Mode::diloco;
  if (name == "ddp") return Mode::ddp;
  throw InvalidArgument("mode '" + std::string(name) + "' is not one of pulse, diloco, ddp");
}

std::string_view overlap_name(Overlap overlap) noexcept {
  switch (overlap) {
    case Overlap::blocking:
      return "blocking";
    case Overlap::delayed:
      return "delayed";
    case Overlap::eager:
      return "eager";
  }
  return "unknown";
}

Overlap parse_overlap(std::string_view name) {
  if (name == "blocking") return Overlap::blocking;
  if (name == "delayed") return Overlap::delayed;
  if (name == "eager") return Overlap::eager;
  throw InvalidArgument("overlap '" + std::string(name) +
                        "' is not one of blocking, delayed, eager");
}

std::string_view exchange_name(Exchange exchange) noexcept {
  switch (exchange) {
    case Exchange::automatic:
      return "automatic";
    case Exchange::allgather:
      return "allgather";
    case Exchange::reduction:
      return "reduction";
  }
  return "unknown";
}

Exchange parse_exchange(std::string_view name) {
  if (name == "auto" || name == "automatic") return Exchange::automatic;
  if (name == "allgather") return Exchange::allgather;
  if (name == "reduction") return Exchange::reduction;
  throw InvalidArgument("exchange '" + std::string(name) +
                        "' is not one of auto, allgather, reduction");
}

std::string_view state_location_name(StateLocation location) noexcept {
  switch (location) {
    case StateLocation::automatic:
      return "automatic";
    case StateLocation::device:
      return "device";
    case StateLocation::host:
      return "host";
  }
  return "unknown";
}

StateLocation parse_state_location(std::string_view name) {
  if (name == "auto" || name == "automatic") return StateLocation::automatic;
  if (name == "device") return StateLocation::device;
  if (name == "host") return StateLocation::host;
  throw InvalidArgument("state location '" + std::string(name) +
                        "' is not one of automatic, device, host");
}

collectives::CollectiveAlgorithm parse_allgather(std::string_view name) {
  if (name == "auto" || name == "automatic") return collectives::CollectiveAlgorithm::automatic;
  if (name == "ring") return collectives::CollectiveAlgorithm::ring;
  if (name == "direct") return collectives::CollectiveAlgorithm::direct;
  throw InvalidArgument("all-gather algorithm '" + std::string(name) +
                        "' is not one of auto, ring, direct");
}

codec::Encoding parse_encoding(std::string_view name) {
  for (auto encoding : {codec::Encoding::pulse, codec::Encoding::plain_i64_f32,
                        codec::Encoding::plain_i32_f32, codec::Encoding::context}) {
    if (codec::encoding_name(encoding) == name) return encoding;
  }
  throw InvalidArgument("encoding '" + std::string(name) + "' is unknown");
}

void EngineOptions::validate() const {
  if (steps_per_window < 1) throw InvalidArgument("steps_per_window (H) must be at least 1");
  if (!std::isfinite(outer_lr) || outer_lr <= 0.0f) {
    throw InvalidArgument("outer_lr must be finite and positive");
  }
  if (!std::isfinite(outer_momentum) || outer_momentum < 0.0f || outer_momentum >= 1.0f) {
    throw InvalidArgument("outer_momentum must be finite and in [0, 1)");
  }
  if (chunk_elements < 1024 || chunk_elements > (std::uint64_t{1} << 31)) {
    throw InvalidArgument("chunk_elements must be in [1024, 2^31]");
  }
  if (bucket_elements < 1024 || bucket_elements > (std::uint64_t{1} << 31)) {
    throw InvalidArgument("bucket_elements must be in [1024, 2^31]");
  }
  if (pipeline_chunk_bytes < 4096 || pipeline_chunk_bytes > (std::uint64_t{1} << 30)) {
    throw InvalidArgument("pipeline_chunk_bytes must be in [4096, 2^30]");
  }
  if (codec.zstd_level < 0 || codec.zstd_level > codec::kMaxZstdLevel) {
    throw InvalidArgument(
        fmt::format("codec level must be in [0, {}] (0 = default)", codec::kMaxZstdLevel));
  }
  if (timeout.count() <= 0) throw InvalidArgument("timeout must be positive");
  if (bf16_delta != kernels::Bf16Delta::exact && bf16_delta != kernels::Bf16Delta::authors) {
    throw InvalidArgument("bf16_delta must be exact or authors");
  }
  if (overlap != Overlap::blocking && overlap != Overlap::delayed && overlap != Overlap::eager) {
    throw InvalidArgument("overlap must be blocking, delayed or eager");
  }
  if (overlap != Overlap::blocking && mode != Mode::pulse) {
    throw InvalidArgument(std::string("overlap ") + std::string(overlap_name(overlap)) +
                          " runs mode pulse; this run is mode " + std::string(mode_name(mode)));
  }
  if (exchange != Exchange::automatic && exchange != Exchange::allgather &&
      exchange != Exchange::reduction) {
    throw InvalidArgument("exchange must be automatic, allgather or reduction");
  }
  if (publish_every < 1) throw InvalidArgument("publish_every must be at least 1");
  if (anchor_every < 1) throw InvalidArgument("anchor_every must be at least 1");
  if (!publish_dir.empty() && mode == Mode::ddp) {
    throw InvalidArgument("publish_dir: mode ddp keeps no θ_g to publish (use pulse or diloco)");
  }
}

nlohmann::json to_json(const EngineOptions& options) {
  // Floats are stored both as decimal (readable) and as raw bits (exact).
  return nlohmann::json{
      {"mode", mode_name(options.mode)},
      {"steps_per_window", options.steps_per_window},
      {"outer_lr", options.outer_lr},
      {"outer_lr_bits", float_to_bits(options.outer_lr)},
      {"outer_momentum", options.outer_momentum},
      {"outer_momentum_bits", float_to_bits(options.outer_momentum)},
      {"chunk_elements", options.chunk_elements},
      {"bucket_elements", options.bucket_elements},
      {"threads", options.threads},
      {"encoding", codec::encoding_name(options.codec.encoding)},
      {"codec_level", options.codec.zstd_level},
      {"timeout_ms", options.timeout.count()},
      {"allgather", collectives::algorithm_name(options.allgather)},
      {"pipeline_chunk_bytes", options.pipeline_chunk_bytes},
      {"bf16_delta", kernels::bf16_delta_name(options.bf16_delta)},
      {"overlap", overlap_name(options.overlap)},
      {"exchange", exchange_name(options.exchange)},
      {"node_aware", options.node_aware},
      {"verify_digests", options.verify_digests},
      {"trace_dir", options.trace_dir},
      {"publish_dir", options.publish_dir},
      {"publish_every", options.publish_every},
      {"anchor_every", options.anchor_every},
  };
}

EngineOptions options_from_json(const nlohmann::json& json) {
  try {
    EngineOptions options;
    options.mode = parse_mode(json.at("mode").get<std::string>());
    options.steps_per_window = json.at("steps_per_window").get<std::uint32_t>();
    options.outer_lr = bits_to_float(json.at("outer_lr_bits").get<std::uint32_t>());
    options.outer_momentum = bits_to_float(json.at("outer_momentum_bits").get<std::uint32_t>());
    options.chunk_elements = json.at("chunk_elements").get<std::uint64_t>();
    options.bucket_elements = json.at("bucket_elements").get<std::uint64_t>();
    options.threads = json.at("threads").get<std::uint32_t>();
    options.codec.encoding = parse_encoding(json.at("encoding").get<std::string>());
    options.codec.zstd_level = json.at("codec_level").get<int>();
    options.timeout = std::chrono::milliseconds(json.at("timeout_ms").get<std::int64_t>());
    options.allgather = parse_allgather(json.at("allgather").get<std::string>());
    // Absent from checkpoints and traces written before the option existed: the default then.
    options.pipeline_chunk_bytes =
        json.value("pipeline_chunk_bytes", EngineOptions{}.pipeline_chunk_bytes);
    // Absent before the option existed: those runs computed Δ as `exact` does.
    options.bf16_delta = kernels::parse_bf16_delta(
        json.value("bf16_delta", std::string(kernels::bf16_delta_name(kernels::Bf16Delta::exact))));
    // Absent before overlapped windows existed: those runs were blocking.
    options.overlap = parse_overlap(json.value("overlap", std::string("blocking")));
    // Absent before the exchange kinds existed: those runs all-gathered (the same bits).
    options.exchange = parse_exchange(json.value("exchange", std::string("automatic")));
    // Absent before node-aware exchanges existed: those runs were flat (the same bits).
    options.node_aware = json.value("node_aware", true);
    options.verify_digests = json.at("verify_digests").get<bool>();
    options.trace_dir = json.at("trace_dir").get<std::string>();
    // Absent before publishing existed: off.
    options.publish_dir = json.value("publish_dir", std::string());
    options.publish_every = json.value("publish_every", EngineOptions{}.publish_every);
    options.anchor_every = json.value("anchor_every", EngineOptions{}.anchor_every);
    options.validate();
    return options;
  } catch (const nlohmann::json::exception& e) {
    throw InvalidArgument(std::string("options JSON: ") + e.what());
  }
}

std::vector<std::string> options_that_change_the_state(const EngineOptions& saved,
                                                       const EngineOptions& now) {
  static constexpr std::string_view kTransportOnly[] = {
      "threads",      "trace_dir",   "timeout_ms",     "allgather",   "pipeline_chunk_bytes",
      "encoding",     "codec_level", "verify_digests", "publish_dir", "publish_every",
      "anchor_every", "exchange",    "node_aware",
  };
  const nlohmann::json a = to_json(saved);
  const nlohmann::json b = to_json(now);
  std::vector<std::string> differing;
  for (const auto& [key, value] : a.items()) {
    if (std::find(std::begin(kTransportOnly), std::end(kTransportOnly), key) !=
        std::end(kTransportOnly))
      continue;
    // A float is stored twice (decimal and raw bits): name it once, by its decimal key.
    if (key.ends_with("_bits") && a.contains(key.substr(0, key.size() - 5))) continue;
    const std::string bits = key + "_bits";
    const bool differs = !b.contains(key) || b.at(key) != value ||
                         (a.contains(bits) && (!b.contains(bits) || b.at(bits) != a.at(bits)));
    if (differs) differing.push_back(key);
  }
  return differing;
}

nlohmann::json shared_options(const EngineOptions& options) {
  nlohmann::json shared = to_json(options);
  shared.erase("threads");
  shared.erase("trace_dir");
  shared.erase("timeout_ms");
  for (const char* key : {"publish_dir", "publish_every", "anchor_every"})
    shared.erase(key);
  return shared;
}

std::uint64_t shared_options_digest(const EngineOptions& options) {
  const std::string text = shared_options(options).dump();
  return digest_bytes(std::as_bytes(std::span(text.data(), text.size())));
}

}  // namespace pulseloco
