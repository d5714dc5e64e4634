// Forming a group and creating its transport: the one factory.
//
//   auto options = group::from_environment();     // options.h
//   std::unique_ptr<transport::Transport> t = group::make_transport(options);
//
// make_transport() blocks until the whole group is connected (and, for TCP, every connection
// authenticated) or options.connect_timeout passes. Once the group has formed, the library's
// log lines name this process's rank ("[rank N]"), unless the program chose a tag itself with
// set_log_rank() (<pulseloco/base/log.h>).
//
// TCP is always available; MPI and NCCL only in programs linked with pulseloco::transport_mpi
// and pulseloco::transport_nccl (<pulseloco/transport/backend_registry.h>).
#pragma once

#include <memory>

#include <pulseloco/group/options.h>
#include <pulseloco/transport/tcp/tcp_transport.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::group {

// Creates and connects a transport of options.backend. Throws InvalidArgument (bad options, a
// backend not linked into this program or not built), TimeoutError (a rank did not join in
// time, naming it), ProtocolError (authentication failed, naming the peer) or IoError.
[[nodiscard]] std::unique_ptr<transport::Transport> make_transport(const TransportOptions& options);

// The same for the TCP backend whatever options.backend says, as its own type (for its
// statistics and test hooks).
[[nodiscard]] std::unique_ptr<transport::TcpTransport> make_tcp_transport(
    const TransportOptions& options);

}  // namespace pulseloco::group
