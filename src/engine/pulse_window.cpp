#include <pulseloco/engine/pulse_window.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/trace.h>

namespace pulseloco::engine_detail {
namespace {

// The largest message any rank of this model can send: the bound on a peer's announced size.
std::uint64_t largest_message_bytes(const Layout& layout) {
  std::uint64_t bytes = codec::max_encoded_header_bytes(layout.tensors().size());
  for (const ChunkRef& chunk : layout.chunks())
    bytes += codec::max_encoded_frame_bytes(chunk.length);
  return bytes;
}

}  // namespace

void PulseWindow::run(const AttachedGroup& group, WindowReport& report) {
  group.reached(WindowPhase::gate, report.window);
  auto phase = SteadyClock::now();
  const OutgoingMessage message = gate_and_encode(group.rank(), report.window, options_.codec);
  if (!options_.trace_dir.empty()) {
    write_trace_message(options_, group.rank(), message.window, message.bytes);
  }
  report.seconds.gate = seconds_since(phase);
  report.entries_sent = message.entries;
  report.payload_bytes = message.bytes.size();
  report.density = density_of(report);

  phase = SteadyClock::now();
  const double waited_before = collectives::header_wait_seconds();
  const ReceivedMessages received = exchange(group, message);
  report.received_bytes = received.received_bytes;
  vote(group, received);
  report.seconds.exchange = seconds_since(phase);
  report.seconds.exchange_wait = collectives::header_wait_seconds() - waited_before;
  group.reached(WindowPhase::aggregate, received.window);

  phase = SteadyClock::now();
  set_overlap(report, apply(received));
  report.seconds.apply = seconds_since(phase);
}

OutgoingMessage PulseWindow::gate_and_encode(int rank, std::uint64_t window,
                                             const codec::EncodeOptions& coding) {
  const auto& chunks = state_.layout().chunks();
  std::vector<std::vector<std::byte>> frames(chunks.size());
  std::vector<std::uint64_t> fired(chunks.size(), 0);
  state_.begin_gate();
  pool_.parallel_for(chunks.size(), [&](std::size_t c) {
    const ChunkRef& chunk = chunks[c];
    auto scratch = gate_scratch_.acquire();
    scratch->offsets.resize(chunk.length);
    scratch->values.resize(chunk.length);
    const kernels::GateResult result =
        state_.gate(chunk, scratch->offsets.data(), scratch->values.data());
    if (result.non_finite_offset) throw_non_finite(state_, rank, chunk, *result.non_finite_offset);
    fired[c] = result.fired;
    const codec::FrameEntries entries_view{
        .tensor = chunk.tensor,
        .begin = chunk.begin,
        .length = chunk.length,
        .offsets = std::span(scratch->offsets.data(), result.fired),
        .values = std::span(scratch->values.data(), result.fired),
        .context = coding.encoding == codec::Encoding::context ? context_of(chunk, scratch->context)
                                                               : std::span<const float>(),
    };
    frames[c] = codec::encode_frame(entries_view, coding);
  });

  return assemble_message(rank, window, coding.encoding, frames, fired);
}

OutgoingMessage PulseWindow::encode_against_global(const OutgoingMessage& message) {
  const auto& chunks = state_.layout().chunks();
  const codec::MessageView view = codec::MessageView::parse(message.bytes, decode_limits());
  std::vector<std::vector<std::byte>> frames(chunks.size());
  std::vector<std::uint64_t> fired(chunks.size(), 0);
  pool_.parallel_for(chunks.size(), [&](std::size_t c) {
    const ChunkRef& chunk = chunks[c];
    auto scratch = apply_scratch_.acquire();
    fired[c] = view.frame(c).entries;
    scratch->offsets.resize(fired[c]);
    scratch->values.resize(fired[c]);
    (void)view.decode_frame(c, scratch->offsets, scratch->values, scratch->decode);
    frames[c] = codec::encode_frame({.tensor = chunk.tensor,
                                     .begin = chunk.begin,
                                     .length = chunk.length,
                                     .offsets = scratch->offsets,
                                     .values = scratch->values,
                                     .context = context_of(chunk, scratch->context)},
                                    options_.codec);
  });
  return assemble_message(static_cast<int>(view.header().sender_rank), message.window,
                          options_.codec.encoding, frames, fired);
}

OutgoingMessage PulseWindow::assemble_message(int rank, std::uint64_t window,
                                              codec::Encoding encoding,
                                              std::vector<std::vector<std::byte>>& frames,
                                              std::span<const std::uint64_t> fired) const {
  OutgoingMessage message;
  message.window = window;
  codec::MessageHeader header;
  header.window = message.window;
  header.sender_rank = static_cast<std::uint32_t>(rank);
  header.encoding = encoding;
  header.tensor_numels = state_.layout().numels();
  message.bytes = codec::encode_header(header, static_cast<std::uint32_t>(frames.size()));
  std::size_t total = message.bytes.size();
  for (const auto& f : frames)
    total += f.size();
  message.bytes.reserve(total);
  for (std::size_t c = 0; c < frames.size(); ++c) {
    message.bytes.insert(message.bytes.end(), frames[c].begin(), frames[c].end());
    std::vector<std::byte>().swap(frames[c]);
    message.entries += fired[c];
  }
  return message;
}

namespace {

// The window's all-gathers of messages and reduced ranges: node-aware when the group is
// (AttachedGroup::nodes()), with the same result either way. The messages are stored in the
// caller's `messages` (one per rank): work that on_message started on them may outlive a failed
// collective, and must be able to finish before the bytes go away.
void gather_messages(const AttachedGroup& group, std::span<const std::byte> mine,
                     const collectives::CollectiveOptions& options,
                     std::vector<std::vector<std::byte>>& messages,
                     const collectives::OnMessage& on_message = {}) {
  messages.assign(static_cast<std::size_t>(group.world()), {});
  if (const collectives::NodeLayout* nodes = group.nodes()) {
    collectives::sparse_allgather_nodes(group.transport(), *nodes, mine,
                                        collectives::store_in(messages), options, on_message);
    return;
  }
  collectives::sparse_allgather_into(group.transport(), mine, collectives::store_in(messages),
                                     options, on_message);
}

}  // namespace

ReceivedMessages PulseWindow::exchange(const AttachedGroup& group, const OutgoingMessage& mine) {
  const bool ordered = group.transport().matches_by_order();
  ExchangeInputs inputs{
      .option = options_.exchange, .world = group.world(), .ordered_transport = ordered};
  if (choice_needs_sketches(options_.exchange, group.world(), ordered)) {
    const UnionEstimate estimate = estimate_union(group, mine);
    inputs.group_entries = estimate.group_entries;
    inputs.union_estimate = estimate.union_entries;
  }
  const Exchange kind = choose_exchange(inputs);
  ReceivedMessages received =
      kind == Exchange::reduction ? reduce_by_owners(group, mine) : allgather(group, mine);
  received.kind = kind;
  received.world = group.world();
  return received;
}

PulseWindow::UnionEstimate PulseWindow::estimate_union(const AttachedGroup& group,
                                                       const OutgoingMessage& mine) {
  // This rank's sketch, from its own message (frames decode independently, in parallel).
  const codec::MessageView own = codec::MessageView::parse(mine.bytes, decode_limits());
  std::vector<UnionSketch> sketches(own.frame_count());
  pool_.parallel_for(own.frame_count(), [&](std::size_t c) {
    auto scratch = validate_scratch_.acquire();
    const std::uint64_t n = own.frame(c).entries;
    scratch->offsets.resize(n);
    scratch->values.resize(n);
    (void)own.decode_frame(c, scratch->offsets, scratch->values, scratch->decode,
                           context_of(state_.layout().chunks()[c], scratch->context));
    for (const std::uint32_t offset : std::span(scratch->offsets.data(), n))
      sketches[c].add(c, offset);
  });
  UnionSketch sketch;
  for (const UnionSketch& s : sketches)
    sketch.merge(s);
  // Every rank's entry count and sketch; every rank merges the same bytes.
  std::vector<std::byte> message(8 + UnionSketch::kBytes);
  store_le(message.data(), mine.entries);
  std::memcpy(message.data() + 8, sketch.bytes().data(), UnionSketch::kBytes);
  collectives::CollectiveOptions options = group.collective();
  options.max_message_bytes = message.size();
  const std::vector<std::vector<std::byte>> all =
      collectives::sparse_allgather(group.transport(), message, options);
  UnionEstimate estimate;
  UnionSketch merged;
  for (int r = 0; r < group.world(); ++r) {
    const auto& bytes = all[static_cast<std::size_t>(r)];
    if (bytes.size() != message.size()) {
      throw ProtocolError(fmt::format("rank {} sent a union sketch of {} bytes, expected {}", r,
                                      bytes.size(), message.size()),
                          {.rank = group.rank(), .peer = r});
    }
    estimate.group_entries += load_le<std::uint64_t>(bytes.data());
    try {
      merged.merge(UnionSketch::from_bytes(std::span<const std::uint8_t, UnionSketch::kBytes>(
          reinterpret_cast<const std::uint8_t*>(bytes.data() + 8), UnionSketch::kBytes)));
    } catch (const ProtocolError& e) {
      throw ProtocolError(fmt::format("rank {}: {}", r, e.message()),
                          {.rank = group.rank(), .peer = r});
    }
  }
  estimate.union_entries = merged.estimate();
  return estimate;
}

ReceivedMessages PulseWindow::allgather(const AttachedGroup& group, const OutgoingMessage& mine) {
  const int rank = group.rank();
  // Validation of each message starts on the pool as soon as the message is complete,
  // overlapping the rest of the exchange; the results are collected after the all-gather.
  struct Validation {
    const std::byte* data = nullptr;
    std::optional<codec::MessageView> view;
    std::exception_ptr error;
    std::future<void> done;
  };
  std::map<int, std::shared_ptr<Validation>> pending;
  auto wait_all = [&pending] {
    for (auto& [sender, validation] : pending) {
      if (validation->done.valid()) validation->done.wait();
    }
  };
  ReceivedMessages received;
  received.window = mine.window;
  try {
    // A peer's message is never larger than this model's largest encoding: a larger size is
    // refused before anything is allocated for it (docs/wire-format.md, "Decoding limits").
    collectives::CollectiveOptions exchange = group.collective();
    exchange.max_message_bytes = largest_message_bytes(state_.layout());
    gather_messages(
        group, mine.bytes, exchange, received.bytes,
        [&](int sender, std::span<const std::byte> bytes) {
          if (sender != rank) group.reached(WindowPhase::exchange, mine.window);
          auto validation = std::make_shared<Validation>();
          validation->data = bytes.data();
          pending[sender] = validation;
          validation->done = pool_.submit([this, validation, rank, sender, bytes, &mine] {
            try {
              validation->view.emplace(validate_message(rank, sender, mine.window, bytes));
            } catch (...) {
              validation->error = std::current_exception();
            }
          });
        });
  } catch (...) {
    // The exchange failed and nothing changed; validations still reading the messages'
    // buffers (in `received`) must finish before those go away.
    wait_all();
    throw;
  }
  wait_all();
  received.views.reserve(received.bytes.size());
  try {
    for (int r = 0; r < group.world(); ++r) {
      const auto& bytes = received.bytes[static_cast<std::size_t>(r)];
      auto it = pending.find(r);
      // Use the early validation only if it looked at the very bytes we got back.
      if (it != pending.end() && it->second->data == bytes.data()) {
        if (it->second->error) std::rethrow_exception(it->second->error);
        received.views.push_back(*it->second->view);
      } else {
        received.views.push_back(validate_message(rank, r, mine.window, bytes));
      }
      if (r != rank) received.received_bytes += bytes.size();
    }
  } catch (...) {
    received.invalid = std::current_exception();
    received.views.clear();
  }
  return received;
}

namespace {

// An owner's reduced range on the wire: this status, a u64 (the ranks' entries in the range
// when ok, else the rank at fault), then, when ok, a codec message of the range's frames with
// the summed values (docs/wire-format.md, "Reduced ranges").
enum class RangeStatus : std::uint64_t {
  ok = 0,
  invalid_piece = 1,  // the rank named sent this owner an invalid message for its range
  not_finite = 2,     // a sum of the range is not finite (fp32 overflow)
};
constexpr std::size_t kRangePrefixBytes = 16;

}  // namespace

ReceivedMessages PulseWindow::reduce_by_owners(const AttachedGroup& group,
                                               const OutgoingMessage& mine) {
  const int rank = group.rank();
  const int world = group.world();
  const auto& chunks = state_.layout().chunks();
  ReceivedMessages received;
  received.window = mine.window;
  received.owner_bounds = owner_bounds(chunks, world);
  const auto& bounds = received.owner_bounds;
  const auto range_of = [&bounds](int owner) {
    const auto o = static_cast<std::size_t>(owner);
    return std::pair{bounds[o], bounds[o + 1] - bounds[o]};
  };

  // This rank's message cut by owner: the same header, then that owner's frames as they are.
  const codec::MessageView own = codec::MessageView::parse(mine.bytes, decode_limits());
  std::vector<std::vector<std::byte>> parts(static_cast<std::size_t>(world));
  std::vector<std::span<const std::byte>> to_rank(static_cast<std::size_t>(world));
  for (int owner = 0; owner < world; ++owner) {
    const auto [first, count] = range_of(owner);
    auto& part = parts[static_cast<std::size_t>(owner)];
    part = codec::encode_header(own.header(), static_cast<std::uint32_t>(count));
    if (count > 0) {
      const codec::FrameInfo& begin = own.frame(first);
      const codec::FrameInfo& last = own.frame(first + count - 1);
      const auto from = mine.bytes.begin() + static_cast<std::ptrdiff_t>(begin.byte_offset);
      const auto to =
          mine.bytes.begin() + static_cast<std::ptrdiff_t>(last.byte_offset + last.byte_size);
      part.insert(part.end(), from, to);
    }
    to_rank[static_cast<std::size_t>(owner)] = part;
  }

  // Every rank's piece of this rank's range.
  collectives::CollectiveOptions exchange = group.collective();
  exchange.max_message_bytes = largest_message_bytes(state_.layout());
  std::vector<std::vector<std::byte>> pieces(static_cast<std::size_t>(world));
  collectives::sparse_alltoall(
      group.transport(), to_rank,
      [&](int sender, std::size_t bytes) {
        auto& piece = pieces[static_cast<std::size_t>(sender)];
        piece.resize(bytes);
        return std::span<std::byte>(piece);
      },
      exchange,
      [&](int sender, std::span<const std::byte>) {
        if (sender != rank) group.reached(WindowPhase::exchange, mine.window);
      });
  for (int sender = 0; sender < world; ++sender) {
    if (sender != rank) received.received_bytes += pieces[static_cast<std::size_t>(sender)].size();
  }

  // Validate the pieces, then sum them; what went wrong travels in the status instead, so
  // that every rank learns it from the all-gather and the vote rejects the window everywhere.
  const auto [first, count] = range_of(rank);
  std::vector<std::byte> reduced(kRangePrefixBytes);
  std::vector<codec::MessageView> views;
  std::exception_ptr own_error;
  int culprit = rank;
  try {
    for (int sender = 0; sender < world; ++sender) {
      culprit = sender;
      views.push_back(validate_message(rank, sender, mine.window,
                                       pieces[static_cast<std::size_t>(sender)], first, count));
    }
  } catch (const ProtocolError&) {
    own_error = std::current_exception();
  }
  if (own_error) {
    store_le(reduced.data(), static_cast<std::uint64_t>(RangeStatus::invalid_piece));
    store_le(reduced.data() + 8, static_cast<std::uint64_t>(culprit));
  } else {
    ReducedRange range = reduce_range(views, first, count);
    if (!range.finite) {
      own_error = std::make_exception_ptr(NonFiniteError(
          fmt::format("the ranks' summed pseudo-gradients in rank {}'s range overflow fp32", rank),
          {.rank = rank}));
      store_le(reduced.data(), static_cast<std::uint64_t>(RangeStatus::not_finite));
      store_le(reduced.data() + 8, static_cast<std::uint64_t>(rank));
    } else {
      store_le(reduced.data(), static_cast<std::uint64_t>(RangeStatus::ok));
      store_le(reduced.data() + 8, range.group_entries);
      codec::MessageHeader header = own.header();
      const std::vector<std::byte> head =
          codec::encode_header(header, static_cast<std::uint32_t>(count));
      reduced.insert(reduced.end(), head.begin(), head.end());
      for (const auto& frame : range.frames)
        reduced.insert(reduced.end(), frame.begin(), frame.end());
    }
  }
  views.clear();
  pieces.clear();

  // Every owner's range.
  exchange.max_message_bytes = kRangePrefixBytes + largest_message_bytes(state_.layout());
  gather_messages(group, reduced, exchange, received.bytes);
  try {
    if (own_error) std::rethrow_exception(own_error);
    for (int owner = 0; owner < world; ++owner) {
      const auto& bytes = received.bytes[static_cast<std::size_t>(owner)];
      if (owner != rank) received.received_bytes += bytes.size();
      if (bytes.size() < kRangePrefixBytes) {
        throw ProtocolError(fmt::format("rank {}'s reduced range has {} bytes, less than its "
                                        "prefix",
                                        owner, bytes.size()),
                            {.rank = rank, .peer = owner});
      }
      const auto status = load_le<std::uint64_t>(bytes.data());
      const auto value = load_le<std::uint64_t>(bytes.data() + 8);
      if (status == static_cast<std::uint64_t>(RangeStatus::invalid_piece) &&
          value < static_cast<std::uint64_t>(world)) {
        throw ProtocolError(fmt::format("rank {} sent rank {} an invalid message for its range "
                                        "(rank {} rejected it)",
                                        value, owner, owner),
                            {.rank = rank, .peer = static_cast<int>(value)});
      }
      if (status == static_cast<std::uint64_t>(RangeStatus::not_finite)) {
        throw NonFiniteError(
            fmt::format("the ranks' summed pseudo-gradients in rank {}'s range overflow fp32",
                        owner),
            {.rank = rank, .peer = owner});
      }
      if (status != static_cast<std::uint64_t>(RangeStatus::ok)) {
        throw ProtocolError(fmt::format("rank {}'s reduced range has status {}", owner, status),
                            {.rank = rank, .peer = owner});
      }
      received.group_entries += value;
      const auto [owner_first, owner_count] = range_of(owner);
      received.views.push_back(validate_message(rank, owner, mine.window,
                                                std::span(bytes).subspan(kRangePrefixBytes),
                                                owner_first, owner_count));
    }
  } catch (...) {
    received.invalid = std::current_exception();
    received.views.clear();
  }
  return received;
}

PulseWindow::ReducedRange PulseWindow::reduce_range(std::span<const codec::MessageView> pieces,
                                                    std::size_t first, std::size_t count) {
  const auto& chunks = state_.layout().chunks();
  ReducedRange range;
  range.frames.resize(count);
  std::vector<std::uint64_t> entries(count, 0);
  std::vector<std::uint8_t> finite(count, 1);
  pool_.parallel_for(count, [&](std::size_t i) {
    const ChunkRef& chunk = chunks[first + i];
    auto scratch = apply_scratch_.acquire();
    std::uint64_t total = 0;
    for (const auto& view : pieces)
      total += view.frame(i).entries;
    scratch->offsets.resize(total);
    scratch->values.resize(total);
    std::vector<kernels::SparseEntries> per_rank;
    per_rank.reserve(pieces.size());
    std::uint64_t at = 0;
    const std::span<const float> context = context_of(chunk, scratch->context);
    for (const auto& view : pieces) {
      const std::uint64_t n = view.frame(i).entries;
      const std::span offsets(scratch->offsets.data() + at, n);
      const std::span values(scratch->values.data() + at, n);
      (void)view.decode_frame(i, offsets, values, scratch->decode, context);  // validated
      per_rank.push_back({offsets, values});
      at += n;
    }
    entries[i] = total;
    const std::uint64_t room = std::min<std::uint64_t>(total, chunk.length);
    scratch->sum.resize(chunk.length);
    scratch->seen.resize(chunk.length, 0);
    scratch->sum_offsets.resize(room);
    scratch->sum_values.resize(room);
    const std::uint64_t n =
        kernels::sparse_sum(per_rank, chunk.length, scratch->sum.data(), scratch->seen.data(),
                            scratch->sum_offsets.data(), scratch->sum_values.data());
    const std::span values(scratch->sum_values.data(), n);
    if (!std::all_of(values.begin(), values.end(), [](float v) { return std::isfinite(v); })) {
      finite[i] = 0;
      return;
    }
    const std::span sum_offsets(scratch->sum_offsets.data(), n);
    range.frames[i] = codec::encode_frame(
        {
            .tensor = chunk.tensor,
            .begin = chunk.begin,
            .length = chunk.length,
            .offsets = sum_offsets,
            .values = values,
            .context = context,
            .residue_multiples = residue_multiples(per_rank, sum_offsets, chunk.length, *scratch),
        },
        options_.codec);
  });
  for (std::size_t i = 0; i < count; ++i) {
    range.group_entries += entries[i];
    if (finite[i] == 0) range.finite = false;
  }
  return range;
}

std::span<const std::uint8_t> PulseWindow::residue_multiples(
    std::span<const kernels::SparseEntries> per_rank, std::span<const std::uint32_t> sum_offsets,
    std::uint64_t length, DecodeScratch& scratch) const {
  // Only the context encoding codes values against θ_g's residue: a sum of k ranks' values
  // carries it k times where each rank's does (bf16 local weights, the authors' Δ).
  if (options_.codec.encoding != codec::Encoding::context) return {};
  scratch.contributions.resize(length, 0);
  for (const auto& rank : per_rank) {
    for (const std::uint32_t offset : rank.offsets) {
      std::uint8_t& count = scratch.contributions[offset];
      count = static_cast<std::uint8_t>(count + (count < 255 ? 1 : 0));
    }
  }
  scratch.sum_multiples.resize(sum_offsets.size());
  for (std::size_t j = 0; j < sum_offsets.size(); ++j) {
    scratch.sum_multiples[j] = scratch.contributions[sum_offsets[j]];
  }
  for (const auto& rank : per_rank) {
    for (const std::uint32_t offset : rank.offsets)
      scratch.contributions[offset] = 0;
  }
  return scratch.sum_multiples;
}

std::span<const float> PulseWindow::context_of(const ChunkRef& chunk,
                                               std::vector<float>& staging) const {
  if (options_.codec.encoding != codec::Encoding::context) return {};
  return global_context(state_, chunk, staging);
}

std::span<const float> global_context(const ReplicatedState& state, const ChunkRef& chunk,
                                      std::vector<float>& staging) {
  if (state.memory().device().kind == DeviceKind::cpu) {
    return state.host_values(StateBuffer::global, chunk.tensor).subspan(chunk.begin, chunk.length);
  }
  staging.resize(chunk.length);
  state.read_host(StateBuffer::global, chunk.tensor, {chunk.begin, chunk.length},
                  [&](std::uint64_t offset, std::span<const std::byte> piece) {
                    std::memcpy(reinterpret_cast<std::byte*>(staging.data()) + offset, piece.data(),
                                piece.size());
                  });
  return staging;
}

codec::DecodeLimits PulseWindow::decode_limits() const {
  const Layout& layout = state_.layout();
  codec::DecodeLimits limits;
  limits.max_frame_elements = options_.chunk_elements;
  limits.max_frames = static_cast<std::uint32_t>(
      std::min<std::size_t>(layout.chunks().size() + 1, limits.max_frames));
  limits.max_tensors = static_cast<std::uint32_t>(
      std::min<std::size_t>(layout.tensors().size() + 1, limits.max_tensors));
  return limits;
}

codec::MessageView PulseWindow::validate_message(int rank, int sender, std::uint64_t window,
                                                 std::span<const std::byte> bytes,
                                                 std::size_t first_chunk,
                                                 std::optional<std::size_t> chunk_count) {
  auto fail = [&](const std::string& what, std::optional<std::uint64_t> offset = {}) {
    throw ProtocolError(what, {.rank = rank, .peer = sender, .byte_offset = offset});
  };
  const Layout& layout = state_.layout();
  try {
    codec::MessageView view = codec::MessageView::parse(bytes, decode_limits());
    const codec::MessageHeader& header = view.header();
    if (header.window != window) {
      fail(fmt::format("message is for window {}, expected {}", header.window, window));
    }
    if (header.sender_rank != static_cast<std::uint32_t>(sender)) {
      fail(fmt::format("message claims sender rank {}", header.sender_rank));
    }
    if (header.encoding != options_.codec.encoding) {
      fail(fmt::format("message uses encoding {}, the run uses {}",
                       codec::encoding_name(header.encoding),
                       codec::encoding_name(options_.codec.encoding)));
    }
    if (header.tensor_numels != layout.numels()) fail("tensor table differs from this model's");
    const std::span<const ChunkRef> chunks =
        std::span(layout.chunks())
            .subspan(first_chunk, chunk_count.value_or(layout.chunks().size()));
    if (view.frame_count() != chunks.size()) {
      fail(chunk_count ? fmt::format("message has {} frames, its range has {} chunks",
                                     view.frame_count(), chunks.size())
                       : fmt::format("message has {} frames, the model has {} chunks",
                                     view.frame_count(), chunks.size()));
    }
    for (std::size_t c = 0; c < chunks.size(); ++c) {
      const codec::FrameInfo& frame = view.frame(c);
      if (frame.tensor != chunks[c].tensor || frame.begin != chunks[c].begin ||
          frame.length != chunks[c].length) {
        fail(fmt::format("frame {} covers tensor {} [{}, +{}), expected tensor {} [{}, +{})", c,
                         frame.tensor, frame.begin, frame.length, chunks[c].tensor, chunks[c].begin,
                         chunks[c].length),
             frame.byte_offset);
      }
    }
    // Full decode of every frame (checksums, ranges, ordering, finiteness), in parallel.
    pool_.parallel_for(chunks.size(), [&](std::size_t c) {
      auto scratch = validate_scratch_.acquire();
      const std::uint64_t n = view.frame(c).entries;
      scratch->offsets.resize(n);
      scratch->values.resize(n);
      const std::uint64_t decoded =
          view.decode_frame(c, scratch->offsets, scratch->values, scratch->decode,
                            context_of(chunks[c], scratch->context));
      if (decoded != n) {
        throw ProtocolError(
            fmt::format("frame {} decoded to {} entries, announced {}", c, decoded, n),
            {.byte_offset = view.frame(c).byte_offset});
      }
    });
    return view;
  } catch (const ProtocolError& e) {
    if (e.context().peer) throw;
    ErrorContext context = e.context();
    context.rank = rank;
    context.peer = sender;
    throw ProtocolError(fmt::format("invalid message from rank {}: {}", sender, e.message()),
                        std::move(context));
  }
}

void PulseWindow::vote(const AttachedGroup& group, const ReceivedMessages& received) {
  if (!received.invalid) state_.accept_window();
  agree_to_commit(group, !received.invalid, received.invalid);
}

namespace {

// Elements of one chunk that at least one rank sent; `seen` has room for the chunk and is all 0
// before and after.
std::uint64_t union_count(std::span<const kernels::SparseEntries> ranks,
                          std::vector<std::uint8_t>& seen) {
  if (ranks.size() == 1) return ranks[0].offsets.size();
  std::uint64_t count = 0;
  for (const kernels::SparseEntries& entries : ranks) {
    for (const std::uint32_t offset : entries.offsets) {
      count += seen[offset] ^ 1U;
      seen[offset] = 1;
    }
  }
  for (const kernels::SparseEntries& entries : ranks) {
    for (const std::uint32_t offset : entries.offsets)
      seen[offset] = 0;
  }
  return count;
}

}  // namespace

SetOverlap PulseWindow::apply(const ReceivedMessages& received, bool commit_residual) {
  const auto& chunks = state_.layout().chunks();
  const bool reduced = received.kind == Exchange::reduction;
  std::vector<std::uint64_t> union_entries(chunks.size(), 0);
  const kernels::OuterStepParams params{options_.outer_lr, options_.outer_momentum,
                                        !state_.momentum_initialised()};
  pool_.parallel_for(chunks.size(), [&](std::size_t c) {
    const ChunkRef& chunk = chunks[c];
    auto scratch = apply_scratch_.acquire();
    // The ranks' entries in rank order; reduced: the owner's sums as the first rank's entries
    // and R - 1 empty ones, which aggregate() turns into the same bits (kernels::sparse_sum).
    std::vector<std::pair<const codec::MessageView*, std::size_t>> frames;
    if (reduced) {
      const auto& bounds = received.owner_bounds;
      const auto owner = static_cast<std::size_t>(
          std::upper_bound(bounds.begin(), bounds.end(), c) - bounds.begin() - 1);
      frames.emplace_back(&received.views[owner], c - bounds[owner]);
    } else {
      for (const auto& view : received.views)
        frames.emplace_back(&view, c);
    }
    std::uint64_t total = 0;
    for (const auto& [view, frame] : frames)
      total += view->frame(frame).entries;
    scratch->offsets.resize(total);
    scratch->values.resize(total);
    std::vector<kernels::SparseEntries> per_rank;
    per_rank.reserve(static_cast<std::size_t>(received.world));
    std::uint64_t at = 0;
    // Decoded before this chunk's outer step moves θ_g.
    const std::span<const float> context = context_of(chunk, scratch->context);
    for (const auto& [view, frame] : frames) {
      const std::uint64_t n = view->frame(frame).entries;
      const std::span offsets(scratch->offsets.data() + at, n);
      const std::span values(scratch->values.data() + at, n);
      (void)view->decode_frame(frame, offsets, values, scratch->decode, context);  // validated
      per_rank.push_back({offsets, values});
      at += n;
    }
    if (reduced) {
      per_rank.resize(static_cast<std::size_t>(received.world));
      union_entries[c] = total;
    } else {
      scratch->seen.resize(chunk.length, 0);
      union_entries[c] = union_count(per_rank, scratch->seen);
    }
    if (commit_residual) {
      state_.aggregate_and_commit(chunk, per_rank, params);
    } else {
      state_.aggregate_and_step(chunk, per_rank, params);
    }
  });
  state_.end_apply();
  SetOverlap overlap;
  for (const std::uint64_t n : union_entries)
    overlap.union_entries += n;
  overlap.exchange = exchange_name(received.kind);
  if (reduced) {
    overlap.group_entries = received.group_entries;
  } else {
    for (const auto& view : received.views) {
      for (std::size_t c = 0; c < chunks.size(); ++c)
        overlap.group_entries += view.frame(c).entries;
    }
  }
  return overlap;
}

}  // namespace pulseloco::engine_detail
