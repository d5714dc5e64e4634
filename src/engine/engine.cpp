#include <pulseloco/engine/engine.h>

#include <pulseloco/engine/engine_impl.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include <pulseloco/base/bf16.h>
#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/codec/message.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/layout.h>
#include <pulseloco/engine/scratch_pool.h>
#include <pulseloco/kernels/window_kernels.h>

namespace pulseloco {
namespace {

using SteadyClock = std::chrono::steady_clock;

double seconds_since(SteadyClock::time_point start) {
  return std::chrono::duration<double>(SteadyClock::now() - start).count();
}

// The engine's collectives run one at a time, in the same order on every rank, under one base
// tag; the collectives number their calls per base tag themselves.
constexpr transport::Tag kEngineTag = 7;

}  // namespace

using namespace engine_detail;

collectives::CollectiveOptions Engine::Impl::next_collective() const {
  collectives::CollectiveOptions c;
  c.timeout = options.timeout;
  c.algorithm = options.allgather;
  c.pipeline_chunk_bytes = static_cast<std::size_t>(options.pipeline_chunk_bytes);
  c.tag = kEngineTag;
  return c;
}

void Engine::Impl::check_agreement(std::uint64_t mine, const char* what,
                                   const std::exception_ptr& local_error) {
  // `mine` is 0 when this rank failed locally (then its own error is thrown).
  const auto all = collectives::allgather_u64(*transport, mine, next_collective());
  if (local_error) std::rethrow_exception(local_error);
  std::vector<int> failed;
  std::vector<int> differing;
  for (int r = 0; r < world; ++r) {
    const std::uint64_t theirs = all[static_cast<std::size_t>(r)];
    if (theirs == 0) {
      failed.push_back(r);
    } else if (theirs != all[0] && all[0] != 0) {
      differing.push_back(r);
    }
  }
  if (!failed.empty()) {
    throw InvalidArgument("these ranks could not start (invalid parameters; see their logs)",
                          {.rank = rank, .ranks = failed});
  }
  if (!differing.empty()) {
    throw InvalidArgument(fmt::format("{} differ from rank 0's on these ranks", what),
                          {.rank = rank, .ranks = differing});
  }
}

void Engine::Impl::broadcast_initial_weights() {
  // Rank 0's θ_l becomes everyone's θ_l, bucket by bucket, in the local dtype's bytes.
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    TensorView& local = tensors[t].local;
    auto* bytes = static_cast<std::byte*>(local.data);
    const std::size_t element = dtype_size(local.dtype);
    const std::uint64_t step = options.bucket_elements;
    for (std::uint64_t begin = 0; begin < local.numel; begin += step) {
      const std::uint64_t count = std::min(step, local.numel - begin);
      collectives::broadcast(*transport, 0, std::span(bytes + begin * element, count * element),
                             next_collective());
    }
  }
  if (options.mode == Mode::ddp) return;  // ddp keeps no global state
  // θ_g = float(θ_l); θ_l = cast_local(θ_g) is then the identity.
  pool.parallel_for(layout.chunks().size(), [&](std::size_t c) {
    const ChunkRef& chunk = layout.chunks()[c];
    TensorState& state = tensors[chunk.tensor];
    float* global = state.global.data() + chunk.begin;
    if (state.local.dtype == DType::float32) {
      std::memcpy(global, static_cast<const float*>(state.local.data) + chunk.begin,
                  chunk.length * sizeof(float));
    } else {
      bf16_to_float(std::span(static_cast<const std::uint16_t*>(state.local.data) + chunk.begin,
                              chunk.length),
                    std::span(global, chunk.length));
    }
  });
}

void Engine::Impl::prepare(std::vector<NamedTensor> parameters) {
  // Invalid options are refused before any communication (the timeout itself may be invalid).
  options.validate();
  try {
    fault = fault_plan_from_environment();
    if (fault) {
      logger().warn("fault injection armed (PULSELOCO_FAULT): {} at window {}, phase {}",
                    fault_action_name(fault->action), fault->window,
                    fault_phase_name(fault->phase));
    }
    std::vector<TensorInfo> infos;
    infos.reserve(parameters.size());
    tensors.resize(parameters.size());
    for (std::size_t t = 0; t < parameters.size(); ++t) {
      const NamedTensor& p = parameters[t];
      if (p.view.dtype != DType::float32 && p.view.dtype != DType::bfloat16) {
        throw InvalidArgument("parameters must be float32 or bfloat16", {.tensor = p.name});
      }
      if (!p.view.device.is_cpu()) {
        throw InvalidArgument(
            "this engine keeps its state on the CPU; pass CPU tensors (the libtorch adapter "
            "stages CUDA parameters through host memory)",
            {.tensor = p.name});
      }
      if (p.view.numel > 0 && p.view.data == nullptr) {
        throw InvalidArgument("parameter has elements but no data", {.tensor = p.name});
      }
      std::vector<std::uint64_t> shape =
          p.shape.empty() ? std::vector<std::uint64_t>{p.view.numel} : p.shape;
      std::uint64_t product = 1;
      for (std::uint64_t d : shape)
        product *= d;
      if (product != p.view.numel) {
        throw InvalidArgument("shape does not match the element count", {.tensor = p.name});
      }
      tensors[t].local = p.view;
      tensors[t].shape = std::move(shape);
      infos.push_back({p.name, p.view.numel, p.view.dtype});
    }
    layout = Layout(std::move(infos), options.chunk_elements, options.bucket_elements);
    for (TensorState& state : tensors) {
      if (options.mode != Mode::ddp) {
        state.global.assign(state.local.numel, 0.0f);
        state.momentum.assign(state.local.numel, 0.0f);
        state.residual.assign(state.local.numel, 0.0f);
      }
    }
  } catch (...) {
    setup_error = std::current_exception();
  }
}

transport::Transport& Engine::Impl::require_transport() const {
  if (!transport) {
    throw InvalidArgument(
        "this engine is not attached to a group (call attach() with a connected transport)",
        {.rank = rank});
  }
  return *transport;
}

void Engine::Impl::attach(std::unique_ptr<transport::Transport> replacement, GroupInfo info) {
  if (!replacement) throw InvalidArgument("attach() needs a connected transport");
  transport = std::move(replacement);
  rank = transport->rank();
  world = transport->size();
  group = std::move(info);
  committed_report.reset();
  // A rank with invalid parameters still takes part in the agreement rounds below, so that
  // every rank fails at once instead of waiting for it until the timeout.
  check_agreement(setup_error ? 0 : shared_options_digest(options) | 1u,
                  "options (mode, H, outer lr/momentum, chunking, codec)", setup_error);
  check_agreement(layout.table_digest() | 1u, "parameter tables (names, sizes, dtypes)", nullptr);

  synchronise_members();
  stats_at_window_start = transport->stats();
  ddp_payload_bytes = 0;
  ddp_exchange_seconds = 0;
  logger().info(
      "engine ready: rank {}/{} (group generation {}), mode {}, window {}, {} tensors, "
      "{} parameters, H={}, {} chunks",
      rank, world, group.generation, mode_name(options.mode), window, tensors.size(),
      layout.parameters(), options.steps_per_window, layout.chunks().size());
}

namespace {

// What a member tells the others in attach(): enough to decide who is up to date.
struct MemberStatus {
  bool has_state = false;
  bool momentum_initialised = false;
  std::uint64_t window = 0;
  Digest digest = 0;
  std::optional<std::uint64_t> accepted_window;

  static constexpr std::size_t kBytes = 32;

  [[nodiscard]] std::array<std::byte, kBytes> serialize() const {
    const std::uint64_t flags =
        (has_state ? 1u : 0u) | (momentum_initialised ? 2u : 0u) | (accepted_window ? 4u : 0u);
    std::array<std::byte, kBytes> bytes{};
    ByteWriter(bytes).put(flags).put(window).put(digest).put(accepted_window.value_or(0));
    return bytes;
  }

  static MemberStatus deserialize(std::span<const std::byte> bytes, int sender, int rank) {
    if (bytes.size() != kBytes) {
      throw ProtocolError(
          fmt::format("membership status of {} bytes, expected {}", bytes.size(), kBytes),
          {.rank = rank, .peer = sender});
    }
    ByteReader in(bytes, {.rank = rank, .peer = sender});
    const auto flags = in.get<std::uint64_t>("flags");
    if (flags > 7) {
      throw ProtocolError(fmt::format("membership status has unknown flags {:#x}", flags),
                          {.rank = rank, .peer = sender});
    }
    const auto window = in.get<std::uint64_t>("window");
    const auto digest = in.get<std::uint64_t>("digest");
    const auto accepted_window = in.get<std::uint64_t>("accepted window");
    MemberStatus status;
    status.has_state = (flags & 1u) != 0;
    status.momentum_initialised = (flags & 2u) != 0;
    status.window = window;
    status.digest = digest;
    if ((flags & 4u) != 0) status.accepted_window = accepted_window;
    return status;
  }
};

}  // namespace

void Engine::Impl::synchronise_members() {
  MemberStatus mine;
  mine.has_state = has_state;
  mine.momentum_initialised = momentum_initialised;
  mine.window = window;
  mine.digest = has_state ? compute_state_digest() : 0;
  mine.accepted_window = accepted_window;
  const auto record = mine.serialize();
  const auto records = collectives::sparse_allgather(*transport, record, next_collective());
  std::vector<MemberStatus> members;
  for (int r = 0; r < world; ++r) {
    members.push_back(MemberStatus::deserialize(records[static_cast<std::size_t>(r)], r, rank));
  }

  const bool anyone_has_state =
      std::any_of(members.begin(), members.end(), [](const auto& m) { return m.has_state; });
  if (!anyone_has_state) {
    // The first group of the run: rank 0's weights become everyone's.
    broadcast_initial_weights();
    for (TensorState& state : tensors)
      std::fill(state.residual.begin(), state.residual.end(), 0.0f);
    window = 0;
    momentum_initialised = false;
    accepted_window.reset();
    has_state = true;
  } else {
    if (options.mode == Mode::ddp) {
      throw InvalidArgument(
          "mode ddp keeps no replicated state to hand to new members; elastic membership needs "
          "mode pulse or diloco",
          {.rank = rank});
    }
    std::uint64_t latest = 0;
    for (const auto& m : members) {
      if (m.has_state) latest = std::max(latest, m.window);
    }
    int source = -1;
    std::vector<int> differing;
    for (int r = 0; r < world; ++r) {
      const MemberStatus& m = members[static_cast<std::size_t>(r)];
      if (!m.has_state || m.window != latest) continue;
      if (source < 0) {
        source = r;
      } else if (m.digest != members[static_cast<std::size_t>(source)].digest) {
        differing.push_back(r);
      }
    }
    if (!differing.empty()) {
      throw DivergenceError(
          fmt::format("members at window {} hold a different θ_g/m than rank {}", latest, source),
          {.rank = rank, .ranks = differing});
    }
    std::vector<int> behind;
    for (int r = 0; r < world; ++r) {
      const MemberStatus& m = members[static_cast<std::size_t>(r)];
      if (!m.has_state || m.window != latest) behind.push_back(r);
    }
    const bool up_to_date = has_state && window == latest;
    if (!up_to_date) {
      const bool accepted_the_committed_window =
          has_state && latest > 0 && window == latest - 1 && accepted_window == window;
      if (accepted_the_committed_window && options.mode == Mode::pulse) {
        // The old group committed the window this rank had accepted (its message is in the
        // others' aggregate): commit the residual exactly as the window would have.
        pool.parallel_for(layout.chunks().size(), [&](std::size_t c) {
          const ChunkRef& chunk = layout.chunks()[c];
          kernels::commit_residual(gate_input(chunk),
                                   tensors[chunk.tensor].residual.data() + chunk.begin);
        });
        logger().info(
            "window {} committed in the old group after this rank had accepted it: residual "
            "committed, taking θ_g and m from rank {}",
            window, source);
      } else if (!accepted_the_committed_window) {
        if (has_state) {
          logger().warn(
              "this rank is at window {}, the group at {}: re-synchronising from rank {} with a "
              "zero residual",
              window, latest, source);
        }
        for (TensorState& state : tensors)
          std::fill(state.residual.begin(), state.residual.end(), 0.0f);
      }
      // Until the state has arrived, this rank counts as new.
      has_state = false;
      accepted_window.reset();
    }
    if (!behind.empty()) {
      broadcast_state(source);
      if (!up_to_date) {
        pool.parallel_for(layout.chunks().size(), [&](std::size_t c) {
          const ChunkRef& chunk = layout.chunks()[c];
          TensorState& state = tensors[chunk.tensor];
          kernels::reset_local(state.global.data() + chunk.begin,
                               static_cast<std::byte*>(state.local.data) +
                                   chunk.begin * dtype_size(state.local.dtype),
                               state.local.dtype, chunk.length);
        });
        window = latest;
        momentum_initialised = members[static_cast<std::size_t>(source)].momentum_initialised;
        steps_in_window = 0;
        has_state = true;
      }
      logger().info("group generation {}: ranks {} received θ_g and m of window {} from rank {}",
                    group.generation, fmt::join(behind, ", "), latest, source);
    }
    accepted_window.reset();
  }

  // Every member must now hold the same θ_g and m.
  const auto digests =
      collectives::allgather_u64(*transport, compute_state_digest(), next_collective());
  std::vector<int> diverging;
  for (int r = 0; r < world; ++r) {
    if (digests[static_cast<std::size_t>(r)] != digests[0]) diverging.push_back(r);
  }
  if (!diverging.empty()) {
    throw DivergenceError("after attaching, these ranks hold a different θ_g/m than rank 0",
                          {.rank = rank, .ranks = diverging});
  }
}

void Engine::Impl::broadcast_state(int source) {
  // θ_g and m of every tensor, in pieces of at most one bucket.
  for (TensorState& state : tensors) {
    for (std::vector<float>* values : {&state.global, &state.momentum}) {
      const std::uint64_t step = options.bucket_elements;
      for (std::uint64_t begin = 0; begin < values->size(); begin += step) {
        const std::uint64_t count = std::min<std::uint64_t>(step, values->size() - begin);
        collectives::broadcast(*transport, source,
                               std::as_writable_bytes(std::span(values->data() + begin, count)),
                               next_collective());
      }
    }
  }
}

void Engine::Impl::inject_fault(FaultPhase phase) {
  const std::string_view worker =
      static_cast<std::size_t>(rank) < group.members.size()
          ? std::string_view(group.members[static_cast<std::size_t>(rank)])
          : std::string_view{};
  if (!fault || !fault->matches(window, phase, rank, worker)) return;
  fault->fired = true;
  logger().warn("fault injection: {} at window {}, phase {}", fault_action_name(fault->action),
                window, fault_phase_name(phase));
  switch (fault->action) {
    case FaultAction::kill:
      ::kill(::getpid(), SIGKILL);
      break;
    case FaultAction::stall:
      ::raise(SIGSTOP);
      break;
    case FaultAction::disconnect:
      if (transport) transport->abort("fault injection: this worker disconnected");
      break;
  }
}

kernels::GateChunk Engine::Impl::gate_input(const ChunkRef& chunk) const {
  const TensorState& state = tensors[chunk.tensor];
  return kernels::GateChunk{
      .global = state.global.data() + chunk.begin,
      .local = static_cast<const std::byte*>(state.local.data) +
               chunk.begin * dtype_size(state.local.dtype),
      .local_dtype = state.local.dtype,
      .residual = state.residual.data() + chunk.begin,
      .count = chunk.length,
  };
}

void Engine::Impl::throw_non_finite(const ChunkRef& chunk, std::uint64_t offset) const {
  throw NonFiniteError(
      "the pseudo-gradient is not finite (the local model diverged); nothing was sent",
      {.rank = rank, .tensor = layout.tensors()[chunk.tensor].name, .index = chunk.begin + offset});
}

// Steps 1-5 (without the state change) and encoding: this rank's message.
std::vector<std::byte> Engine::Impl::gate_and_encode(std::uint64_t& entries) {
  const auto& chunks = layout.chunks();
  std::vector<std::vector<std::byte>> frames(chunks.size());
  std::vector<std::uint64_t> fired(chunks.size(), 0);
  pool.parallel_for(chunks.size(), [&](std::size_t c) {
    const ChunkRef& chunk = chunks[c];
    auto scratch = gate_scratch.acquire();
    scratch->offsets.resize(chunk.length);
    scratch->values.resize(chunk.length);
    const kernels::GateResult result =
        kernels::gate(gate_input(chunk), scratch->offsets.data(), scratch->values.data());
    if (result.non_finite_offset) throw_non_finite(chunk, *result.non_finite_offset);
    fired[c] = result.fired;
    const codec::FrameEntries entries_view{
        .tensor = chunk.tensor,
        .begin = chunk.begin,
        .length = chunk.length,
        .offsets = std::span(scratch->offsets.data(), result.fired),
        .values = std::span(scratch->values.data(), result.fired),
    };
    frames[c] = codec::encode_frame(entries_view, options.codec);
  });

  codec::MessageHeader header;
  header.window = window;
  header.sender_rank = static_cast<std::uint32_t>(rank);
  header.encoding = options.codec.encoding;
  header.tensor_numels = layout.numels();
  std::vector<std::byte> message =
      codec::encode_header(header, static_cast<std::uint32_t>(chunks.size()));
  std::size_t total = message.size();
  for (const auto& f : frames)
    total += f.size();
  message.reserve(total);
  entries = 0;
  for (std::size_t c = 0; c < frames.size(); ++c) {
    message.insert(message.end(), frames[c].begin(), frames[c].end());
    std::vector<std::byte>().swap(frames[c]);
    entries += fired[c];
  }
  return message;
}

// Parses rank `sender`'s message and checks everything about it, frame by frame, so that the
// apply phase cannot fail. Throws ProtocolError naming the sender.
codec::MessageView Engine::Impl::validate_message(int sender, std::span<const std::byte> bytes) {
  auto fail = [&](const std::string& what, std::optional<std::uint64_t> offset = {}) {
    throw ProtocolError(what, {.rank = rank, .peer = sender, .byte_offset = offset});
  };
  try {
    codec::DecodeLimits limits;
    limits.max_frame_elements = options.chunk_elements;
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
    if (header.encoding != options.codec.encoding) {
      fail(fmt::format("message uses encoding {}, the run uses {}",
                       codec::encoding_name(header.encoding),
                       codec::encoding_name(options.codec.encoding)));
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
    pool.parallel_for(chunks.size(), [&](std::size_t c) {
      auto scratch = validate_scratch.acquire();
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

// Every rank says whether it accepted every message; commit only when all did. A rank that
// rejected (or could not exchange) makes every rank keep its state.
void Engine::Impl::agree_to_commit(bool accepted, const std::exception_ptr& local_error) {
  const auto votes = collectives::allgather_u64(*transport, accepted ? 1u : 0u, next_collective());
  if (local_error) std::rethrow_exception(local_error);
  std::vector<int> rejecting;
  for (int r = 0; r < world; ++r) {
    if (votes[static_cast<std::size_t>(r)] != 1) rejecting.push_back(r);
  }
  if (!rejecting.empty()) {
    throw ProtocolError(
        "the window was rejected by other ranks (invalid messages); "
        "state left unchanged",
        {.rank = rank, .ranks = rejecting});
  }
}

// Steps 6-9 on every chunk, from validated messages.
void Engine::Impl::apply_pulse(const std::vector<codec::MessageView>& views) {
  const auto& chunks = layout.chunks();
  const kernels::OuterStepParams params{options.outer_lr, options.outer_momentum,
                                        !momentum_initialised};
  pool.parallel_for(chunks.size(), [&](std::size_t c) {
    const ChunkRef& chunk = chunks[c];
    TensorState& state = tensors[chunk.tensor];
    auto scratch = apply_scratch.acquire();
    std::uint64_t total = 0;
    for (const auto& view : views)
      total += view.frame(c).entries;
    scratch->offsets.resize(total);
    scratch->values.resize(total);
    scratch->aggregate.resize(chunk.length);
    std::vector<kernels::SparseEntries> per_rank;
    per_rank.reserve(views.size());
    std::uint64_t at = 0;
    for (const auto& view : views) {
      const std::uint64_t n = view.frame(c).entries;
      const std::span offsets(scratch->offsets.data() + at, n);
      const std::span values(scratch->values.data() + at, n);
      (void)view.decode_frame(c, offsets, values, scratch->decode);  // validated already
      per_rank.push_back({offsets, values});
      at += n;
    }
    kernels::aggregate(per_rank, scratch->aggregate.data(), chunk.length);
    // Step 5's state change (e), then steps 8 and 9, in one pass over the chunk.
    kernels::commit_and_outer_step(
        kernels::WindowChunk{
            .global = state.global.data() + chunk.begin,
            .momentum = state.momentum.data() + chunk.begin,
            .residual = state.residual.data() + chunk.begin,
            .local = static_cast<std::byte*>(state.local.data) +
                     chunk.begin * dtype_size(state.local.dtype),
            .local_dtype = state.local.dtype,
            .count = chunk.length,
        },
        scratch->aggregate.data(), params);
  });
}

void Engine::Impl::run_pulse(WindowReport& report) {
  inject_fault(FaultPhase::gate);
  auto phase = SteadyClock::now();
  std::uint64_t entries = 0;
  const std::vector<std::byte> message = gate_and_encode(entries);
  report.seconds.gate = seconds_since(phase);
  report.entries_sent = entries;
  report.payload_bytes = message.size();

  phase = SteadyClock::now();
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
  std::vector<std::vector<std::byte>> messages;
  try {
    messages = collectives::sparse_allgather(
        *transport, message, next_collective(), [&](int sender, std::span<const std::byte> bytes) {
          if (sender != rank) inject_fault(FaultPhase::exchange);
          auto validation = std::make_shared<Validation>();
          validation->data = bytes.data();
          pending[sender] = validation;
          validation->done = pool.submit([this, validation, sender, bytes] {
            try {
              validation->view.emplace(validate_message(sender, bytes));
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
  std::vector<codec::MessageView> views;
  views.reserve(static_cast<std::size_t>(world));
  std::exception_ptr local_error;
  try {
    for (int r = 0; r < world; ++r) {
      const auto& bytes = messages[static_cast<std::size_t>(r)];
      auto it = pending.find(r);
      // Use the early validation only if it looked at the very bytes we got back.
      if (it != pending.end() && it->second->data == bytes.data()) {
        if (it->second->error) std::rethrow_exception(it->second->error);
        views.push_back(*it->second->view);
      } else {
        views.push_back(validate_message(r, bytes));
      }
      if (r != rank) report.received_bytes += bytes.size();
    }
  } catch (...) {
    local_error = std::current_exception();
  }
  if (!local_error) accepted_window = window;
  agree_to_commit(!local_error, local_error);
  report.seconds.exchange = seconds_since(phase);
  inject_fault(FaultPhase::aggregate);

  phase = SteadyClock::now();
  apply_pulse(views);
  report.seconds.apply = seconds_since(phase);
}

void Engine::Impl::run_diloco(WindowReport& report) {
  inject_fault(FaultPhase::gate);
  const auto& chunks = layout.chunks();
  auto phase = SteadyClock::now();
  double exchange_seconds = 0;
  // Per bucket: pseudo-gradients into the staging buffer, summed over ranks into the
  // per-tensor g buffers (the residual storage, unused by this mode).
  for (const BucketRef& bucket : layout.buckets()) {
    auto scratch = bucket_scratch.acquire();
    scratch->input.resize(bucket.elements);
    scratch->output.resize(bucket.elements);
    std::vector<std::uint64_t> offsets(bucket.chunk_count);
    for (std::size_t i = 1; i < bucket.chunk_count; ++i) {
      offsets[i] = offsets[i - 1] + chunks[bucket.first_chunk + i - 1].length;
    }
    pool.parallel_for(bucket.chunk_count, [&](std::size_t i) {
      const ChunkRef& chunk = chunks[bucket.first_chunk + i];
      const TensorState& state = tensors[chunk.tensor];
      float* delta = scratch->input.data() + offsets[i];
      kernels::pseudo_gradient(state.global.data() + chunk.begin,
                               static_cast<const std::byte*>(state.local.data) +
                                   chunk.begin * dtype_size(state.local.dtype),
                               state.local.dtype, delta, chunk.length);
      for (std::uint64_t k = 0; k < chunk.length; ++k) {
        if (!std::isfinite(delta[k])) throw_non_finite(chunk, k);
      }
    });
    const auto exchange_start = SteadyClock::now();
    collectives::allreduce_sum(*transport, scratch->input, scratch->output, next_collective());
    exchange_seconds += seconds_since(exchange_start);
    inject_fault(FaultPhase::exchange);
    for (std::size_t i = 0; i < bucket.chunk_count; ++i) {
      const ChunkRef& chunk = chunks[bucket.first_chunk + i];
      std::memcpy(tensors[chunk.tensor].residual.data() + chunk.begin,
                  scratch->output.data() + offsets[i], chunk.length * sizeof(float));
    }
  }
  const auto agree_start = SteadyClock::now();
  accepted_window = window;
  agree_to_commit(true, nullptr);
  exchange_seconds += seconds_since(agree_start);
  report.seconds.exchange = exchange_seconds;
  report.seconds.gate = seconds_since(phase) - exchange_seconds;
  inject_fault(FaultPhase::aggregate);
  report.entries_sent = layout.parameters();
  report.payload_bytes = layout.parameters() * sizeof(float);
  report.received_bytes = report.payload_bytes * static_cast<std::uint64_t>(world - 1);

  phase = SteadyClock::now();
  const kernels::OuterStepParams params{options.outer_lr, options.outer_momentum,
                                        !momentum_initialised};
  const auto divisor = static_cast<float>(world);
  pool.parallel_for(chunks.size(), [&](std::size_t c) {
    const ChunkRef& chunk = chunks[c];
    TensorState& state = tensors[chunk.tensor];
    float* g = state.residual.data() + chunk.begin;
    kernels::divide(g, chunk.length, divisor);
    kernels::outer_step(
        state.global.data() + chunk.begin, state.momentum.data() + chunk.begin, g,
        static_cast<std::byte*>(state.local.data) + chunk.begin * dtype_size(state.local.dtype),
        state.local.dtype, chunk.length, params);
    std::fill_n(g, chunk.length, 0.0f);
  });
  report.seconds.apply = seconds_since(phase);
}

void Engine::Impl::average_gradients(std::span<const TensorView> gradients) {
  (void)require_transport();
  if (options.mode != Mode::ddp) {
    throw InvalidArgument("average_gradients() is for mode ddp; this run is mode " +
                          std::string(mode_name(options.mode)));
  }
  if (gradients.size() != tensors.size()) {
    throw InvalidArgument(
        fmt::format("{} gradients given for {} parameters", gradients.size(), tensors.size()));
  }
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const TensorView& g = gradients[t];
    if (g.numel != tensors[t].local.numel || g.dtype != tensors[t].local.dtype ||
        !g.device.is_cpu() || (g.numel > 0 && g.data == nullptr)) {
      throw InvalidArgument("gradient does not match its parameter (size, dtype, device)",
                            {.tensor = layout.tensors()[t].name});
    }
  }
  const auto start = SteadyClock::now();
  const auto& chunks = layout.chunks();
  const auto divisor = static_cast<float>(world);
  for (const BucketRef& bucket : layout.buckets()) {
    auto scratch = bucket_scratch.acquire();
    scratch->input.resize(bucket.elements);
    scratch->output.resize(bucket.elements);
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < bucket.chunk_count; ++i) {
      const ChunkRef& chunk = chunks[bucket.first_chunk + i];
      const TensorView& g = gradients[chunk.tensor];
      if (g.dtype == DType::float32) {
        std::memcpy(scratch->input.data() + at, static_cast<const float*>(g.data) + chunk.begin,
                    chunk.length * sizeof(float));
      } else {
        bf16_to_float(
            std::span(static_cast<const std::uint16_t*>(g.data) + chunk.begin, chunk.length),
            std::span(scratch->input.data() + at, chunk.length));
      }
      at += chunk.length;
    }
    collectives::allreduce_sum(*transport, scratch->input, scratch->output, next_collective());
    kernels::divide(scratch->output.data(), bucket.elements, divisor);
    at = 0;
    for (std::size_t i = 0; i < bucket.chunk_count; ++i) {
      const ChunkRef& chunk = chunks[bucket.first_chunk + i];
      const TensorView& g = gradients[chunk.tensor];
      if (g.dtype == DType::float32) {
        std::memcpy(static_cast<float*>(g.data) + chunk.begin, scratch->output.data() + at,
                    chunk.length * sizeof(float));
      } else {
        float_to_bf16(std::span(scratch->output.data() + at, chunk.length),
                      std::span(static_cast<std::uint16_t*>(g.data) + chunk.begin, chunk.length));
      }
      at += chunk.length;
    }
  }
  ddp_payload_bytes += layout.parameters() * sizeof(float);
  ddp_exchange_seconds += seconds_since(start);
}

Digest Engine::Impl::compute_state_digest() {
  std::vector<Digest> parts(tensors.size() * 2);
  pool.parallel_for(tensors.size(), [&](std::size_t t) {
    const TensorState& state = tensors[t];
    if (options.mode == Mode::ddp) {
      // No global state in ddp: the replicas' weights themselves must agree.
      parts[2 * t] = digest_bytes(
          std::span(static_cast<const std::byte*>(state.local.data), state.local.bytes()));
      parts[2 * t + 1] = 0;
    } else {
      parts[2 * t] = digest_floats(state.global);
      parts[2 * t + 1] = digest_floats(state.momentum);
    }
  });
  return combine_digests(parts);
}

void Engine::Impl::verify(WindowReport& report) {
  const auto start = SteadyClock::now();
  if (options.verify_digests) {
    report.rank_digests = collectives::allgather_u64(*transport, report.digest, next_collective());
    std::map<Digest, int> votes;
    for (Digest d : report.rank_digests)
      ++votes[d];
    const Digest majority =
        std::max_element(votes.begin(), votes.end(), [](const auto& a, const auto& b) {
          return a.second < b.second || (a.second == b.second && a.first > b.first);
        })->first;
    std::vector<int> diverging;
    for (int r = 0; r < world; ++r) {
      if (report.rank_digests[static_cast<std::size_t>(r)] != majority) diverging.push_back(r);
    }
    report.replicas_identical = diverging.empty();
    if (!diverging.empty()) {
      throw DivergenceError(
          fmt::format("replica digests differ after window {} (majority digest {})", report.window,
                      digest_hex(majority)),
          {.rank = rank, .ranks = diverging});
    }
  }
  report.seconds.verify = seconds_since(start);
}

WindowReport Engine::Impl::run_window() {
  (void)require_transport();
  if (!has_state) {
    throw InvalidArgument("this engine holds no state yet: attach() it to a group first",
                          {.rank = rank});
  }
  const auto start = SteadyClock::now();
  committed_report.reset();
  WindowReport report;
  report.window = window;
  report.mode = options.mode;
  report.rank = rank;
  report.world_size = world;
  report.generation = group.generation;
  report.members = group.members;
  report.parameters = layout.parameters();
  report.steps_per_window = options.steps_per_window;
  report.diloco_bytes = layout.parameters() * sizeof(float);
  report.ddp_bytes = options.steps_per_window * layout.parameters() * sizeof(float);

  const bool tracing = !options.trace_dir.empty();
  if (tracing) write_trace_inputs();
  switch (options.mode) {
    case Mode::pulse:
      run_pulse(report);
      break;
    case Mode::diloco:
      run_diloco(report);
      break;
    case Mode::ddp:
      report.entries_sent = ddp_payload_bytes / sizeof(float);
      report.payload_bytes = ddp_payload_bytes;
      report.received_bytes = ddp_payload_bytes * static_cast<std::uint64_t>(world - 1);
      report.seconds.exchange = ddp_exchange_seconds;
      break;
  }
  // The window has committed on this rank: θ_g, m, e and θ_l hold its results. What follows
  // (digests, the trace) may still fail, but the window is not run again.
  if (options.mode != Mode::ddp) momentum_initialised = true;
  accepted_window.reset();
  steps_in_window = 0;
  ++window;
  // Density: the fraction of the model one exchange carries (ddp: every element, every step).
  report.density = options.mode == Mode::ddp ? 1.0
                   : report.parameters > 0   ? static_cast<double>(report.entries_sent) /
                                                 static_cast<double>(report.parameters)
                                           : 0.0;
  report.digest = compute_state_digest();
  ddp_payload_bytes = 0;
  ddp_exchange_seconds = 0;
  committed_report = report;
  if (tracing) write_trace_outputs(report);
  verify(report);
  committed_report.reset();

  const transport::TransportStats now = transport->stats();
  report.wire_bytes_sent = now.wire_bytes_sent - stats_at_window_start.wire_bytes_sent;
  report.wire_bytes_received = now.wire_bytes_received - stats_at_window_start.wire_bytes_received;
  stats_at_window_start = now;
  // ddp's exchanges happened during the window's steps (average_gradients); count them.
  report.seconds.total =
      seconds_since(start) + (options.mode == Mode::ddp ? report.seconds.exchange : 0.0);
  logger().info("{}", summary_line(report));
  return report;
}

Engine::Engine(std::vector<NamedTensor> parameters, EngineOptions options)
    : impl_(std::make_unique<Impl>(std::move(options), nullptr)) {
  impl_->prepare(std::move(parameters));
  if (impl_->setup_error) std::rethrow_exception(impl_->setup_error);
}

Engine::Engine(std::vector<NamedTensor> parameters, EngineOptions options,
               std::unique_ptr<transport::Transport> transport)
    : impl_(std::make_unique<Impl>(std::move(options), nullptr)) {
  impl_->prepare(std::move(parameters));
  impl_->attach(std::move(transport), GroupInfo{});
}

Engine::~Engine() = default;

void Engine::attach(std::unique_ptr<transport::Transport> transport, GroupInfo group) {
  impl_->attach(std::move(transport), std::move(group));
}

void Engine::detach() noexcept {
  impl_->transport.reset();
}

std::optional<WindowReport> Engine::take_committed_report() {
  return std::exchange(impl_->committed_report, std::nullopt);
}

bool Engine::next_step_runs_window() const noexcept {
  return impl_->steps_in_window + 1 >= impl_->options.steps_per_window;
}

void Engine::save_checkpoint(const std::filesystem::path& dir) {
  impl_->save_checkpoint(dir);
}

void Engine::load_checkpoint(const std::filesystem::path& dir) {
  impl_->load_checkpoint(dir);
}

void Engine::save_global_weights(const std::filesystem::path& file) const {
  impl_->save_global_weights(file);
}

void Engine::load_trace_inputs(const std::filesystem::path& file) {
  impl_->load_trace_inputs(file);
}

std::optional<WindowReport> Engine::after_optimizer_step() {
  if (++impl_->steps_in_window < impl_->options.steps_per_window) return std::nullopt;
  return impl_->run_window();
}

WindowReport Engine::run_window() {
  return impl_->run_window();
}

void Engine::average_gradients(std::span<const TensorView> gradients) {
  impl_->average_gradients(gradients);
}

int Engine::rank() const noexcept {
  return impl_->rank;
}
int Engine::world_size() const noexcept {
  return impl_->world;
}
std::uint64_t Engine::window() const noexcept {
  return impl_->window;
}
std::uint64_t Engine::parameter_count() const noexcept {
  return impl_->layout.parameters();
}
const EngineOptions& Engine::options() const noexcept {
  return impl_->options;
}
transport::Transport& Engine::transport() {
  return impl_->require_transport();
}
const GroupInfo& Engine::group() const noexcept {
  return impl_->group;
}

std::span<const float> Engine::global_weights(std::size_t tensor) const {
  return impl_->tensors.at(tensor).global;
}
std::span<const float> Engine::momentum(std::size_t tensor) const {
  return impl_->tensors.at(tensor).momentum;
}
std::span<const float> Engine::residual(std::size_t tensor) const {
  return impl_->tensors.at(tensor).residual;
}
Digest Engine::state_digest() const {
  return impl_->compute_state_digest();
}

}  // namespace pulseloco
