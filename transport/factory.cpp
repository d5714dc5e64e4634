#include <pulseloco/transport/factory.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <limits>

#include <pulseloco/build_config.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/transport/tcp/tcp_transport.h>

#if PULSELOCO_TRANSPORT_MPI
#include <pulseloco/transport/mpi/mpi_transport.h>
#endif
#if PULSELOCO_TRANSPORT_NCCL
#include <pulseloco/transport/nccl/nccl_transport.h>
#endif

namespace pulseloco::transport {
namespace {

struct EnvValue {
  std::string name;
  std::string value;
};

// The first of `names` that is set to a non-empty value.
std::optional<EnvValue> first_env(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* value = std::getenv(name);
    if (value != nullptr && *value != '\0') return EnvValue{name, value};
  }
  return std::nullopt;
}

std::string lower(std::string_view text) {
  std::string out(text);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

long long parse_integer(const EnvValue& env, long long min, long long max) {
  long long value = 0;
  const auto* begin = env.value.data();
  const auto* end = begin + env.value.size();
  const auto [stop, error] = std::from_chars(begin, end, value);
  if (error != std::errc{} || stop != end || value < min || value > max)
    throw InvalidArgument(
        fmt::format("{}='{}' is not an integer in [{}, {}]", env.name, env.value, min, max));
  return value;
}

std::size_t parse_size(const EnvValue& env) {
  std::string_view text = env.value;
  std::size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits])) != 0)
    ++digits;
  const std::string suffix = lower(text.substr(digits));
  std::uint64_t unit = 1;
  if (suffix.empty() || suffix == "b") {
    unit = 1;
  } else if (suffix == "k" || suffix == "kib") {
    unit = std::uint64_t{1} << 10;
  } else if (suffix == "m" || suffix == "mib") {
    unit = std::uint64_t{1} << 20;
  } else if (suffix == "g" || suffix == "gib") {
    unit = std::uint64_t{1} << 30;
  } else {
    digits = 0;  // reported below
  }
  std::uint64_t value = 0;
  const auto [stop, error] = std::from_chars(text.data(), text.data() + digits, value);
  if (digits == 0 || error != std::errc{} || stop != text.data() + digits ||
      value > std::numeric_limits<std::uint64_t>::max() / unit)
    throw InvalidArgument(
        fmt::format("{}='{}' is not a size (bytes, optionally with K, M or G: 64K, 4M, 1G)",
                    env.name, env.value));
  return static_cast<std::size_t>(value * unit);
}

bool parse_bool(const EnvValue& env) {
  const std::string value = lower(env.value);
  if (value == "1" || value == "true" || value == "yes" || value == "on") return true;
  if (value == "0" || value == "false" || value == "no" || value == "off") return false;
  throw InvalidArgument(fmt::format("{}='{}' is not a boolean (1/0, true/false, yes/no, on/off)",
                                    env.name, env.value));
}

std::vector<std::string> split_list(std::string_view text) {
  std::vector<std::string> parts;
  while (!text.empty()) {
    const auto comma = text.find(',');
    auto part = text.substr(0, comma);
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.front())) != 0)
      part.remove_prefix(1);
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.back())) != 0)
      part.remove_suffix(1);
    if (!part.empty()) parts.emplace_back(part);
    if (comma == std::string_view::npos) break;
    text.remove_prefix(comma + 1);
  }
  return parts;
}

}  // namespace

std::string_view backend_name(Backend backend) noexcept {
  switch (backend) {
    case Backend::tcp:
      return "tcp";
    case Backend::mpi:
      return "mpi";
    case Backend::nccl:
      return "nccl";
  }
  return "unknown";
}

std::optional<Backend> parse_backend(std::string_view name) noexcept {
  if (name == "tcp") return Backend::tcp;
  if (name == "mpi") return Backend::mpi;
  if (name == "nccl") return Backend::nccl;
  return std::nullopt;
}

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

bool launched_by_mpi() noexcept {
  return first_env({"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}).has_value();
}

bool backend_available(Backend backend) noexcept {
  switch (backend) {
    case Backend::tcp:
      return true;
    case Backend::mpi:
      return PULSELOCO_TRANSPORT_MPI != 0;
    case Backend::nccl:
      return PULSELOCO_TRANSPORT_NCCL != 0;
  }
  return false;
}

TransportOptions from_environment(TransportOptions options) {
  if (auto env = first_env({"PULSELOCO_TRANSPORT"})) {
    const auto backend = parse_backend(lower(env->value));
    if (!backend)
      throw InvalidArgument(
          fmt::format("{}='{}' is not a transport (tcp, mpi, nccl)", env->name, env->value));
    options.backend = *backend;
  }
  if (auto env = first_env({"PULSELOCO_RENDEZVOUS"})) {
    const std::string value = lower(env->value);
    if (value == "auto") {
      options.rendezvous = RendezvousMethod::automatic;
    } else if (value == "mpi") {
      options.rendezvous = RendezvousMethod::mpi;
    } else if (value == "env") {
      options.rendezvous = RendezvousMethod::environment;
    } else if (value == "peers") {
      options.rendezvous = RendezvousMethod::peer_list;
    } else {
      throw InvalidArgument(fmt::format(
          "{}='{}' is not a rendezvous method (auto, mpi, env, peers)", env->name, env->value));
    }
  }
  constexpr long long kMaxRanks = 1 << 20;
  if (auto env = first_env({"PULSELOCO_RANK", "RANK"}))
    options.rank = static_cast<int>(parse_integer(*env, 0, kMaxRanks - 1));
  if (auto env = first_env({"PULSELOCO_WORLD_SIZE", "WORLD_SIZE"}))
    options.world_size = static_cast<int>(parse_integer(*env, 1, kMaxRanks));
  if (auto env = first_env({"PULSELOCO_MASTER_ADDR", "MASTER_ADDR"}))
    options.master_addr = env->value;
  if (auto env = first_env({"PULSELOCO_MASTER_PORT", "MASTER_PORT"}))
    options.master_port = static_cast<std::uint16_t>(parse_integer(*env, 1, 65535));
  if (auto env = first_env({"PULSELOCO_RENDEZVOUS_EXTERNAL"}))
    options.external_rendezvous_server = parse_bool(*env);
  if (auto env = first_env({"PULSELOCO_PEERS"})) options.peers = split_list(env->value);
  if (auto env = first_env({"PULSELOCO_GROUP_KEY"})) options.group_key = env->value;
  if (auto env = first_env({"PULSELOCO_LISTEN_ADDR"})) options.listen_addr = env->value;
  if (auto env = first_env({"PULSELOCO_LISTEN_PORT"}))
    options.listen_port = static_cast<std::uint16_t>(parse_integer(*env, 0, 65535));
  if (auto env = first_env({"PULSELOCO_ADVERTISE_ADDR"})) options.advertise_addr = env->value;
  if (auto env = first_env({"PULSELOCO_SOCKET_IFNAME"})) options.socket_ifname = env->value;

  if (auto env = first_env({"PULSELOCO_TCP_CONNECTIONS"}))
    options.connections_per_peer = static_cast<int>(parse_integer(*env, 1, 64));
  if (auto env = first_env({"PULSELOCO_TCP_STRIPE_THRESHOLD"}))
    options.stripe_threshold_bytes = parse_size(*env);
  if (auto env = first_env({"PULSELOCO_TCP_STRIPE_CHUNK"}))
    options.stripe_chunk_bytes = parse_size(*env);
  if (auto env = first_env({"PULSELOCO_TCP_NODELAY"})) options.tcp_nodelay = parse_bool(*env);
  if (auto env = first_env({"PULSELOCO_TCP_SNDBUF"}))
    options.socket_send_buffer_bytes =
        static_cast<int>(std::min<std::size_t>(parse_size(*env), std::numeric_limits<int>::max()));
  if (auto env = first_env({"PULSELOCO_TCP_RCVBUF"}))
    options.socket_receive_buffer_bytes =
        static_cast<int>(std::min<std::size_t>(parse_size(*env), std::numeric_limits<int>::max()));
  if (auto env = first_env({"PULSELOCO_TCP_KEEPALIVE"})) options.keepalive = parse_bool(*env);
  if (auto env = first_env({"PULSELOCO_TCP_KEEPALIVE_IDLE"}))
    options.keepalive_idle_s = static_cast<int>(parse_integer(*env, 1, 86400));
  if (auto env = first_env({"PULSELOCO_TCP_KEEPALIVE_INTERVAL"}))
    options.keepalive_interval_s = static_cast<int>(parse_integer(*env, 1, 86400));
  if (auto env = first_env({"PULSELOCO_TCP_KEEPALIVE_COUNT"}))
    options.keepalive_count = static_cast<int>(parse_integer(*env, 1, 1000));
  if (auto env = first_env({"PULSELOCO_CONNECT_TIMEOUT_MS"}))
    options.connect_timeout = std::chrono::milliseconds(parse_integer(*env, 1, 86'400'000));
  if (auto env = first_env({"PULSELOCO_IO_TIMEOUT_MS"}))
    options.io_timeout = std::chrono::milliseconds(parse_integer(*env, 0, 86'400'000));
  if (auto env = first_env({"PULSELOCO_TCP_MAX_UNEXPECTED"}))
    options.max_unexpected_bytes = parse_size(*env);
  if (auto env = first_env({"PULSELOCO_TCP_CHECKSUMS"}))
    options.payload_checksums = parse_bool(*env);
  if (auto env = first_env({"PULSELOCO_TCP_IO_THREADS"}))
    options.io_threads = static_cast<int>(parse_integer(*env, 1, 64));
  if (auto env = first_env({"PULSELOCO_TCP_BUSY_POLL_US"}))
    options.busy_poll = std::chrono::microseconds(parse_integer(*env, 0, 1'000'000));

  if (auto env = first_env({"PULSELOCO_SECRET"})) {
    options.secret = env->value;
  } else if (auto file = first_env({"PULSELOCO_SECRET_FILE"})) {
    std::ifstream in(file->value);
    if (!in)
      throw InvalidArgument(
          fmt::format("{}='{}': the file cannot be opened", file->name, file->value));
    std::string line;
    std::getline(in, line);
    if (line.empty())
      throw InvalidArgument(
          fmt::format("{}='{}': the first line (the secret) is empty", file->name, file->value));
    options.secret = line;
  }
  if (auto env = first_env({"PULSELOCO_TEST_CORRUPT_FRAME"})) {
    CorruptFrame hook;
    std::string_view text = env->value;
    if (text.ends_with(":header")) {
      hook.target = FrameCorruption::header;
      text.remove_suffix(7);
    } else if (text.ends_with(":payload")) {
      text.remove_suffix(8);
    }
    hook.frame_index = static_cast<std::uint64_t>(parse_integer(
        EnvValue{env->name, std::string(text)}, 0, std::numeric_limits<long long>::max()));
    options.corrupt_frame = hook;
  }

  if (auto env = first_env({"PULSELOCO_MPI_PART_BYTES"})) options.mpi_part_bytes = parse_size(*env);
  if (auto env = first_env({"PULSELOCO_CUDA_DEVICE"}))
    options.cuda_device = static_cast<int>(parse_integer(*env, 0, 1023));
  if (auto env = first_env({"PULSELOCO_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"}))
    options.local_rank = static_cast<int>(parse_integer(*env, 0, kMaxRanks - 1));
  if (auto env = first_env({"PULSELOCO_NCCL_BOOTSTRAP"})) {
    const std::string value = lower(env->value);
    if (value == "auto") {
      options.nccl_bootstrap = NcclBootstrap::automatic;
    } else if (value == "mpi") {
      options.nccl_bootstrap = NcclBootstrap::mpi;
    } else if (value == "tcp") {
      options.nccl_bootstrap = NcclBootstrap::tcp;
    } else {
      throw InvalidArgument(
          fmt::format("{}='{}' is not a NCCL bootstrap (auto, mpi, tcp)", env->name, env->value));
    }
  }
  return options;
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
  if (options.connect_timeout.count() <= 0)
    fail(fmt::format("transport options: connect_timeout {} ms must be positive",
                     options.connect_timeout.count()));
  if (options.io_timeout.count() < 0)
    fail(fmt::format("transport options: io_timeout {} ms must not be negative",
                     options.io_timeout.count()));
  if (options.io_threads < 1 || options.io_threads > 64)
    fail(fmt::format("transport options: io_threads {} is not in [1, 64]", options.io_threads));
  if (options.busy_poll.count() < 0 || options.busy_poll.count() > 1'000'000)
    fail(fmt::format("transport options: busy_poll {} us is not in [0, 1000000]",
                     options.busy_poll.count()));
  if (options.mpi_part_bytes < 1 ||
      options.mpi_part_bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()))
    fail(fmt::format("transport options: mpi_part_bytes {} is not in [1, {}]",
                     options.mpi_part_bytes, std::numeric_limits<int>::max()));
  if (options.cuda_device < -1) fail("transport options: cuda_device must be -1 or a device");
  if (options.external_rendezvous_server && options.master_port == 0 &&
      options.rendezvous == RendezvousMethod::environment)
    fail("transport options: an external rendezvous server needs master_port");
}

std::unique_ptr<Transport> make_transport(const TransportOptions& options) {
  validate(options);
  if (!backend_available(options.backend))
    throw InvalidArgument(fmt::format(
        "transport '{}' is not built into this pulseloco (configure with -DPULSELOCO_WITH_{}=ON)",
        backend_name(options.backend), options.backend == Backend::mpi ? "MPI" : "NCCL"));
  switch (options.backend) {
    case Backend::tcp:
      return std::make_unique<TcpTransport>(options);
    case Backend::mpi:
#if PULSELOCO_TRANSPORT_MPI
      return std::make_unique<MpiTransport>(options);
#else
      break;
#endif
    case Backend::nccl:
#if PULSELOCO_TRANSPORT_NCCL
      return std::make_unique<NcclTransport>(options);
#else
      break;
#endif
  }
  throw InvalidArgument(
      fmt::format("unknown transport backend {}", static_cast<int>(options.backend)));
}

}  // namespace pulseloco::transport
