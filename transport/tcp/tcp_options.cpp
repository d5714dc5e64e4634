#include <pulseloco/transport/tcp/tcp_options.h>

#include <fmt/format.h>

#include <pulseloco/base/errors.h>

namespace pulseloco::transport {

void validate(const TcpOptions& options) {
  const auto fail = [](std::string message) { throw InvalidArgument(message); };
  if (options.connections_per_peer < 1 || options.connections_per_peer > 64)
    fail(fmt::format("transport options: connections_per_peer {} is not in [1, 64]",
                     options.connections_per_peer));
  if (options.stripe_chunk_bytes < 4096)
    fail(fmt::format("transport options: stripe_chunk_bytes {} is below 4096",
                     options.stripe_chunk_bytes));
  if (options.socket_send_buffer_bytes < 0 || options.socket_receive_buffer_bytes < 0)
    fail("transport options: socket buffer sizes must not be negative");
  if (options.keepalive_idle_s < 1 || options.keepalive_interval_s < 1 ||
      options.keepalive_count < 1)
    fail("transport options: keepalive idle, interval and count must be at least 1");
  if (options.io_timeout.count() < 0)
    fail(fmt::format("transport options: io_timeout {} ms must not be negative",
                     options.io_timeout.count()));
  if (options.io_threads < 1 || options.io_threads > 64)
    fail(fmt::format("transport options: io_threads {} is not in [1, 64]", options.io_threads));
  if (options.busy_poll.count() < 0 || options.busy_poll.count() > 1'000'000)
    fail(fmt::format("transport options: busy_poll {} us is not in [0, 1000000]",
                     options.busy_poll.count()));
}

}  // namespace pulseloco::transport
