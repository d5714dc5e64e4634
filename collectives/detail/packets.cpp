#include <pulseloco/collectives/detail/packets.h>

#include <fmt/format.h>

#include <pulseloco/base/byte_io.h>

namespace pulseloco::collectives::detail {

namespace {

constexpr std::uint32_t kHeaderMagic = 0x48434C50;  // "PLCH"
constexpr std::uint32_t kNoticeMagic = 0x4E434C50;  // "PLCN"
constexpr std::uint8_t kWireVersion = 1;

}  // namespace

std::string_view op_name(Op op) noexcept {
  switch (op) {
    case Op::sparse_allgather:
      return "sparse_allgather";
    case Op::allreduce_sum:
      return "allreduce_sum";
    case Op::broadcast:
      return "broadcast";
    case Op::barrier:
      return "barrier";
    case Op::allgather_u64:
      return "allgather_u64";
    case Op::sparse_alltoall:
      return "sparse_alltoall";
  }
  return "unknown collective";
}

transport::Tag make_tag(transport::Tag base, std::uint64_t sequence, Phase phase) {
  PULSELOCO_CHECK(base < kTagLimit, "base tag out of range");
  return (transport::Tag{1} << 63) | (base << 40) | ((sequence & 0xFFFF'FFFFULL) << 8) |
         static_cast<transport::Tag>(phase);
}

Header::Bytes Header::encode() const {
  Bytes out{};
  ByteWriter(out)
      .put(kHeaderMagic)
      .put(kWireVersion)
      .put(static_cast<std::uint8_t>(op))
      .put(static_cast<std::uint8_t>(algorithm))
      .zeros(1)
      .put(root)
      .zeros(4)
      .put(sequence)
      .put(chunk_bytes)
      .put(value);
  return out;
}

Header Header::decode(std::span<const std::byte, kBytes> bytes, int rank, int peer) {
  const ErrorContext context{.rank = rank, .peer = peer};
  ByteReader in(bytes, context);
  const auto magic = in.get<std::uint32_t>("magic");
  const auto version = in.get<std::uint8_t>("version");
  if (magic != kHeaderMagic || version != kWireVersion) {
    throw ProtocolError(
        fmt::format("peer {} sent something that is not a version-{} collective header", peer,
                    kWireVersion),
        context);
  }
  const auto op = in.get<std::uint8_t>("operation");
  const auto algorithm = in.get<std::uint8_t>("algorithm");
  if (op < static_cast<std::uint8_t>(Op::sparse_allgather) ||
      op > static_cast<std::uint8_t>(Op::sparse_alltoall) ||
      algorithm > static_cast<std::uint8_t>(CollectiveAlgorithm::direct)) {
    throw ProtocolError(fmt::format("peer {} sent a collective header with operation {} and "
                                    "algorithm {}, which do not exist",
                                    peer, op, algorithm),
                        context);
  }
  in.skip(1, "padding");
  Header header{.op = static_cast<Op>(op),
                .algorithm = static_cast<CollectiveAlgorithm>(algorithm)};
  header.root = in.get<std::int32_t>("root");
  in.skip(4, "padding");
  header.sequence = in.get<std::uint64_t>("sequence");
  header.chunk_bytes = in.get<std::uint64_t>("chunk size");
  header.value = in.get<std::uint64_t>("value");
  return header;
}

Notice::Bytes Notice::encode() const {
  Bytes out{};
  ByteWriter(out)
      .put(kNoticeMagic)
      .put(kWireVersion)
      .put(static_cast<std::uint8_t>(type))
      .put(static_cast<std::uint8_t>(kind))
      .zeros(1)
      .put(reporter)
      .put(subject)
      .put(sequence);
  return out;
}

Notice Notice::decode(std::span<const std::byte, kBytes> bytes, int rank, int peer, int world_size,
                      std::uint64_t sequence) {
  const ErrorContext context{.rank = rank, .peer = peer};
  ByteReader in(bytes, context);
  const auto magic = in.get<std::uint32_t>("magic");
  const auto version = in.get<std::uint8_t>("version");
  const auto type = in.get<std::uint8_t>("notice type");
  const auto kind = in.get<std::uint8_t>("error kind");
  in.skip(1, "padding");
  Notice notice{.type = static_cast<NoticeType>(type), .kind = static_cast<ErrorKind>(kind)};
  notice.reporter = in.get<std::int32_t>("reporter");
  notice.subject = in.get<std::int32_t>("subject");
  notice.sequence = in.get<std::uint64_t>("sequence");
  const bool valid = magic == kNoticeMagic && version == kWireVersion &&
                     type >= static_cast<std::uint8_t>(NoticeType::done) &&
                     type <= static_cast<std::uint8_t>(NoticeType::disagreement) &&
                     kind <= static_cast<std::uint8_t>(ErrorKind::non_finite) &&
                     notice.reporter == peer && notice.subject >= 0 &&
                     notice.subject < world_size && notice.sequence == sequence;
  if (!valid) {
    throw ProtocolError(
        fmt::format("peer {} sent an invalid completion/failure notice for call #{}", peer,
                    sequence),
        context);
  }
  return notice;
}

}  // namespace pulseloco::collectives::detail
