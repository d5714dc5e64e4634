// Internal: secure by default. A server that listens beyond loopback without a shared secret
// lets anyone who reaches its port join the job (take a rank, receive the weights), so every
// listening socket (the TCP transport's data listener, the rendezvous server, the elastic
// coordinator) is opened only after this check.
#pragma once

#include <string>
#include <string_view>

#include <pulseloco/transport/tcp/tcp_options.h>

namespace pulseloco::transport::tcp {

// Whether `host` names a loopback address (127.0.0.0/8, ::1, "localhost"). The empty host and
// the wildcards (0.0.0.0, ::) mean every interface: not loopback.
[[nodiscard]] bool is_loopback_host(std::string_view host);

// Throws InvalidArgument, naming `owner` and `host` and saying how to set a secret, when a
// server would listen on `host` beyond loopback with links that authenticate nobody
// (`security`, as effective_link_security() gives it, is none: no secret and no certificates),
// unless `allow_insecure`; then it logs a warning instead.
void require_authentication_beyond_loopback(std::string_view owner, const std::string& host,
                                            LinkSecurity security, bool allow_insecure);

}  // namespace pulseloco::transport::tcp
