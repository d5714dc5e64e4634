#include <pulseloco/elastic/membership_messages.h>

#include <fmt/format.h>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>

namespace pulseloco::elastic {

std::string encode_message(const Json& message) {
  const std::string body = message.dump(-1, ' ', false, Json::error_handler_t::replace);
  std::string frame(kLengthBytes, '\0');
  store_le(reinterpret_cast<std::byte*>(frame.data()), static_cast<std::uint32_t>(body.size()));
  frame += body;
  return frame;
}

std::uint32_t decode_length(std::span<const std::byte, kLengthBytes> prefix) {
  const auto length = load_le<std::uint32_t>(prefix.data());
  if (length == 0 || length > kMaxMessageBytes)
    throw ProtocolError(fmt::format("a message of {} bytes (membership messages are 1 to {} bytes)",
                                    length, kMaxMessageBytes));
  return length;
}

Json parse_message(std::string_view body) {
  Json message = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (message.is_discarded() || !message.is_object() || !message.contains("type") ||
      !message["type"].is_string())
    throw ProtocolError("a message that is not a JSON object with a string \"type\"");
  return message;
}

std::string string_field(const Json& message, const char* name) {
  const auto it = message.find(name);
  if (it == message.end() || !it->is_string())
    throw ProtocolError(fmt::format("'{}' message without a string '{}'",
                                    message["type"].get<std::string>(), name));
  return it->get<std::string>();
}

std::uint64_t unsigned_field(const Json& message, const char* name) {
  const auto it = message.find(name);
  if (it == message.end() || !it->is_number_unsigned())
    throw ProtocolError(fmt::format("'{}' message without an unsigned integer '{}'",
                                    message["type"].get<std::string>(), name));
  return it->get<std::uint64_t>();
}

std::string check_name(std::string_view name, std::string_view what) {
  if (name.empty()) return fmt::format("the {} is empty", what);
  if (name.size() > kMaxNameBytes)
    return fmt::format("the {} is longer than {} bytes", what, kMaxNameBytes);
  for (const char c : name)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
      return fmt::format("the {} contains a control character", what);
  return {};
}

}  // namespace pulseloco::elastic
