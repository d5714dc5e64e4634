#include <pulseloco/group/rendezvous_messages.h>

#include <fmt/format.h>

#include <pulseloco/base/byte_io.h>

namespace pulseloco::group {
namespace {

constexpr std::uint8_t kTableOk = 0;
constexpr std::size_t kMaxFailureBytes = 60000;

constexpr std::size_t address_bytes(const transport::PeerAddress& address) {
  return sizeof(std::uint16_t) + sizeof(std::uint8_t) + address.host.size();
}

void put_address(ByteWriter& out, const transport::PeerAddress& address) {
  out.put(address.port)
      .put(static_cast<std::uint8_t>(address.host.size()))
      .put_bytes(std::as_bytes(std::span(address.host)));
}

std::string read_text(ByteReader& in, std::size_t bytes, std::string_view field) {
  const auto text = in.take(bytes, field);
  return {reinterpret_cast<const char*>(text.data()), text.size()};
}

}  // namespace

std::vector<std::byte> encode_registration(const transport::PeerAddress& address) {
  std::vector<std::byte> out(address_bytes(address));
  ByteWriter writer(out);
  put_address(writer, address);
  return out;
}

RegistrationHead decode_registration_head(
    std::span<const std::byte, kRegistrationHeadBytes> bytes) {
  ByteReader in(bytes);
  RegistrationHead head;
  head.port = in.get<std::uint16_t>("registered port");
  head.host_bytes = in.get<std::uint8_t>("registered host length");
  return head;
}

std::vector<std::byte> encode_table(const transport::GroupId& group_id,
                                    const std::vector<transport::PeerAddress>& peers) {
  std::size_t bytes = sizeof(kTableOk) + group_id.size() + sizeof(std::uint32_t);
  for (const auto& peer : peers)
    bytes += address_bytes(peer);
  std::vector<std::byte> out(bytes);
  ByteWriter writer(out);
  writer.put(kTableOk).put_bytes(group_id).put(static_cast<std::uint32_t>(peers.size()));
  for (const auto& peer : peers)
    put_address(writer, peer);
  return out;
}

std::vector<std::byte> encode_failure(RendezvousFailure why, std::string_view message) {
  const std::string_view text = message.substr(0, kMaxFailureBytes);
  std::vector<std::byte> out(sizeof(why) + sizeof(std::uint16_t) + text.size());
  ByteWriter(out)
      .put(why)
      .put(static_cast<std::uint16_t>(text.size()))
      .put_bytes(std::as_bytes(std::span(text)));
  return out;
}

TableReply decode_table_reply(std::span<const std::byte> bytes, ErrorContext context) {
  ByteReader in(bytes, std::move(context));
  TableReply reply;
  const auto status = in.get<std::uint8_t>("rendezvous reply status");
  if (status == static_cast<std::uint8_t>(RendezvousFailure::timed_out) ||
      status == static_cast<std::uint8_t>(RendezvousFailure::refused_member)) {
    reply.why = static_cast<RendezvousFailure>(status);
    reply.failure =
        read_text(in, in.get<std::uint16_t>("rendezvous failure length"), "rendezvous failure");
    return reply;
  }
  if (status != kTableOk)
    throw ProtocolError(fmt::format("unknown rendezvous reply status {}", status), in.context());
  reply.ok = true;
  in.get_bytes(reply.group_id, "group id");
  const auto count = in.get<std::uint32_t>("rendezvous table ranks");
  for (std::uint32_t rank = 0; rank < count; ++rank) {
    transport::PeerAddress address;
    address.port = in.get<std::uint16_t>("rendezvous table port");
    address.host = read_text(in, in.get<std::uint8_t>("rendezvous table host length"),
                             "rendezvous table host");
    reply.peers.push_back(std::move(address));
  }
  return reply;
}

}  // namespace pulseloco::group
