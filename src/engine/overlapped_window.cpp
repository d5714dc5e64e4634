#include <pulseloco/engine/overlapped_window.h>

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include <pulseloco/base/thread_name.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/engine/scratch_pool.h>
#include <pulseloco/engine/trace.h>

namespace pulseloco::engine_detail {
namespace {

struct OwnEntries {
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
  codec::DecodeScratch decode;
  std::vector<float> context;  // θ_g of a device state's chunk (the context encoding)
};

// Calls `each(chunk, entries)` for every chunk of this rank's own message (valid: the gate
// encoded it, or a verified file held it), chunks in parallel. A context-coded message decodes
// against θ_g as it is now, which is what it was coded against (encode_against_global).
template <class Each>
void for_each_own_chunk(const ReplicatedState& state, ThreadPool& pool,
                        const OutgoingMessage& message, const Each& each) {
  const auto& chunks = state.layout().chunks();
  const codec::MessageView view = codec::MessageView::parse(message.bytes);
  const bool context = view.header().encoding == codec::Encoding::context;
  ScratchPool<OwnEntries> scratch;
  pool.parallel_for(chunks.size(), [&](std::size_t c) {
    auto entries = scratch.acquire();
    const std::uint64_t n = view.frame(c).entries;
    entries->offsets.resize(n);
    entries->values.resize(n);
    (void)view.decode_frame(
        c, entries->offsets, entries->values, entries->decode,
        context ? global_context(state, chunks[c], entries->context) : std::span<const float>());
    each(chunks[c], kernels::SparseEntries{entries->offsets, entries->values});
  });
}

}  // namespace

void drop_in_flight(ReplicatedState& state, ThreadPool& pool) {
  if (!state.in_flight()) return;
  for_each_own_chunk(state, pool, *state.in_flight(),
                     [&](const ChunkRef& chunk, const kernels::SparseEntries& own) {
                       state.restore_residual(chunk, own);
                     });
  state.clear_in_flight();
  state.clear_accepted_window();
  state.set_windows_dropped(state.windows_dropped() + 1);
}

void OverlappedPulseWindow::run(const AttachedGroup& group, WindowReport& report) {
  std::optional<ReceivedMessages> received;
  if (state_.in_flight()) received = finish(group, report);

  group.reached(WindowPhase::gate, report.window);
  auto phase = SteadyClock::now();
  // A gate that fails (a diverged model) must not keep this rank from applying the window the
  // group has just voted to commit: its error is raised once that is done.
  std::optional<OutgoingMessage> message;
  std::exception_ptr gate_error;
  // Every decode of this message (the exchange, the next boundary, a drop, the eager start)
  // happens after the outer step below. A context-coded message must be coded against the θ_g of
  // that step, so the gate writes the entries plainly (offsets and values, no entropy stage to
  // run twice) and they are coded once the step is taken.
  const bool context = options_.codec.encoding == codec::Encoding::context;
  codec::EncodeOptions gate_coding = options_.codec;
  if (context) gate_coding.encoding = codec::Encoding::plain_i32_f32;
  try {
    message = window_.gate_and_encode(group.rank(), report.window, gate_coding);
    state_.commit_residual(pool_);  // against the same start point, θ_l not yet reset
  } catch (...) {
    gate_error = std::current_exception();
  }
  report.seconds.gate = seconds_since(phase);

  phase = SteadyClock::now();
  if (received) {
    apply(*received, report);
  } else if (message) {
    state_.reset_local(pool_);
  }
  if (gate_error) std::rethrow_exception(gate_error);
  report.seconds.apply = seconds_since(phase);
  if (context) {
    phase = SteadyClock::now();
    *message = window_.encode_against_global(*message);
    report.seconds.gate += seconds_since(phase);
  }
  report.entries_sent = message->entries;
  report.payload_bytes = message->bytes.size();
  report.density = density_of(report);

  phase = SteadyClock::now();
  state_.set_in_flight(std::move(*message));
  if (options_.overlap == Overlap::eager) start_from_own();
  report.seconds.apply += seconds_since(phase);
  if (!options_.trace_dir.empty()) {
    const OutgoingMessage& sent = *state_.in_flight();
    write_trace_message(options_, group.rank(), sent.window, sent.bytes);
  }
}

ReceivedMessages OverlappedPulseWindow::finish(const AttachedGroup& group, WindowReport& report) {
  const auto start = SteadyClock::now();
  const double waited_before = collectives::header_wait_seconds();
  Exchanged done;
  // Of this boundary's time, what went to waiting for peers to join the exchange in flight: in
  // the background, the part of its wait that was still running when the boundary began.
  double waited = 0;
  if (exchange_.valid()) {
    done = exchange_.get();  // its failure keeps the window in flight
    const double wait_end =
        std::chrono::duration<double>(done.started - start).count() + done.wait_seconds;
    waited = std::clamp(wait_end, 0.0, seconds_since(start));
  } else {
    done.received = window_.exchange(group, *state_.in_flight());
    done.seconds = seconds_since(start);
  }
  const bool accepted = !done.received.invalid;
  if (accepted) state_.accept_window();
  const std::vector<int> rejecting = rejecting_ranks(group, accepted);
  if (!rejecting.empty()) {
    // Every rank saw the same votes: every rank drops the window.
    drop_in_flight(state_, pool_);
    throw_rejected(group, rejecting, done.received.invalid);
  }
  report.received_bytes = done.received.received_bytes;
  report.seconds.exchange_in_flight = done.seconds;
  report.seconds.exchange = seconds_since(start);
  report.seconds.exchange_wait = waited + (collectives::header_wait_seconds() - waited_before);
  group.reached(WindowPhase::aggregate, done.received.window);
  return std::move(done.received);
}

void OverlappedPulseWindow::apply(const ReceivedMessages& received, WindowReport& report) {
  set_overlap(report, window_.apply(received, /*commit_residual=*/false));
  state_.clear_in_flight();
  state_.commit_window();
  report.applied_window = received.window;
}

void OverlappedPulseWindow::start_from_own() {
  const kernels::OuterStepParams params{options_.outer_lr, options_.outer_momentum,
                                        !state_.momentum_initialised()};
  for_each_own_chunk(state_, pool_, *state_.in_flight(),
                     [&](const ChunkRef& chunk, const kernels::SparseEntries& own) {
                       state_.start_from_own(chunk, own, params);
                     });
  state_.end_apply();
}

void OverlappedPulseWindow::start_in_flight(const AttachedGroup& group) {
  if (!state_.in_flight() || exchange_.valid()) return;
  const OutgoingMessage* message = &*state_.in_flight();
  exchange_ = std::async(std::launch::async, [this, group, message] {
    set_this_thread_name("pl-exchange");
    Exchanged done;
    done.started = SteadyClock::now();
    const double waited_before = collectives::header_wait_seconds();
    done.received = window_.exchange(group, *message);
    done.seconds = seconds_since(done.started);
    done.wait_seconds = collectives::header_wait_seconds() - waited_before;
    return done;
  });
}

void OverlappedPulseWindow::wait_in_flight() noexcept {
  if (exchange_.valid()) exchange_.wait();
}

bool OverlappedPulseWindow::complete_in_flight(const AttachedGroup& group, WindowReport& report) {
  if (!state_.in_flight()) return false;
  const ReceivedMessages received = finish(group, report);
  const auto phase = SteadyClock::now();
  apply(received, report);  // θ_l = cast(θ_g), and S = θ_g
  report.seconds.apply = seconds_since(phase);
  return true;
}

void OverlappedPulseWindow::state_loaded() {
  wait_in_flight();
  exchange_ = {};  // an exchange of the state that was replaced
}

}  // namespace pulseloco::engine_detail
