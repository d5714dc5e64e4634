#include "task.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include <pulseloco/base/errors.h>

namespace pulseloco::example {
namespace {

// The longest example a mix can produce: BOS TASK x SEP y EOS.
int longest_example(const TaskMix& mix) {
  const int sequence = 2 + mix.max_length + 1 + mix.max_length + 1;
  const int modular = 2 + 2 + 1 + 1 + 1;
  return std::max(sequence, modular);
}

SubTask draw_sub_task(const TaskMix& mix, SplitMix64& rng) {
  double total = 0;
  for (double w : mix.weights)
    total += w;
  double point = rng.uniform_open() * total;
  for (std::size_t i = 0; i < kSubTaskCount; ++i) {
    if (mix.weights[i] <= 0) continue;
    if (point < mix.weights[i]) return static_cast<SubTask>(i);
    point -= mix.weights[i];
  }
  // Rounding left the point past the end: the last sub-task with weight.
  for (std::size_t i = kSubTaskCount; i-- > 0;) {
    if (mix.weights[i] > 0) return static_cast<SubTask>(i);
  }
  PULSELOCO_CHECK(false, "validated mix has a positive weight");
  return SubTask::copy;
}

// Appends one example; answer positions are marked in `answer` (true = counts in the loss).
void append_example(const TaskMix& mix, SplitMix64& rng, std::vector<std::int64_t>& tokens,
                    std::vector<bool>& answer) {
  const SubTask task = draw_sub_task(mix, rng);
  auto push = [&](std::int64_t token, bool is_answer) {
    tokens.push_back(token);
    answer.push_back(is_answer);
  };
  push(kBosToken, false);
  push(kFirstTaskToken + static_cast<std::int64_t>(task), false);
  std::vector<std::int64_t> x;
  std::vector<std::int64_t> y;
  const auto length = static_cast<int>(
      mix.min_length + static_cast<int>(rng.below(mix.max_length - mix.min_length + 1)));
  switch (task) {
    case SubTask::count: {
      const auto start = static_cast<std::int64_t>(rng.below(kAlphabet));
      x = {start};
      for (int i = 1; i <= length; ++i)
        y.push_back((start + i) % kAlphabet);
      break;
    }
    case SubTask::mod_add: {
      const auto a = static_cast<std::int64_t>(rng.below(kModulus));
      const auto b = static_cast<std::int64_t>(rng.below(kModulus));
      x = {a, b};
      y = {(a + b) % kModulus};
      break;
    }
    case SubTask::copy:
    case SubTask::reverse:
    case SubTask::sort:
      x.resize(static_cast<std::size_t>(length));
      for (auto& v : x)
        v = static_cast<std::int64_t>(rng.below(kAlphabet));
      y = x;
      if (task == SubTask::reverse) std::reverse(y.begin(), y.end());
      if (task == SubTask::sort) std::sort(y.begin(), y.end());
      break;
  }
  for (auto v : x)
    push(kFirstSymbolToken + v, false);
  push(kSepToken, false);
  for (auto v : y)
    push(kFirstSymbolToken + v, true);
  push(kEosToken, true);
}

Batch generate(const TaskMix& mix, std::uint64_t stream_seed, int batch_size, int context) {
  if (batch_size <= 0)
    throw InvalidArgument(fmt::format("batch size {} must be positive", batch_size));
  mix.validate(context);
  Batch batch;
  batch.batch_size = batch_size;
  batch.context = context;
  batch.inputs.assign(static_cast<std::size_t>(batch_size) * context, kPadToken);
  batch.targets.assign(batch.inputs.size(), kIgnoreTarget);
  for (int row = 0; row < batch_size; ++row) {
    SplitMix64 rng(mix_seed({stream_seed, static_cast<std::uint64_t>(row)}));
    // context + 1 tokens: inputs are tokens[0..T), targets tokens[1..T].
    std::vector<std::int64_t> tokens;
    std::vector<bool> answer;
    while (true) {
      std::vector<std::int64_t> example;
      std::vector<bool> example_answer;
      append_example(mix, rng, example, example_answer);
      if (tokens.size() + example.size() > static_cast<std::size_t>(context) + 1) break;
      tokens.insert(tokens.end(), example.begin(), example.end());
      answer.insert(answer.end(), example_answer.begin(), example_answer.end());
    }
    const std::size_t base = static_cast<std::size_t>(row) * context;
    for (std::size_t t = 0; t < static_cast<std::size_t>(context); ++t) {
      if (t < tokens.size()) batch.inputs[base + t] = tokens[t];
      if (t + 1 < tokens.size() && answer[t + 1]) batch.targets[base + t] = tokens[t + 1];
    }
  }
  return batch;
}

}  // namespace

const char* sub_task_name(SubTask task) noexcept {
  switch (task) {
    case SubTask::count:
      return "count";
    case SubTask::copy:
      return "copy";
    case SubTask::reverse:
      return "reverse";
    case SubTask::sort:
      return "sort";
    case SubTask::mod_add:
      return "mod_add";
  }
  return "?";
}

void TaskMix::validate(int context) const {
  double total = 0;
  for (double w : weights) {
    if (!(w >= 0) || !std::isfinite(w)) {
      throw InvalidArgument(fmt::format("task mix '{}': weights must be finite and >= 0", name));
    }
    total += w;
  }
  if (total <= 0) throw InvalidArgument(fmt::format("task mix '{}': all weights are zero", name));
  if (min_length < 1 || max_length < min_length) {
    throw InvalidArgument(fmt::format("task mix '{}': lengths [{}, {}] are not a valid range", name,
                                      min_length, max_length));
  }
  if (longest_example(*this) > context + 1) {
    throw InvalidArgument(
        fmt::format("task mix '{}': examples of up to {} tokens do not fit a context of {} tokens",
                    name, longest_example(*this), context));
  }
}

std::string TaskMix::describe() const {
  std::string text = fmt::format("{}:len={}..{}", name, min_length, max_length);
  for (std::size_t i = 0; i < kSubTaskCount; ++i) {
    text += fmt::format(",{}={}", sub_task_name(static_cast<SubTask>(i)), weights[i]);
  }
  return text;
}

TaskMix pretraining_mix() {
  TaskMix mix;
  mix.name = "pretrain";
  mix.weights = {1.0, 1.0, 1.0, 1.0, 1.0};  // count, copy, reverse, sort, mod_add
  mix.min_length = 3;
  mix.max_length = 10;
  return mix;
}

TaskMix post_training_mix() {
  TaskMix mix;
  mix.name = "posttrain";
  mix.weights = {0.5, 0.5, 1.5, 2.0, 1.5};  // count, copy, reverse, sort, mod_add
  mix.min_length = 3;
  mix.max_length = 12;
  return mix;
}

std::size_t Batch::counted_targets() const noexcept {
  return static_cast<std::size_t>(std::count_if(targets.begin(), targets.end(),
                                                [](std::int64_t t) { return t != kIgnoreTarget; }));
}

Batch make_batch(const TaskMix& mix, std::uint64_t seed, int rank, std::uint64_t step,
                 int batch_size, int context) {
  if (rank < 0) throw InvalidArgument(fmt::format("rank {} must be >= 0", rank));
  return generate(mix,
                  mix_seed({seed, static_cast<std::uint64_t>(DataStream::train),
                            static_cast<std::uint64_t>(rank), step}),
                  batch_size, context);
}

Batch make_eval_batch(const TaskMix& mix, std::uint64_t seed, int batch_size, int context) {
  return generate(mix, mix_seed({seed, static_cast<std::uint64_t>(DataStream::eval)}), batch_size,
                  context);
}

std::uint64_t SplitMix64::next() noexcept {
  state_ += 0x9E3779B97F4A7C15ull;
  std::uint64_t z = state_;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

std::uint64_t SplitMix64::below(std::uint64_t bound) noexcept {
  // Reject the lowest (2^64 mod bound) values so every residue is equally likely.
  const std::uint64_t threshold = (0 - bound) % bound;
  while (true) {
    const std::uint64_t value = next();
    if (value >= threshold) return value % bound;
  }
}

double SplitMix64::uniform_open() noexcept {
  // 53 random bits, shifted by half a step so neither 0 nor 1 occurs.
  return (static_cast<double>(next() >> 11) + 0.5) * 0x1.0p-53;
}

double SplitMix64::normal() noexcept {
  const double u1 = uniform_open();
  const double u2 = uniform_open();
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

std::uint64_t mix_seed(std::initializer_list<std::uint64_t> words) noexcept {
  std::uint64_t state = 0x5EED5EED5EED5EEDull;
  for (const std::uint64_t word : words) {
    SplitMix64 rng(state ^ word);
    state = rng.next() + 0x632BE59BD9B4E019ull * (state | 1);
  }
  return SplitMix64(state).next();
}

}  // namespace pulseloco::example
