#include "payload_generator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/thread_pool.h>
#include <pulseloco/kernels/window_kernels.h>
#include "bench_random.h"

namespace pulseloco::bench {
namespace {

// Standard normals of elements [index, index + count) of one stream (index: within the tensor,
// below 2^32 for every tensor of the models here).
__attribute__((target_clones("avx2", "default"))) void normals(const StreamKeys& keys,
                                                               std::uint32_t index, float* out,
                                                               std::uint64_t count) {
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint32_t idx = index + static_cast<std::uint32_t>(i);
    out[i] = stream_normal(keys, idx);
  }
}

enum Purpose : std::uint64_t { kWeights = 1, kSignal = 2, kNoise = 3, kBatchScale = 4 };

struct StepParams {
  float decay = 1;            // 1 - lr * weight_decay
  float beta1 = 0.9f;         // β1
  float beta2 = 0.95f;        // β2
  float one_minus_beta1 = 0;  // 1 - β1
  float one_minus_beta2 = 0;  // 1 - β2
  float bias2_sqrt = 1;       // sqrt(1 - β2^t)
  float eps = 1e-8f;
  float step_size = 0;   // lr / (1 - β1^t)
  float grad_scale = 0;  // grad_rms * c_rt
  float noise = 0;
  StreamKeys keys;          // the step's noise stream
  std::uint32_t index = 0;  // element index (within the tensor) of the chunk's first element
};

// One AdamW step (PyTorch semantics, foreach=False) over a chunk, the gradient generated on the
// fly. The only loop of the benchmark that touches every element H times per window, written so
// that the compiler vectorises it (32-bit integer hash, no libm calls); built for AVX2 and for
// the baseline ISA, the same bits either way (no contraction, IEEE sqrt and division).
__attribute__((target_clones("avx2", "default"))) void adamw_step(float* local, float* m, float* v,
                                                                  const float* signal_term,
                                                                  std::uint64_t count,
                                                                  const StepParams& p) {
  const StepParams q = p;
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint32_t idx = q.index + static_cast<std::uint32_t>(i);
    const float xi = normal_from(mix32(idx ^ q.keys.a), mix32(idx ^ q.keys.b));
    const float grad = q.grad_scale * (signal_term[i] + q.noise * xi);
    const float decayed = local[i] * q.decay;
    const float mi = q.beta1 * m[i] + q.one_minus_beta1 * grad;
    const float vi = q.beta2 * v[i] + q.one_minus_beta2 * (grad * grad);
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / q.bias2_sqrt + q.eps;
    local[i] = decayed - q.step_size * (mi / denom);
  }
}

struct WorkerChunk {
  std::vector<float> local;
  std::vector<float> residual;
  std::vector<float> adam_m;
  std::vector<float> adam_v;
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
  std::uint64_t fired = 0;
};

struct ChunkScratch {
  std::vector<float> global;
  std::vector<float> outer_m;
  std::vector<float> g;
  std::vector<float> signal_term;
  std::vector<WorkerChunk> workers;

  void resize(std::uint64_t n, int worker_count) {
    for (auto* buffer : {&global, &outer_m, &g, &signal_term})
      buffer->resize(n);
    workers.resize(static_cast<std::size_t>(worker_count));
    for (WorkerChunk& w : workers) {
      for (auto* buffer : {&w.local, &w.residual, &w.adam_m, &w.adam_v, &w.values})
        buffer->resize(n);
      w.offsets.resize(n);
    }
  }
};

struct ChunkRef {
  std::uint32_t tensor = 0;
  std::uint64_t begin = 0;
  std::uint64_t length = 0;
};

void validate(const GeneratorConfig& c) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("payload generator: " + what);
  };
  if (c.tensors.empty()) fail("no tensors");
  if (c.workers < 1) fail("workers must be >= 1");
  if (c.windows < 1) fail("windows must be >= 1");
  if (c.inner_steps < 1) fail("inner_steps (H) must be >= 1");
  if (!(c.lr > 0) || !std::isfinite(c.lr)) fail("lr must be positive and finite");
  if (!(c.grad_rms > 0) || !std::isfinite(c.grad_rms)) fail("grad_rms must be positive");
  if (!(c.weight_std > 0) || !std::isfinite(c.weight_std)) fail("weight_std must be positive");
  if (c.chunk_elements < 1024 || c.chunk_elements > kernels::kMaxChunkElements) {
    fail("chunk_elements must be in [1024, 2^31]");
  }
  for (const ModelTensor& t : c.tensors) {
    if (t.numel() == 0 || t.numel() > (std::uint64_t{1} << 32)) {
      fail("tensor " + t.name + " must have 1..2^32 elements");
    }
  }
}

}  // namespace

EncodedFrame encode_frame_checked(const codec::FrameEntries& entries,
                                  const codec::EncodeOptions& options,
                                  const std::vector<std::uint64_t>& numels, bool verify) {
  const std::vector<std::byte> frame = codec::encode_frame(entries, options);
  EncodedFrame result{frame.size(), 0, 0};
  if (!verify) return result;
  codec::MessageHeader header;
  header.encoding = options.encoding;
  header.tensor_numels = numels;
  std::vector<std::byte> message = codec::encode_header(header, 1);
  message.insert(message.end(), frame.begin(), frame.end());
  const codec::MessageView view = codec::MessageView::parse(message);
  const codec::FrameInfo& info = view.frame(0);
  thread_local codec::DecodeScratch scratch;
  thread_local std::vector<std::uint32_t> offsets;
  thread_local std::vector<float> values;
  offsets.resize(info.entries);
  values.resize(info.entries);
  const std::uint64_t n = view.decode_frame(0, offsets, values, scratch, entries.context);
  const auto where = [&] {
    return "tensor " + std::to_string(entries.tensor) + " chunk at " +
           std::to_string(entries.begin);
  };
  if (n != entries.offsets.size() || info.tensor != entries.tensor || info.begin != entries.begin ||
      info.length != entries.length) {
    throw std::runtime_error("decoded frame differs from the encoded one (" + where() + ")");
  }
  if (!std::equal(offsets.begin(), offsets.begin() + static_cast<std::ptrdiff_t>(n),
                  entries.offsets.begin()) ||
      (n > 0 && std::memcmp(values.data(), entries.values.data(), n * sizeof(float)) != 0)) {
    throw std::runtime_error("decoded entries differ from the encoded ones (" + where() + ")");
  }
  result.index_bytes = info.index_bytes;
  result.value_bytes = info.value_bytes;
  return result;
}

GeneratorResult run_generator(const GeneratorConfig& config) {
  validate(config);
  const auto start = std::chrono::steady_clock::now();
  const auto windows = static_cast<std::size_t>(config.windows);
  const auto workers = static_cast<std::size_t>(config.workers);

  std::vector<std::uint64_t> numels;
  std::vector<ChunkRef> chunks;
  for (std::size_t t = 0; t < config.tensors.size(); ++t) {
    const std::uint64_t numel = config.tensors[t].numel();
    numels.push_back(numel);
    for (std::uint64_t begin = 0; begin < numel; begin += config.chunk_elements) {
      chunks.push_back(
          {static_cast<std::uint32_t>(t), begin, std::min(config.chunk_elements, numel - begin)});
    }
  }

  // Per-step scalars: the batch-scale factor c_rt of every worker and inner step.
  const std::size_t total_steps = windows * static_cast<std::size_t>(config.inner_steps);
  std::vector<std::vector<float>> batch_scale(workers, std::vector<float>(total_steps));
  for (std::size_t r = 0; r < workers; ++r) {
    for (std::size_t s = 0; s < total_steps; ++s) {
      const StreamKeys k = stream_keys(config.seed, 0, kBatchScale, s, r);
      batch_scale[r][s] = std::exp(config.batch_scale_sigma * normal_from(k.a, k.b));
    }
  }
  // Stationary moments of c (log-normal): E[c] = exp(σ²/2), E[c²] = exp(2σ²).
  const double sigma = config.batch_scale_sigma;
  const auto mean_c = static_cast<float>(std::exp(sigma * sigma / 2));
  const auto mean_c2 = static_cast<float>(std::exp(2 * sigma * sigma));

  // [chunk][window][worker]
  std::vector<EncodedFrame> frames(chunks.size() * windows * workers);
  std::vector<std::uint64_t> fired(chunks.size() * windows * workers);
  std::vector<EntropyEstimate> entropy(config.estimate_entropy ? frames.size() : 0);

  ThreadPool pool(config.threads);
  pool.parallel_for(chunks.size(), [&](std::size_t c) {
    const ChunkRef& chunk = chunks[c];
    const ModelTensor& tensor = config.tensors[chunk.tensor];
    const std::uint64_t n = chunk.length;
    const auto index = static_cast<std::uint32_t>(chunk.begin);
    thread_local ChunkScratch s;
    s.resize(n, config.workers);

    // Initial weights on the bf16 grid, the persistent gradient direction, the optimizer state.
    if (tensor.kind == TensorKind::norm) {
      std::fill_n(s.global.begin(), n, round_to_bf16(config.norm_weight));
    } else {
      normals(stream_keys(config.seed, chunk.tensor, kWeights), index, s.global.data(), n);
      for (std::uint64_t i = 0; i < n; ++i)
        s.global[i] = round_to_bf16(config.weight_std * s.global[i]);
    }
    const auto report_global = [&](int windows_done) {
      if (config.on_global_weights)
        config.on_global_weights(chunk.tensor, chunk.begin, windows_done,
                                 std::span(s.global.data(), n));
    };
    report_global(0);
    normals(stream_keys(config.seed, chunk.tensor, kSignal), index, s.signal_term.data(), n);
    for (std::uint64_t i = 0; i < n; ++i)
      s.signal_term[i] = config.signal * s.signal_term[i];
    for (WorkerChunk& w : s.workers) {
      std::copy_n(s.global.begin(), n, w.local.begin());
      std::fill_n(w.residual.begin(), n, 0.0f);
      if (config.warm_optimizer) {
        const float noise_var = config.noise * config.noise;
        for (std::uint64_t i = 0; i < n; ++i) {
          const float mean = config.grad_rms * mean_c * s.signal_term[i];
          w.adam_m[i] = mean;
          w.adam_v[i] = config.grad_rms * config.grad_rms * mean_c2 *
                        (s.signal_term[i] * s.signal_term[i] + noise_var);
        }
      } else {
        std::fill_n(w.adam_m.begin(), n, 0.0f);
        std::fill_n(w.adam_v.begin(), n, 0.0f);
      }
    }

    for (std::size_t window = 0; window < windows; ++window) {
      for (std::size_t r = 0; r < workers; ++r) {
        WorkerChunk& w = s.workers[r];
        // The H steps of this window, applied block by block (every step is element-wise, so
        // the order is free): a block stays in cache for all H steps instead of streaming the
        // chunk's optimizer state through memory H times.
        std::vector<StepParams> steps(static_cast<std::size_t>(config.inner_steps));
        for (int h = 0; h < config.inner_steps; ++h) {
          const std::size_t step =
              window * static_cast<std::size_t>(config.inner_steps) + static_cast<std::size_t>(h);
          StepParams& p = steps[static_cast<std::size_t>(h)];
          p.decay = 1.0f - config.lr * config.weight_decay;
          p.beta1 = config.beta1;
          p.beta2 = config.beta2;
          p.one_minus_beta1 = 1.0f - config.beta1;
          p.one_minus_beta2 = 1.0f - config.beta2;
          p.eps = config.eps;
          if (config.warm_optimizer) {
            p.bias2_sqrt = 1.0f;
            p.step_size = config.lr;
          } else {
            const auto t = static_cast<double>(step + 1);
            p.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(config.beta2, t)));
            p.step_size = config.lr /
                          static_cast<float>(1.0 - std::pow(static_cast<double>(config.beta1), t));
          }
          p.grad_scale = config.grad_rms * batch_scale[r][step];
          p.noise = config.noise;
          p.keys = stream_keys(config.seed, chunk.tensor, kNoise, step, r);
        }
        constexpr std::uint64_t kBlock = 4096;
        for (std::uint64_t at = 0; at < n; at += kBlock) {
          const std::uint64_t count = std::min(kBlock, n - at);
          for (StepParams& p : steps) {
            p.index = index + static_cast<std::uint32_t>(at);
            adamw_step(w.local.data() + at, w.adam_m.data() + at, w.adam_v.data() + at,
                       s.signal_term.data() + at, count, p);
          }
        }
        const kernels::GateChunk gate_chunk{.global = s.global.data(),
                                            .local = w.local.data(),
                                            .local_dtype = DType::float32,
                                            .residual = w.residual.data(),
                                            .count = n};
        const kernels::GateResult result =
            kernels::gate(gate_chunk, w.offsets.data(), w.values.data());
        if (result.non_finite_offset) {
          throw std::runtime_error("payload generator diverged in " + tensor.name);
        }
        w.fired = result.fired;
        const codec::FrameEntries entries{.tensor = chunk.tensor,
                                          .begin = chunk.begin,
                                          .length = n,
                                          .offsets = std::span(w.offsets.data(), w.fired),
                                          .values = std::span(w.values.data(), w.fired),
                                          .context = std::span(s.global.data(), n)};
        const std::size_t slot = (c * windows + window) * workers + r;
        frames[slot] = encode_frame_checked(entries, config.codec, numels, config.verify_decode);
        if (config.estimate_entropy)
          entropy[slot] = estimate_entropy(entries.offsets, entries.values, entries.context);
        fired[slot] = w.fired;
        kernels::commit_residual(gate_chunk, w.residual.data());
      }
      // The last window's outer step changes no message: only θ_g's observer needs it.
      if (window + 1 == windows && !config.on_global_weights) break;
      std::vector<kernels::SparseEntries> per_rank;
      for (const WorkerChunk& w : s.workers) {
        per_rank.push_back(
            {std::span(w.offsets.data(), w.fired), std::span(w.values.data(), w.fired)});
      }
      kernels::aggregate(per_rank, s.g.data(), n);
      kernels::outer_step(
          s.global.data(), s.outer_m.data(), s.g.data(), s.workers[0].local.data(), DType::float32,
          n, {.lr = config.outer_lr, .momentum = config.outer_momentum, .first_step = window == 0});
      for (std::size_t r = 1; r < workers; ++r)
        std::copy_n(s.workers[0].local.begin(), n, s.workers[r].local.begin());
      report_global(static_cast<int>(window) + 1);
    }
  });

  GeneratorResult result;
  for (std::uint64_t numel : numels)
    result.parameters += numel;
  codec::MessageHeader header;
  header.encoding = config.codec.encoding;
  header.tensor_numels = numels;
  result.header_bytes =
      codec::encode_header(header, static_cast<std::uint32_t>(chunks.size())).size();
  result.messages.assign(windows, std::vector<WorkerMessage>(workers));
  for (std::size_t c = 0; c < chunks.size(); ++c) {
    for (std::size_t window = 0; window < windows; ++window) {
      for (std::size_t r = 0; r < workers; ++r) {
        const std::size_t slot = (c * windows + window) * workers + r;
        WorkerMessage& m = result.messages[window][r];
        m.entries += fired[slot];
        m.ours_bytes += frames[slot].bytes;
        m.index_bytes += frames[slot].index_bytes;
        m.value_bytes += frames[slot].value_bytes;
        if (config.estimate_entropy) m.entropy += entropy[slot];
        ++m.frames;
      }
    }
  }
  for (auto& window : result.messages) {
    for (WorkerMessage& m : window)
      m.ours_bytes += result.header_bytes;
  }
  result.decode_verified = config.verify_decode;
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace pulseloco::bench
