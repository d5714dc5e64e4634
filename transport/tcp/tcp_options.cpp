#include <pulseloco/transport/tcp/tcp_options.h>

#include <fmt/format.h>

#include <pulseloco/base/errors.h>

namespace pulseloco::transport {

LinkSecurity effective_link_security(LinkSecurity requested, const std::string& secret,
                                     const TlsFiles& tls_files) noexcept {
  switch (requested) {
    case LinkSecurity::automatic:
      return secret.empty() && tls_files.empty() ? LinkSecurity::none : LinkSecurity::tls;
    case LinkSecurity::hmac:
      return secret.empty() ? LinkSecurity::none : LinkSecurity::hmac;
    case LinkSecurity::none:
    case LinkSecurity::tls:
      break;
  }
  return requested;
}

LinkSecurity effective_link_security(const TcpOptions& options) noexcept {
  return effective_link_security(options.link_security, options.secret, options.tls_files);
}

const char* to_string(LinkSecurity security) noexcept {
  switch (security) {
    case LinkSecurity::automatic:
      return "automatic";
    case LinkSecurity::none:
      return "none";
    case LinkSecurity::hmac:
      return "hmac";
    case LinkSecurity::tls:
      return "tls";
  }
  return "?";
}

void validate_link_security(LinkSecurity requested, const std::string& secret,
                            const TlsFiles& tls_files) {
  const bool some = !tls_files.cert.empty() || !tls_files.key.empty() || !tls_files.ca.empty();
  const bool all = !tls_files.cert.empty() && !tls_files.key.empty() && !tls_files.ca.empty();
  if (some && !all)
    throw InvalidArgument(fmt::format(
        "link security: PULSELOCO_TLS_CERT, PULSELOCO_TLS_KEY and PULSELOCO_TLS_CA go together "
        "(certificate '{}', key '{}', CA '{}')",
        tls_files.cert, tls_files.key, tls_files.ca));
  if (requested == LinkSecurity::tls && secret.empty() && tls_files.empty())
    throw InvalidArgument(
        "link security: tls needs a shared secret (PULSELOCO_SECRET or PULSELOCO_SECRET_FILE) or "
        "certificates (PULSELOCO_TLS_CERT, PULSELOCO_TLS_KEY, PULSELOCO_TLS_CA)");
  if (requested == LinkSecurity::hmac && some)
    throw InvalidArgument(
        "link security: hmac does not use certificates; unset PULSELOCO_TLS_CERT, _KEY and _CA "
        "or choose tls");
}

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
  validate_link_security(options.link_security, options.secret, options.tls_files);
  // A plaintext link is authenticated by the secret's HMAC handshake alone; with certificates
  // and no secret, that handshake's key would be empty and anyone on the host could join.
  if (options.same_host_plaintext && options.secret.empty() &&
      effective_link_security(options) == LinkSecurity::tls)
    fail(
        "transport options: same-host plaintext links (PULSELOCO_SAME_HOST_PLAINTEXT) need a "
        "shared secret (PULSELOCO_SECRET or PULSELOCO_SECRET_FILE): with certificates alone they "
        "would be unauthenticated");
}

}  // namespace pulseloco::transport
