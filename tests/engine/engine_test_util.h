// Helpers for engine tests: a scalar reference of the window written straight from
// docs/algorithm.md, simulated local training, and running R engines over an in-process group.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include <pulseloco/base/bf16.h>
#include <pulseloco/engine/engine.h>
#include <pulseloco/transport/inproc/inproc.h>

namespace pulseloco {

// Parameterised tests print their parameters by name (dtype_name, mode_name), not as bytes.
inline void PrintTo(DType dtype, std::ostream* out) {
  *out << dtype_name(dtype);
}
inline void PrintTo(Mode mode, std::ostream* out) {
  *out << mode_name(mode);
}

}  // namespace pulseloco

namespace pulseloco::testing {

// One tensor of one rank's model, owned by the test (the engine sees a view).
struct LocalTensor {
  std::string name;
  DType dtype = DType::float32;
  std::vector<float> f32;           // used when dtype == float32
  std::vector<std::uint16_t> bf16;  // used when dtype == bfloat16

  [[nodiscard]] std::uint64_t numel() const {
    return dtype == DType::float32 ? f32.size() : bf16.size();
  }
  [[nodiscard]] float get(std::size_t i) const {
    return dtype == DType::float32 ? f32[i] : bf16_bits_to_float(bf16[i]);
  }
  void set_from_global(std::size_t i, float global) {
    if (dtype == DType::float32) {
      f32[i] = global;
    } else {
      bf16[i] = float_to_bf16_bits(global);
    }
  }
  [[nodiscard]] TensorView view() {
    return dtype == DType::float32
               ? TensorView{f32.data(), f32.size(), DType::float32, Device{}}
               : TensorView{bf16.data(), bf16.size(), DType::bfloat16, Device{}};
  }
};

using LocalModel = std::vector<LocalTensor>;

// Small windows that still cover several chunks per tensor and several all-reduce buckets.
inline EngineOptions small_options(Mode mode = Mode::pulse) {
  EngineOptions options;
  options.mode = mode;
  options.steps_per_window = 4;
  options.chunk_elements = 1024;
  options.bucket_elements = 4096;
  options.threads = 2;
  options.timeout = std::chrono::milliseconds(20'000);
  return options;
}

// A model with the given sizes; values ~ N(0, 0.02), rounded to bf16 (pretrained weights).
inline LocalModel make_model(const std::vector<std::uint64_t>& sizes, DType dtype,
                             std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  LocalModel model;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    LocalTensor tensor{"tensor" + std::to_string(t), dtype, {}, {}};
    for (std::uint64_t i = 0; i < sizes[t]; ++i) {
      const float w = round_to_bf16(normal(rng));
      if (dtype == DType::float32) {
        tensor.f32.push_back(w);
      } else {
        tensor.bf16.push_back(float_to_bf16_bits(w));
      }
    }
    model.push_back(std::move(tensor));
  }
  return model;
}

inline std::vector<NamedTensor> views_of(LocalModel& model) {
  std::vector<NamedTensor> views;
  for (auto& t : model)
    views.push_back({t.name, t.view(), {}});
  return views;
}

// H steps of an AdamW-like local update: each element moves by ~lr * U(0.2, 1.8) with a random
// sign per step (seeded by rank and window, so ranks differ).
inline void local_training(LocalModel& model, float lr, int steps, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> magnitude(0.2f, 1.8f);
  std::bernoulli_distribution sign(0.5);
  for (auto& tensor : model) {
    for (std::size_t i = 0; i < tensor.numel(); ++i) {
      float w = tensor.get(i);
      for (int s = 0; s < steps; ++s) {
        const float step = lr * magnitude(rng);
        w = sign(rng) ? w - step : w + step;
      }
      if (tensor.dtype == DType::float32) {
        tensor.f32[i] = w;
      } else {
        tensor.bf16[i] = float_to_bf16_bits(w);
      }
    }
  }
}

// The replicated and per-rank state as the reference tracks it.
struct ReferenceState {
  std::vector<std::vector<float>> global;                 // per tensor
  std::vector<std::vector<float>> momentum;               // per tensor
  std::vector<std::vector<std::vector<float>>> residual;  // per rank, per tensor
  bool momentum_initialised = false;
};

inline ReferenceState reference_start(const LocalModel& rank0, int world) {
  ReferenceState state;
  for (const auto& t : rank0) {
    std::vector<float> g(t.numel());
    for (std::size_t i = 0; i < g.size(); ++i)
      g[i] = t.get(i);
    state.global.push_back(g);
    state.momentum.emplace_back(t.numel(), 0.0f);
  }
  state.residual.resize(static_cast<std::size_t>(world));
  for (auto& per_rank : state.residual) {
    for (const auto& t : rank0)
      per_rank.emplace_back(t.numel(), 0.0f);
  }
  return state;
}

// Step 8 on one element: the momentum (set to g by the first outer step) and the Nesterov
// update of θ_g, with the two fused multiply-adds docs/algorithm.md prescribes.
inline void reference_outer_step(float& global, float& momentum, float g, bool initialised,
                                 float lr, float mu) {
  if (initialised) {
    const float product = mu * momentum;
    momentum = product + g;
  } else {
    momentum = g;
  }
  const float d = std::fma(mu, momentum, g);
  global = std::fma(-lr, d, global);
}

// One window, steps 1-9, exactly as docs/algorithm.md states them; updates `models` (θ_l).
// `bf16_delta` chooses step 1 for bf16 local weights: exact sees θ_g through the bf16 cast, the
// authors' code takes θ_g itself.
inline void reference_window(ReferenceState& state, std::vector<LocalModel>& models, float lr,
                             float mu, kernels::Bf16Delta bf16_delta = kernels::Bf16Delta::exact) {
  const std::size_t world = models.size();
  for (std::size_t t = 0; t < state.global.size(); ++t) {
    const std::size_t n = state.global[t].size();
    std::vector<float> sum(n, 0.0f);
    for (std::size_t r = 0; r < world; ++r) {
      const LocalTensor& local = models[r][t];
      std::vector<float>& e = state.residual[r][t];
      for (std::size_t i = 0; i < n; ++i) {
        const float global = state.global[t][i];
        const bool through_cast =
            local.dtype == DType::bfloat16 && bf16_delta == kernels::Bf16Delta::exact;
        const float seen_global = through_cast ? round_to_bf16(global) : global;
        const float delta = seen_global - local.get(i);  // step 1
        const float s = e[i] + delta;                    // step 2
        const float corrected = global - s;              // step 3
        const bool fire = !bf16_numeric_equal(float_to_bf16_bits(global),
                                              float_to_bf16_bits(corrected));  // step 4
        if (fire) {                                                            // step 5
          sum[i] = sum[i] + s;                                                 // step 7, rank order
          e[i] = 0.0f;
        } else {
          e[i] = s;
        }
      }
    }
    const auto divisor = static_cast<float>(world);
    for (std::size_t i = 0; i < n; ++i) {
      reference_outer_step(state.global[t][i], state.momentum[t][i], sum[i] / divisor,
                           state.momentum_initialised, lr, mu);
    }
    for (std::size_t r = 0; r < world; ++r) {  // step 9
      for (std::size_t i = 0; i < n; ++i)
        models[r][t].set_from_global(i, state.global[t][i]);
    }
  }
  state.momentum_initialised = true;
}

// The tag layout of collectives/detail/packets.h: the call's sequence number sits in bits 8-39 and
// the phase in the low byte (2 = the completion/failure notices).
inline std::uint64_t call_sequence(transport::Tag tag) {
  return (tag >> 8) & 0xFFFF'FFFFull;
}
inline constexpr transport::Tag kNoticePhase = 2;

// A fault hook that records the sequence number of every collective call whose messages pass.
class CallSequences {
 public:
  // The hook shares what it records: an engine's background exchange may still call it after
  // this object is gone (a test's scope ends before the engines it watches are destroyed).
  [[nodiscard]] transport::inproc::FaultHook hook() {
    return [seen = seen_](const transport::inproc::MessageEvent& m) {
      const std::lock_guard lock(seen->mutex);
      seen->sequences.insert(call_sequence(m.tag));
      return transport::inproc::FaultAction::deliver;
    };
  }
  // In ascending order: the order of the calls.
  [[nodiscard]] std::vector<std::uint64_t> seen() const {
    const std::lock_guard lock(seen_->mutex);
    return {seen_->sequences.begin(), seen_->sequences.end()};
  }

 private:
  struct Seen {
    std::mutex mutex;
    std::set<std::uint64_t> sequences;
  };
  std::shared_ptr<Seen> seen_ = std::make_shared<Seen>();
};

// A fault hook that drops rank `from`'s first completion notice to rank `to` of collective call
// `sequence` (a vote: `to` then never learns its outcome), and sets `dropped`, which must outlive
// the transports that call the hook.
inline transport::inproc::FaultHook drop_notice(int from, int to, std::uint64_t sequence,
                                                std::atomic<bool>& dropped) {
  return [=, &dropped](const transport::inproc::MessageEvent& m) {
    if (m.from == from && m.to == to && (m.tag & 0xFF) == kNoticePhase &&
        call_sequence(m.tag) == sequence && !dropped.exchange(true)) {
      return transport::inproc::FaultAction::drop;
    }
    return transport::inproc::FaultAction::deliver;
  };
}

// Runs fn(rank) on `world` threads and rethrows the lowest rank's exception, if any.
inline std::vector<std::exception_ptr> run_ranks(int world, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads)
    thread.join();
  return errors;
}

// An empty directory for this test process: temp/pulseloco_<name>_<pid> (removed first).
inline std::filesystem::path fresh_test_dir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("pulseloco_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

// A file's bytes (byte-for-byte comparisons of checkpoints and traces).
inline std::string file_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Sets an environment variable for the guard's lifetime.
class ScopedVariable {
 public:
  ScopedVariable(const char* name, const char* value) : name_(name) { ::setenv(name, value, 1); }
  ~ScopedVariable() { ::unsetenv(name_); }
  ScopedVariable(const ScopedVariable&) = delete;
  ScopedVariable& operator=(const ScopedVariable&) = delete;

 private:
  const char* name_;
};

inline void rethrow_first(const std::vector<std::exception_ptr>& errors) {
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

// `models.size()` engines over one in-process group, each over its model (collective start-up).
inline std::vector<std::unique_ptr<Engine>> start_engines(
    std::vector<LocalModel>& models, const EngineOptions& options,
    transport::inproc::InprocOptions inproc = {}) {
  const int world = static_cast<int>(models.size());
  auto transports = transport::inproc::make_group(world, std::move(inproc));
  std::vector<std::unique_ptr<Engine>> engines(models.size());
  rethrow_first(run_ranks(world, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    engines[i] = std::make_unique<Engine>(views_of(models[i]), options, std::move(transports[i]));
  }));
  return engines;
}

}  // namespace pulseloco::testing
