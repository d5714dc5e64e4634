// Rendezvous: how the ranks of a TCP group learn each other's listening addresses.
//
//  - environment (torchrun style): a RendezvousServer (rendezvous_server.h) at
//    master_addr:master_port (hosted by rank 0, or run elsewhere with
//    external_rendezvous_server) collects every rank's address and sends the full table to all
//    of them. Every connection to it is authenticated with the shared secret, so a stranger
//    cannot register or read the table.
//  - peer_list: the table is given ("host:port" per rank).
//  - mpi: MPI_Allgather over MPI_COMM_WORLD (needs the MPI backend linked).
// Each method also yields a 16-byte group id that every data connection presents, so that a
// process of another group (an earlier run, say) cannot join by mistake.
#pragma once

#include <cstdint>
#include <string>

#include <pulseloco/group/options.h>
#include <pulseloco/transport/tcp/group_table.h>

namespace pulseloco::group {

// Environment rendezvous client: registers (rank, advertised address) with the server at
// master_addr:master_port (retrying until the connect deadline) and returns the group table.
// `listen_port` is the port of this rank's data listener; the advertised host is
// options.advertise_addr, else options.socket_ifname's address, else the local address of the
// connection to the server. Hosts the server itself on rank 0 unless
// options.external_rendezvous_server; when that rendezvous fails, rank 0 throws its failure once
// the server has lingered for the ranks still on their way (kFailedRendezvousLinger at most).
[[nodiscard]] transport::GroupTable environment_rendezvous(const TransportOptions& options,
                                                           std::uint16_t listen_port);

// peer_list rendezvous: the table is options.peers; the group id is derived from it.
[[nodiscard]] transport::GroupTable peer_list_rendezvous(const TransportOptions& options);

// MPI rendezvous (MPI_COMM_WORLD); initialises MPI when needed. Throws InvalidArgument when the
// MPI backend is not linked into this program (or not built).
[[nodiscard]] transport::GroupTable mpi_rendezvous(const TransportOptions& options,
                                                   std::uint16_t listen_port);

// The method `automatic` resolves to for these options in this process.
[[nodiscard]] RendezvousMethod resolve_rendezvous(const TransportOptions& options);

// True when this process was started by mpirun/mpiexec (OpenMPI, MPICH/PMI or PMIx variables).
[[nodiscard]] bool launched_by_mpi() noexcept;

// True when the MPI launcher's variables say every rank runs on this node (local size equals
// world size).
[[nodiscard]] bool mpi_launcher_reports_one_host() noexcept;

// IPv4 address of a network interface ("eth0"); throws InvalidArgument when it has none.
[[nodiscard]] std::string interface_address(const std::string& ifname);

}  // namespace pulseloco::group
