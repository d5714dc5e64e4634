#include <pulseloco/engine/pulse_window.h>

#include <fmt/format.h>

#include <algorithm>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>

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
  const OutgoingMessage message = gate_and_encode(group.rank(), report.window);
  if (!options_.trace_dir.empty()) {
    write_trace_message(options_, group.rank(), message.window, message.bytes);
  }
  report.seconds.gate = seconds_since(phase);
  report.entries_sent = message.entries;
  report.payload_bytes = message.bytes.size();
  report.density = density_of(report);

  phase = SteadyClock::now();
  const ReceivedMessages received = exchange(group, message);
  report.received_bytes = received.received_bytes;
  vote(group, received);
  report.seconds.exchange = seconds_since(phase);
  group.reached(WindowPhase::aggregate, received.window);

  phase = SteadyClock::now();
  apply(received);
  report.seconds.apply = seconds_since(phase);
}

OutgoingMessage PulseWindow::gate_and_encode(int rank, std::uint64_t window) {
  const auto& chunks = state_.layout().chunks();
  std::vector<std::vector<std::byte>> frames(chunks.size());
  std::vector<std::uint64_t> fired(chunks.size(), 0);
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
    };
    frames[c] = codec::encode_frame(entries_view, options_.codec);
  });

  OutgoingMessage message;
  message.window = window;
  codec::MessageHeader header;
  header.window = message.window;
  header.sender_rank = static_cast<std::uint32_t>(rank);
  header.encoding = options_.codec.encoding;
  header.tensor_numels = state_.layout().numels();
  message.bytes = codec::encode_header(header, static_cast<std::uint32_t>(chunks.size()));
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

ReceivedMessages PulseWindow::exchange(const AttachedGroup& group, const OutgoingMessage& mine) {
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
    received.bytes = collectives::sparse_allgather(
        group.transport(), mine.bytes, exchange, [&](int sender, std::span<const std::byte> bytes) {
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
    // The exchange failed and nothing changed; validations still reading the collective's
    // buffers must finish before those go away.
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

codec::MessageView PulseWindow::validate_message(int rank, int sender, std::uint64_t window,
                                                 std::span<const std::byte> bytes) {
  auto fail = [&](const std::string& what, std::optional<std::uint64_t> offset = {}) {
    throw ProtocolError(what, {.rank = rank, .peer = sender, .byte_offset = offset});
  };
  const Layout& layout = state_.layout();
  try {
    codec::DecodeLimits limits;
    limits.max_frame_elements = options_.chunk_elements;
    limits.max_frames = static_cast<std::uint32_t>(
        std::min<std::size_t>(layout.chunks().size() + 1, limits.max_frames));
    limits.max_tensors = static_cast<std::uint32_t>(
        std::min<std::size_t>(layout.tensors().size() + 1, limits.max_tensors));
    codec::MessageView view = codec::MessageView::parse(bytes, limits);
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
    const auto& chunks = layout.chunks();
    if (view.frame_count() != chunks.size()) {
      fail(fmt::format("message has {} frames, the model has {} chunks", view.frame_count(),
                       chunks.size()));
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
          view.decode_frame(c, scratch->offsets, scratch->values, scratch->decode);
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

void PulseWindow::apply(const ReceivedMessages& received, bool commit_residual) {
  const auto& chunks = state_.layout().chunks();
  const kernels::OuterStepParams params{options_.outer_lr, options_.outer_momentum,
                                        !state_.momentum_initialised()};
  pool_.parallel_for(chunks.size(), [&](std::size_t c) {
    const ChunkRef& chunk = chunks[c];
    auto scratch = apply_scratch_.acquire();
    std::uint64_t total = 0;
    for (const auto& view : received.views)
      total += view.frame(c).entries;
    scratch->offsets.resize(total);
    scratch->values.resize(total);
    std::vector<kernels::SparseEntries> per_rank;
    per_rank.reserve(received.views.size());
    std::uint64_t at = 0;
    for (const auto& view : received.views) {
      const std::uint64_t n = view.frame(c).entries;
      const std::span offsets(scratch->offsets.data() + at, n);
      const std::span values(scratch->values.data() + at, n);
      (void)view.decode_frame(c, offsets, values, scratch->decode);  // validated already
      per_rank.push_back({offsets, values});
      at += n;
    }
    if (commit_residual) {
      state_.aggregate_and_commit(chunk, per_rank, params);
    } else {
      state_.aggregate_and_step(chunk, per_rank, params);
    }
  });
}

}  // namespace pulseloco::engine_detail
