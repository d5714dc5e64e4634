#include <pulseloco/engine/group_join.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/base/log_lines.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/engine/overlapped_window.h>

namespace pulseloco::engine_detail {
namespace {

// What a member tells the others when it joins: enough to decide who is up to date.
struct MemberStatus {
  bool has_state = false;
  bool momentum_initialised = false;
  std::uint64_t committed_windows = 0;
  Digest digest = 0;
  std::optional<std::uint64_t> accepted_after;  // ReplicatedState::accepted_after()
  // Overlapped windows: window numbers dropped so far, and whether a window is in flight.
  std::uint64_t windows_dropped = 0;
  bool in_flight = false;

  static constexpr std::size_t kBytes = 40;

  [[nodiscard]] std::array<std::byte, kBytes> serialize() const {
    const std::uint64_t flags = (has_state ? 1u : 0u) | (momentum_initialised ? 2u : 0u) |
                                (accepted_after ? 4u : 0u) | (in_flight ? 8u : 0u);
    std::array<std::byte, kBytes> bytes{};
    ByteWriter(bytes)
        .put(flags)
        .put(committed_windows)
        .put(digest)
        .put(accepted_after.value_or(0))
        .put(windows_dropped);
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
    if (flags > 15) {
      throw ProtocolError(fmt::format("membership status has unknown flags {:#x}", flags),
                          {.rank = rank, .peer = sender});
    }
    const auto committed_windows = in.get<std::uint64_t>("committed windows");
    const auto digest = in.get<std::uint64_t>("digest");
    const auto accepted_after = in.get<std::uint64_t>("accepted after");
    const auto windows_dropped = in.get<std::uint64_t>("windows dropped");
    MemberStatus status;
    status.windows_dropped = windows_dropped;
    status.in_flight = (flags & 8u) != 0;
    status.has_state = (flags & 1u) != 0;
    status.momentum_initialised = (flags & 2u) != 0;
    status.committed_windows = committed_windows;
    status.digest = digest;
    if ((flags & 4u) != 0) status.accepted_after = accepted_after;
    return status;
  }
};

// Every rank's `mine` must equal rank 0's; 0 means "this rank failed locally" (then its own
// error is thrown, after the others have learnt of it). Returns the ranks whose value differs
// from rank 0's (the same on every rank).
std::vector<int> disagreeing_ranks(const AttachedGroup& group, std::uint64_t mine,
                                   const std::exception_ptr& local_error) {
  const auto all = collectives::allgather_u64(group.transport(), mine, group.collective());
  if (local_error) std::rethrow_exception(local_error);
  std::vector<int> failed;
  std::vector<int> differing;
  for (int r = 0; r < group.world(); ++r) {
    const std::uint64_t theirs = all[static_cast<std::size_t>(r)];
    if (theirs == 0) {
      failed.push_back(r);
    } else if (theirs != all[0] && all[0] != 0) {
      differing.push_back(r);
    }
  }
  if (!failed.empty()) {
    throw InvalidArgument("these ranks could not start (invalid parameters; see their logs)",
                          {.rank = group.rank(), .ranks = failed});
  }
  return differing;
}

// "1 rank" / "ranks 2, 3".
std::string rank_list(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
}

// Collective, once the options' digests differ: every rank's shared options, and per option that
// differs, every value and the ranks that hold it ("steps_per_window: rank 0 has 8, ranks 2, 3
// have 16").
std::string describe_option_differences(const AttachedGroup& group, const EngineOptions& options) {
  const std::string mine = shared_options(options).dump();
  // The algorithm and chunk may be among the options that differ: fixed ones here, so that
  // every rank moves these bytes the same way.
  collectives::CollectiveOptions exchange = group.collective();
  exchange.algorithm = collectives::CollectiveAlgorithm::ring;
  exchange.pipeline_chunk_bytes = collectives::CollectiveOptions{}.pipeline_chunk_bytes;
  exchange.max_message_bytes = std::uint64_t{1} << 16;  // the options are a few hundred bytes
  const auto texts =
      collectives::sparse_allgather(group.transport(), std::as_bytes(std::span(mine)), exchange);
  std::vector<nlohmann::json> all;
  for (int r = 0; r < group.world(); ++r) {
    const auto& bytes = texts[static_cast<std::size_t>(r)];
    all.push_back(nlohmann::json::parse(
        std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), nullptr,
        /*allow_exceptions=*/false));
    if (!all.back().is_object())
      throw ProtocolError("rank's shared options are not a JSON object",
                          {.rank = group.rank(), .peer = r});
  }
  std::vector<std::string> lines;
  for (const auto& [key, ours] : all[0].items()) {
    // A float is sent twice (decimal and raw bits): name it once, by its decimal key.
    if (key.ends_with("_bits") && all[0].contains(key.substr(0, key.size() - 5))) continue;
    const std::string bits = key + "_bits";
    const auto value_of = [&](const nlohmann::json& theirs) {
      return theirs.contains(key) ? theirs.at(key) : nlohmann::json("<absent>");
    };
    const auto same = [&](const nlohmann::json& a, const nlohmann::json& b) {
      return value_of(a) == value_of(b) &&
             a.value(bits, nlohmann::json()) == b.value(bits, nlohmann::json());
    };
    // Groups of ranks holding the same value, in order of their first rank.
    std::vector<std::vector<int>> holders;
    for (int r = 0; r < group.world(); ++r) {
      auto found = std::find_if(holders.begin(), holders.end(), [&](const auto& ranks) {
        return same(all[static_cast<std::size_t>(ranks.front())], all[static_cast<std::size_t>(r)]);
      });
      if (found == holders.end()) {
        holders.push_back({r});
      } else {
        found->push_back(r);
      }
    }
    if (holders.size() == 1) continue;
    std::vector<std::string> values;
    for (const auto& ranks : holders)
      values.push_back(fmt::format("{} {} {}", rank_list(ranks), ranks.size() == 1 ? "has" : "have",
                                   value_of(all[static_cast<std::size_t>(ranks.front())]).dump()));
    lines.push_back(fmt::format("{}: {}", key, fmt::join(values, ", ")));
  }
  if (lines.empty()) return "the options differ from rank 0's (in an option this build omits)";
  return fmt::format("options differ across ranks: {}", fmt::join(lines, "; "));
}

// "'w' (shape [64, 64], 4096 elements, float32)".
std::string describe_tensor(const nlohmann::json& entry) {
  return fmt::format("'{}' (shape [{}], {} elements, {})", entry.at(0).get<std::string>(),
                     fmt::join(entry.at(3).get<std::vector<std::uint64_t>>(), ", "),
                     entry.at(1).get<std::uint64_t>(), entry.at(2).get<std::string>());
}

// Collective, once the parameter tables' digests differ: every rank's table, and per rank whose
// table differs from rank 0's, the first tensor that differs on both ranks. (The digest covers
// names, element counts and dtypes; shapes are named to help find the tensor.)
std::string describe_table_differences(const AttachedGroup& group, const ReplicatedState& state,
                                       const std::vector<int>& differing) {
  nlohmann::json table = nlohmann::json::array();
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    const TensorInfo& info = state.layout().tensors()[t];
    table.push_back({info.name, info.numel, std::string(dtype_name(info.dtype)), state.shape(t)});
  }
  const std::string mine = table.dump();
  collectives::CollectiveOptions exchange = group.collective();
  exchange.max_message_bytes = std::max<std::uint64_t>(exchange.max_message_bytes, mine.size());
  const auto texts =
      collectives::sparse_allgather(group.transport(), std::as_bytes(std::span(mine)), exchange);
  const auto table_of = [&](int r) {
    const auto& bytes = texts[static_cast<std::size_t>(r)];
    auto parsed = nlohmann::json::parse(
        std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), nullptr,
        /*allow_exceptions=*/false);
    const bool well_formed =
        parsed.is_array() && std::all_of(parsed.begin(), parsed.end(), [](const auto& entry) {
          return entry.is_array() && entry.size() == 4 && entry[0].is_string() &&
                 entry[1].is_number_unsigned() && entry[2].is_string() && entry[3].is_array() &&
                 std::all_of(entry[3].begin(), entry[3].end(),
                             [](const auto& extent) { return extent.is_number_unsigned(); });
        });
    if (!well_formed)
      throw ProtocolError("rank's parameter table is not a JSON array of tensors",
                          {.rank = group.rank(), .peer = r});
    return parsed;
  };
  const nlohmann::json reference = table_of(0);
  std::vector<std::string> lines;
  for (const int r : differing) {
    const nlohmann::json theirs = table_of(r);
    std::size_t i = 0;
    // Name, elements and dtype (what the digest covers; shapes only describe the tensor).
    const auto same = [](const nlohmann::json& a, const nlohmann::json& b) {
      return a[0] == b[0] && a[1] == b[1] && a[2] == b[2];
    };
    while (i < reference.size() && i < theirs.size() && same(reference[i], theirs[i]))
      ++i;
    if (i < reference.size() && i < theirs.size()) {
      lines.push_back(fmt::format("tensor {}: rank 0 has {}, rank {} has {}", i,
                                  describe_tensor(reference[i]), r, describe_tensor(theirs[i])));
    } else if (i < reference.size()) {
      lines.push_back(fmt::format("rank 0 has {} tensors, rank {} has {}; the first missing is {}",
                                  reference.size(), r, theirs.size(),
                                  describe_tensor(reference[i])));
    } else if (i < theirs.size()) {
      lines.push_back(fmt::format("rank 0 has {} tensors, rank {} has {}; the first extra is {}",
                                  reference.size(), r, theirs.size(), describe_tensor(theirs[i])));
    }
  }
  if (lines.empty()) return "parameter tables (names, sizes, dtypes) differ from rank 0's";
  return fmt::format(
      "parameter tables (names, sizes, dtypes) differ from rank 0's: {} (every rank must pass "
      "the same tensors in the same order)",
      fmt::join(lines, "; "));
}

// Sends `buffers` of every tensor from `source` to every rank, tensor by tensor, in pieces of at
// most one bucket (collective). The bucket is staged in host memory: how the state's memory
// splits a range differs between ranks (host or device), the broadcast's pieces must not.
void broadcast_buffers(const AttachedGroup& group, ReplicatedState& state,
                       std::initializer_list<StateBuffer> buffers, int source,
                       std::uint64_t bucket_elements) {
  std::vector<std::byte> bucket;
  for (std::size_t t = 0; t < state.tensor_count(); ++t) {
    const std::uint64_t numel = state.whole(t).count;
    const std::size_t element = dtype_size(state.local_dtype(t));
    for (const StateBuffer buffer : buffers) {
      const std::size_t size = buffer == StateBuffer::local ? element : sizeof(float);
      for (std::uint64_t begin = 0; begin < numel; begin += bucket_elements) {
        const std::uint64_t count = std::min(bucket_elements, numel - begin);
        bucket.resize(count * size);
        if (group.rank() == source) {
          state.read_host(buffer, t, {begin, count},
                          [&](std::uint64_t offset, std::span<const std::byte> piece) {
                            std::memcpy(bucket.data() + offset, piece.data(), piece.size());
                          });
        }
        collectives::broadcast(group.transport(), source, bucket, group.collective());
        if (group.rank() != source) {
          state.update_host(buffer, t, {begin, count},
                            [&](std::uint64_t offset, std::span<std::byte> piece) {
                              std::memcpy(piece.data(), bucket.data() + offset, piece.size());
                            });
        }
      }
    }
  }
}

// The first group of a run: rank 0's θ_l becomes everyone's θ_l and θ_g.
void start_from_rank_0(const AttachedGroup& group, ReplicatedState& state,
                       const EngineOptions& options, ThreadPool& pool) {
  broadcast_buffers(group, state, {StateBuffer::local}, 0, options.bucket_elements);
  if (state.keeps_global_state()) state.global_from_local(pool);  // θ_l = cast(θ_g) holds
  state.zero_residual();
  state.clear_in_flight();
  state.set_windows_dropped(0);
  state.set_progress(0, false);
  state.clear_accepted_window();
  state.set_has_contents(true);
}

// Some member holds state: brings every member to the state of the most advanced ones.
// Returns true when this rank took θ_g and m from another member.
bool catch_up(const AttachedGroup& group, ReplicatedState& state, const EngineOptions& options,
              ThreadPool& pool, const std::vector<MemberStatus>& members) {
  // An up-to-date member's window in flight was never applied (every member drops it: a new
  // group re-forms from committed state); a member behind decides below.
  const int rank = group.rank();
  const int world = group.world();
  if (options.mode == Mode::ddp) {
    throw InvalidArgument(
        "mode ddp keeps no replicated state to hand to new members; elastic membership needs "
        "mode pulse or diloco",
        {.rank = rank});
  }
  // The most windows any member has committed: those members are up to date.
  std::uint64_t latest = 0;
  for (const auto& m : members) {
    if (m.has_state) latest = std::max(latest, m.committed_windows);
  }
  int source = -1;
  std::vector<int> differing;
  for (int r = 0; r < world; ++r) {
    const MemberStatus& m = members[static_cast<std::size_t>(r)];
    if (!m.has_state || m.committed_windows != latest) continue;
    if (source < 0) {
      source = r;
    } else if (m.digest != members[static_cast<std::size_t>(source)].digest) {
      differing.push_back(r);
    }
  }
  if (!differing.empty()) {
    throw DivergenceError(
        fmt::format("members with {} windows committed hold a different θ_g/m than rank {}", latest,
                    source),
        {.rank = rank, .ranks = differing});
  }
  std::vector<int> behind;
  for (int r = 0; r < world; ++r) {
    const MemberStatus& m = members[static_cast<std::size_t>(r)];
    if (!m.has_state || m.committed_windows != latest) behind.push_back(r);
  }
  // Window numbers are never reused: the members at `latest` drop their windows in flight, and
  // every member continues numbering after the highest of them.
  std::uint64_t dropped = 0;
  for (const auto& m : members) {
    if (m.has_state && m.committed_windows == latest) {
      dropped = std::max(dropped, m.windows_dropped + (m.in_flight ? 1u : 0u));
    }
  }
  const bool has_state = state.has_contents();
  const std::uint64_t committed = state.committed_windows();
  const bool up_to_date = has_state && committed == latest;
  if (up_to_date && state.in_flight()) {
    logger().info(
        "window {} was in flight when the group changed: dropped, its entries back "
        "in the residual",
        state.in_flight()->window);
    drop_in_flight(state, pool);
  }
  if (!up_to_date) {
    const bool accepted_the_committed_window =
        has_state && latest > 0 && committed == latest - 1 && state.accepted_after() == committed;
    if (accepted_the_committed_window && state.in_flight()) {
      // Overlapped windows: the committed window is the one this rank had in flight, whose
      // residual was committed when it was gated; its message is in the others' θ_g.
      logger().info(
          "window {} (in flight here) was applied in the old group after this rank had accepted "
          "it: taking θ_g and m from rank {}",
          state.in_flight()->window, source);
      state.clear_in_flight();
    } else if (accepted_the_committed_window && options.mode == Mode::pulse) {
      // The old group committed the window this rank had accepted (its message is in the
      // others' aggregate): commit the residual exactly as the window would have.
      state.commit_residual(pool);
      logger().info(
          "window {} committed in the old group after this rank had accepted it: residual "
          "committed, taking θ_g and m from rank {}",
          state.next_window(), source);
    } else if (!accepted_the_committed_window) {
      if (has_state) {
        logger().warn(
            "this rank has committed {} windows, the group {}: re-synchronising from rank {} "
            "with a zero residual",
            committed, latest, source);
      }
      state.zero_residual();
      state.clear_in_flight();
    }
    // Until the state has arrived, this rank counts as new.
    state.set_has_contents(false);
    state.clear_accepted_window();
  }
  if (!behind.empty()) {
    broadcast_buffers(group, state, {StateBuffer::global, StateBuffer::momentum}, source,
                      options.bucket_elements);
    if (!up_to_date) {
      state.reset_local(pool);
      state.set_progress(latest, members[static_cast<std::size_t>(source)].momentum_initialised);
      state.set_has_contents(true);
    }
    logger().log(
        shared_line_level(group.rank()),
        "group generation {}: ranks {} received θ_g and m ({} windows committed) from rank {}",
        group.generation(), fmt::join(behind, ", "), latest, source);
  }
  state.clear_accepted_window();
  state.set_windows_dropped(dropped);
  return !up_to_date && !behind.empty();
}

}  // namespace

bool join_group(const AttachedGroup& group, ReplicatedState& state, const EngineOptions& options,
                ThreadPool& pool, const std::exception_ptr& setup_error) {
  // A rank with invalid parameters still takes part in the agreement rounds, so that every rank
  // fails at once instead of waiting for it until the timeout.
  if (auto differing = disagreeing_ranks(
          group, setup_error ? 0 : shared_options_digest(options) | 1u, setup_error);
      !differing.empty())
    throw InvalidArgument(describe_option_differences(group, options),
                          {.rank = group.rank(), .ranks = differing});
  if (auto differing = disagreeing_ranks(group, state.layout().table_digest() | 1u, nullptr);
      !differing.empty())
    throw InvalidArgument(describe_table_differences(group, state, differing),
                          {.rank = group.rank(), .ranks = differing});

  MemberStatus mine;
  mine.has_state = state.has_contents();
  mine.momentum_initialised = state.momentum_initialised();
  mine.committed_windows = state.committed_windows();
  mine.digest = mine.has_state ? state.digest(pool) : 0;
  mine.accepted_after = state.accepted_after();
  mine.windows_dropped = state.windows_dropped();
  mine.in_flight = state.in_flight().has_value();
  const auto record = mine.serialize();
  const auto records = collectives::sparse_allgather(group.transport(), record, group.collective());
  std::vector<MemberStatus> members;
  for (int r = 0; r < group.world(); ++r) {
    members.push_back(
        MemberStatus::deserialize(records[static_cast<std::size_t>(r)], r, group.rank()));
  }

  bool took_state = false;
  if (std::none_of(members.begin(), members.end(), [](const auto& m) { return m.has_state; })) {
    start_from_rank_0(group, state, options, pool);
  } else {
    took_state = catch_up(group, state, options, pool, members);
  }

  // Every member must now hold the same θ_g and m.
  const auto digests =
      collectives::allgather_u64(group.transport(), state.digest(pool), group.collective());
  std::vector<int> diverging;
  for (int r = 0; r < group.world(); ++r) {
    if (digests[static_cast<std::size_t>(r)] != digests[0]) diverging.push_back(r);
  }
  if (!diverging.empty()) {
    throw DivergenceError("after attaching, these ranks hold a different θ_g/m than rank 0",
                          {.rank = group.rank(), .ranks = diverging});
  }
  return took_state;
}

}  // namespace pulseloco::engine_detail
