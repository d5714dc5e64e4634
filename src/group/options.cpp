#include <pulseloco/group/options.h>

#include <fmt/format.h>

#include <limits>

#include <pulseloco/base/errors.h>

namespace pulseloco::group {

std::string_view rendezvous_name(RendezvousMethod method) noexcept {
  switch (method) {
    case RendezvousMethod::automatic:
      return "auto";
    case RendezvousMethod::mpi:
      return "mpi";
    case RendezvousMethod::environment:
      return "env";
    case RendezvousMethod::peer_list:
      return "peers";
  }
  return "unknown";
}

void validate(const TransportOptions& options) {
  const auto fail = [](std::string message) { throw InvalidArgument(message); };
  if (options.world_size == 0 || options.world_size < -1)
    fail(
        fmt::format("transport options: world_size {} must be at least 1 (or -1: from the "
                    "rendezvous)",
                    options.world_size));
  if (options.rank < -1)
    fail(
        fmt::format("transport options: rank {} must be at least 0 (or -1: from the "
                    "rendezvous)",
                    options.rank));
  if (options.world_size > 0 && options.rank >= options.world_size)
    fail(fmt::format("transport options: rank {} is not in [0, {})", options.rank,
                     options.world_size));
  if (options.connect_timeout.count() <= 0)
    fail(fmt::format("transport options: connect_timeout {} ms must be positive",
                     options.connect_timeout.count()));
  if (options.external_rendezvous_server && options.master_port == 0 &&
      options.rendezvous == RendezvousMethod::environment)
    fail("transport options: an external rendezvous server needs master_port");
  transport::validate(options.tcp);
  if (options.mpi.part_bytes < 1 ||
      options.mpi.part_bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    fail(fmt::format("transport options: mpi.part_bytes {} is not in [1, {}]",
                     options.mpi.part_bytes, std::numeric_limits<int>::max()));
  if (options.nccl.cuda_device < -1)
    fail("transport options: nccl.cuda_device must be -1 or a device");
}

}  // namespace pulseloco::group
