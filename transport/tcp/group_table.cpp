#include <pulseloco/transport/tcp/group_table.h>

#include <fmt/format.h>

#include <charconv>

#include <pulseloco/base/errors.h>

namespace pulseloco::transport {

PeerAddress parse_peer_address(std::string_view text, std::string_view what) {
  std::string_view host;
  std::string_view port_text;
  if (text.starts_with('[')) {
    const auto close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':')
      throw InvalidArgument(fmt::format("{}: '{}' is not [ipv6]:port", what, text));
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string_view::npos)
      throw InvalidArgument(fmt::format("{}: '{}' is not host:port", what, text));
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  unsigned port = 0;
  const auto [end, error] =
      std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (host.empty() || error != std::errc{} || end != port_text.data() + port_text.size() ||
      port == 0 || port > 65535)
    throw InvalidArgument(
        fmt::format("{}: '{}' is not host:port with a port in 1..65535", what, text));
  if (host.size() > kMaxHostBytes)
    throw InvalidArgument(fmt::format("{}: host name longer than {} bytes", what, kMaxHostBytes));
  return {std::string(host), static_cast<std::uint16_t>(port)};
}

std::string to_string(const PeerAddress& address) {
  if (address.host.find(':') != std::string::npos)
    return fmt::format("[{}]:{}", address.host, address.port);
  return fmt::format("{}:{}", address.host, address.port);
}

}  // namespace pulseloco::transport
