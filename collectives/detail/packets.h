// The wire packets of a collective call: the tags it sends under, the header every rank
// announces at its start, and the notices of its completion round and failure path. Fixed
// little-endian layouts written and read with base/byte_io.h. Internal to collectives/.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include <pulseloco/base/errors.h>
#include <pulseloco/collectives/collectives.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::collectives::detail {

enum class Op : std::uint8_t {
  sparse_allgather = 1,
  allreduce_sum = 2,
  broadcast = 3,
  barrier = 4,
  allgather_u64 = 5,
  sparse_alltoall = 6,
};
[[nodiscard]] std::string_view op_name(Op op) noexcept;

// The low byte of every tag of a call.
enum class Phase : std::uint8_t {
  header = 1,
  notice = 2,
  payload = 3,         // sparse all-gather, all-to-all and broadcast
  reduce_scatter = 4,  // all-reduce
  gather = 5,          // all-reduce's all-gather phase
  diagnosis = 6,       // headers re-sent to every rank to name the culprit of a disagreement
  sizes = 7,           // all-to-all: the size of the message meant for the receiver
};

// Tag of (base tag, call sequence number, phase); bit 63 marks collective traffic.
[[nodiscard]] transport::Tag make_tag(transport::Tag base, std::uint64_t sequence, Phase phase);

// What every rank announces at the start of a call.
struct Header {
  static constexpr std::size_t kBytes = 40;
  using Bytes = std::array<std::byte, kBytes>;

  Op op = Op::barrier;
  CollectiveAlgorithm algorithm = CollectiveAlgorithm::automatic;
  std::int32_t root = 0;
  std::uint64_t sequence = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint64_t value = 0;  // message size, element count, data size or the gathered value

  [[nodiscard]] Bytes encode() const;
  // Throws ProtocolError naming `peer` when the bytes are not a header.
  [[nodiscard]] static Header decode(std::span<const std::byte, kBytes> bytes, int rank, int peer);
};

enum class NoticeType : std::uint8_t {
  done = 1,     // the sender finished its part of the call
  suspect = 2,  // the sender timed out waiting on `subject` (which may itself be waiting)
  culprit = 3,  // the sender concluded that `subject` failed with error kind `kind`
  aborted = 4,  // the sender abandons the call because of a local error
  // The sender's left neighbour called with other arguments (headers exchanged with the left
  // neighbour only): every rank sends its header to every rank (Phase::diagnosis) so that all
  // name the same culprit; the sender's verdict follows as a culprit notice.
  disagreement = 5,
};
inline constexpr std::size_t kNoticeTypes = 5;

// A rank's word to every peer about one call (Phase::notice).
struct Notice {
  static constexpr std::size_t kBytes = 24;
  using Bytes = std::array<std::byte, kBytes>;

  NoticeType type = NoticeType::done;
  ErrorKind kind = ErrorKind::peer_lost;
  std::int32_t reporter = 0;
  std::int32_t subject = 0;
  std::uint64_t sequence = 0;

  // Culprit and aborted notices end what a peer says about a call; others may be followed.
  [[nodiscard]] bool terminal() const noexcept {
    return type == NoticeType::culprit || type == NoticeType::aborted;
  }
  [[nodiscard]] Bytes encode() const;
  // Throws ProtocolError naming `peer` when the bytes are not a valid notice from `peer` for
  // call `sequence` of a group of `world_size`.
  [[nodiscard]] static Notice decode(std::span<const std::byte, kBytes> bytes, int rank, int peer,
                                     int world_size, std::uint64_t sequence);
};

}  // namespace pulseloco::collectives::detail
