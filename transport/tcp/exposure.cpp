#include <pulseloco/transport/tcp/exposure.h>

#include <fmt/format.h>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/transport/tcp/asio_util.h>

namespace pulseloco::transport::tcp {

bool is_loopback_host(std::string_view host) {
  if (host == "localhost") return true;
  boost::system::error_code error;
  const auto address = asio::ip::make_address(std::string(host), error);
  return !error && address.is_loopback();
}

void require_authentication_beyond_loopback(std::string_view owner, const std::string& host,
                                            LinkSecurity security, bool allow_insecure) {
  if (security != LinkSecurity::none || is_loopback_host(host)) return;
  const std::string where = host.empty() ? std::string("every interface") : host;
  if (allow_insecure) {
    logger().warn(
        "{}: listening on {} without a shared secret (insecure mode): anyone who can reach the "
        "port can join this job",
        owner, where);
    return;
  }
  throw InvalidArgument(fmt::format(
      "{}: refusing to listen on {} without a shared secret: anyone who can reach the port could "
      "join this job. Set the same secret on every process (PULSELOCO_SECRET, or "
      "PULSELOCO_SECRET_FILE naming a file whose first line is the secret) or certificates "
      "(PULSELOCO_TLS_CERT, PULSELOCO_TLS_KEY, PULSELOCO_TLS_CA), listen on loopback "
      "(PULSELOCO_LISTEN_ADDR=127.0.0.1, coordinator --host 127.0.0.1) for a single-host run, or "
      "accept the risk on a trusted network with PULSELOCO_ALLOW_INSECURE=1 (coordinator "
      "--insecure)",
      owner, where));
}

}  // namespace pulseloco::transport::tcp
