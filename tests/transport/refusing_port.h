// A loopback port that refuses connections for as long as the object lives: bound, never
// listening. A test that needs "nobody listens there" holds one, because a port it closed could
// be taken meanwhile by a listener of another test running beside it.
#pragma once

#include <netinet/in.h>
#include <sys/socket.h>

#include <cstdint>

#include <pulseloco/base/unique_fd.h>

namespace pulseloco::testing {

class RefusingPort {
 public:
  // Binds 127.0.0.1:port (0: any free port); bound() says whether that succeeded.
  explicit RefusingPort(std::uint16_t port = 0) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    if (fd_.get() < 0) return;
    const int on = 1;
    (void)::setsockopt(fd_.get(), SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd_.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0) return;
    socklen_t size = sizeof address;
    if (::getsockname(fd_.get(), reinterpret_cast<sockaddr*>(&address), &size) != 0) return;
    port_ = ntohs(address.sin_port);
  }

  [[nodiscard]] bool bound() const noexcept { return port_ != 0; }
  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }

 private:
  UniqueFd fd_;
  std::uint16_t port_ = 0;
};

}  // namespace pulseloco::testing
