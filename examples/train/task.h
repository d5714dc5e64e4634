// The example's training data: a synthetic "language" of small algorithmic tasks, generated on
// the fly (no downloads), deterministic per (seed, worker rank, step).
//
// Every example is   BOS TASK x1 .. xn SEP y1 .. ym EOS
// where TASK names the sub-task, x is its input and y its answer. The loss counts only the
// answer tokens y1..ym and EOS (the prompt is given, as in supervised fine-tuning or RL on
// completions), so a model that has solved a sub-task drives its part of the loss to zero.
//
// Sub-tasks (inputs over an alphabet of kAlphabet symbols unless stated):
//   count      x = (a), y = a+1, a+2, ..., a+n (mod kAlphabet): a local rule, learned first
//   copy       y = x
//   reverse    y = x reversed
//   sort       y = x sorted ascending
//   mod_add    x = (a, b) with a, b < kModulus, y = (a + b) mod kModulus (one token): a table
//              of kModulus^2 facts, memorised slowly
//
// Pretraining sees every sub-task equally often with inputs of 3 to 10 symbols; in its short
// budget (a few hundred steps) it learns the format, count and part of the others. Post-training
// (the RL-like phase, lr 1e-6..3e-6) shifts the distribution towards the harder sub-tasks
// (reverse, sort, mod_add) and to inputs of 3 to 12 symbols: the pretrained model has partly,
// not fully, learned it, so the loss keeps falling slowly instead of being flat.
//
// Examples are packed into rows of `context` tokens (several per row, the rest padded).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pulseloco::example {

// Token ids.
inline constexpr std::int64_t kPadToken = 0;
inline constexpr std::int64_t kBosToken = 1;
inline constexpr std::int64_t kSepToken = 2;
inline constexpr std::int64_t kEosToken = 3;
inline constexpr std::int64_t kFirstTaskToken = 8;     // 8 + SubTask
inline constexpr std::int64_t kFirstSymbolToken = 16;  // symbol v is token 16 + v
inline constexpr int kAlphabet = 16;                   // symbols of count/copy/reverse/sort
inline constexpr int kModulus = 23;                    // mod_add works on 0..22
// The smallest vocabulary that holds every token the task emits.
inline constexpr int kMinVocabulary = static_cast<int>(kFirstSymbolToken) + kModulus;
// Targets that do not count in the loss (PyTorch's default ignore_index).
inline constexpr std::int64_t kIgnoreTarget = -100;

enum class SubTask : std::uint8_t { count, copy, reverse, sort, mod_add };
inline constexpr std::size_t kSubTaskCount = 5;
[[nodiscard]] const char* sub_task_name(SubTask task) noexcept;

// A distribution over sub-tasks and input lengths.
struct TaskMix {
  std::string name;
  std::array<double, kSubTaskCount> weights{};  // relative; need not sum to 1
  int min_length = 3;                           // symbols of x (copy/reverse/sort), of y (count)
  int max_length = 10;

  // Throws InvalidArgument when the weights are negative/all zero or the lengths do not fit
  // a context of `context` tokens.
  void validate(int context) const;
  // Canonical text of the mix (for cache metadata: a changed mix must not reuse a cache).
  [[nodiscard]] std::string describe() const;
};

[[nodiscard]] TaskMix pretraining_mix();
[[nodiscard]] TaskMix post_training_mix();

// A batch of packed rows: inputs and next-token targets, row-major [batch_size, context].
struct Batch {
  int batch_size = 0;
  int context = 0;
  std::vector<std::int64_t> inputs;
  std::vector<std::int64_t> targets;  // kIgnoreTarget where the loss does not count

  [[nodiscard]] std::size_t counted_targets() const noexcept;
};

// Where a batch's randomness comes from. Streams never overlap: training data of every
// (rank, step) and the held-out evaluation data are disjoint random streams of one seed.
enum class DataStream : std::uint32_t { train = 1, eval = 2 };

// The batch worker `rank` trains on at `step`. Same arguments -> identical batch, on any
// machine; different ranks or steps -> independent data.
[[nodiscard]] Batch make_batch(const TaskMix& mix, std::uint64_t seed, int rank, std::uint64_t step,
                               int batch_size, int context);

// The fixed held-out batch for evaluation loss (never used for training).
[[nodiscard]] Batch make_eval_batch(const TaskMix& mix, std::uint64_t seed, int batch_size,
                                    int context);

// Counter-based random numbers (SplitMix64): the generator of every random choice of the
// example (data and initial weights), independent of libtorch's global generator.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t state) noexcept : state_(state) {}
  [[nodiscard]] std::uint64_t next() noexcept;
  // Uniform in [0, bound) (bound > 0), without modulo bias.
  [[nodiscard]] std::uint64_t below(std::uint64_t bound) noexcept;
  // Uniform in (0, 1).
  [[nodiscard]] double uniform_open() noexcept;
  // Standard normal (Box-Muller).
  [[nodiscard]] double normal() noexcept;

 private:
  std::uint64_t state_;
};

// Mixes several words into one seed (order matters).
[[nodiscard]] std::uint64_t mix_seed(std::initializer_list<std::uint64_t> words) noexcept;

}  // namespace pulseloco::example
