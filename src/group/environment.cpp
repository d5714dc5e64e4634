// group::from_environment(): the options of options.h from PULSELOCO_* and the torchrun and
// OpenMPI variables.
#include <pulseloco/group/options.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <initializer_list>
#include <limits>

#include <pulseloco/base/boolean_text.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/group/rendezvous.h>
#include <pulseloco/group/test_hooks.h>

namespace pulseloco::group {
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

// A size in [min, max] bytes, else InvalidArgument naming the variable.
std::size_t parse_size(const EnvValue& env, std::uint64_t min = 0,
                       std::uint64_t max = std::numeric_limits<std::uint64_t>::max()) {
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
  if (value * unit < min || value * unit > max) {
    throw InvalidArgument(fmt::format("{}='{}' is {} bytes, not in [{}, {}]", env.name, env.value,
                                      value * unit, min, max));
  }
  return static_cast<std::size_t>(value * unit);
}

bool parse_bool(const EnvValue& env) {
  if (const std::optional<bool> value = parse_boolean_text(env.value)) return *value;
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

TransportOptions from_environment(TransportOptions options) {
  if (auto env = first_env({"PULSELOCO_TRANSPORT"})) {
    const auto backend = transport::parse_backend(lower(env->value));
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
  if (auto env = first_env({"PULSELOCO_RUN_ID"})) options.run_id = env->value;
  if (auto env = first_env({"PULSELOCO_LISTEN_ADDR"})) options.tcp.listen_addr = env->value;
  if (auto env = first_env({"PULSELOCO_LISTEN_PORT"}))
    options.tcp.listen_port = static_cast<std::uint16_t>(parse_integer(*env, 0, 65535));
  if (auto env = first_env({"PULSELOCO_ADVERTISE_ADDR"})) options.advertise_addr = env->value;
  if (auto env = first_env({"PULSELOCO_SOCKET_IFNAME"})) options.socket_ifname = env->value;

  if (auto env = first_env({"PULSELOCO_TCP_CONNECTIONS"}))
    options.tcp.connections_per_peer = static_cast<int>(parse_integer(*env, 1, 64));
  if (auto env = first_env({"PULSELOCO_TCP_STRIPE_THRESHOLD"}))
    options.tcp.stripe_threshold_bytes = parse_size(*env);
  if (auto env = first_env({"PULSELOCO_TCP_STRIPE_CHUNK"}))
    options.tcp.stripe_chunk_bytes = parse_size(*env, 4096);
  if (auto env = first_env({"PULSELOCO_TCP_NODELAY"})) options.tcp.tcp_nodelay = parse_bool(*env);
  constexpr auto kIntMax = static_cast<std::uint64_t>(std::numeric_limits<int>::max());
  if (auto env = first_env({"PULSELOCO_TCP_SNDBUF"}))
    options.tcp.socket_send_buffer_bytes = static_cast<int>(parse_size(*env, 0, kIntMax));
  if (auto env = first_env({"PULSELOCO_TCP_RCVBUF"}))
    options.tcp.socket_receive_buffer_bytes = static_cast<int>(parse_size(*env, 0, kIntMax));
  if (auto env = first_env({"PULSELOCO_TCP_KEEPALIVE"})) options.tcp.keepalive = parse_bool(*env);
  if (auto env = first_env({"PULSELOCO_TCP_KEEPALIVE_IDLE"}))
    options.tcp.keepalive_idle_s = static_cast<int>(parse_integer(*env, 1, 86400));
  if (auto env = first_env({"PULSELOCO_TCP_KEEPALIVE_INTERVAL"}))
    options.tcp.keepalive_interval_s = static_cast<int>(parse_integer(*env, 1, 86400));
  if (auto env = first_env({"PULSELOCO_TCP_KEEPALIVE_COUNT"}))
    options.tcp.keepalive_count = static_cast<int>(parse_integer(*env, 1, 1000));
  if (auto env = first_env({"PULSELOCO_CONNECT_TIMEOUT_MS"}))
    options.connect_timeout = std::chrono::milliseconds(parse_integer(*env, 1, 86'400'000));
  if (auto env = first_env({"PULSELOCO_IO_TIMEOUT_MS"}))
    options.tcp.io_timeout = std::chrono::milliseconds(parse_integer(*env, 0, 86'400'000));
  if (auto env = first_env({"PULSELOCO_TCP_MAX_UNEXPECTED"}))
    options.tcp.max_unexpected_bytes = parse_size(*env);
  if (auto env = first_env({"PULSELOCO_TCP_CHECKSUMS"}))
    options.tcp.payload_checksums = parse_bool(*env);
  if (auto env = first_env({"PULSELOCO_TCP_IO_THREADS"}))
    options.tcp.io_threads = static_cast<int>(parse_integer(*env, 1, 64));
  if (auto env = first_env({"PULSELOCO_TCP_BUSY_POLL_US"}))
    options.tcp.busy_poll = std::chrono::microseconds(parse_integer(*env, 0, 1'000'000));

  // A blank secret would authenticate anyone who guesses it; a CRLF file's '\r' would make the
  // secret differ from the same text given in PULSELOCO_SECRET elsewhere.
  const auto blank = [](std::string_view secret) {
    return secret.find_first_not_of(" \t\r\n\v\f") == std::string_view::npos;
  };
  if (auto env = first_env({"PULSELOCO_SECRET"})) {
    if (blank(env->value))
      throw InvalidArgument(fmt::format("{}: the secret is only whitespace", env->name));
    options.tcp.secret = env->value;
  } else if (auto file = first_env({"PULSELOCO_SECRET_FILE"})) {
    std::ifstream in(file->value);
    if (!in)
      throw InvalidArgument(
          fmt::format("{}='{}': the file cannot be opened", file->name, file->value));
    std::string line;
    std::getline(in, line);
    if (line.ends_with('\r')) line.pop_back();
    if (blank(line)) {
      throw InvalidArgument(
          fmt::format("{}='{}': the first line (the secret) is empty or only whitespace",
                      file->name, file->value));
    }
    options.tcp.secret = line;
  }
  if (auto env = first_env({"PULSELOCO_ALLOW_INSECURE"}))
    options.tcp.allow_insecure = parse_bool(*env);
  if (auto env = first_env({"PULSELOCO_LINK_SECURITY"})) {
    const std::string value = lower(env->value);
    if (value == "tls") {
      options.tcp.link_security = transport::LinkSecurity::tls;
    } else if (value == "hmac") {
      options.tcp.link_security = transport::LinkSecurity::hmac;
    } else {
      throw InvalidArgument(
          fmt::format("{}='{}' is not a link security (tls or hmac)", env->name, env->value));
    }
  }
  if (auto env = first_env({"PULSELOCO_SAME_HOST_PLAINTEXT"}))
    options.tcp.same_host_plaintext = parse_bool(*env);
  if (auto env = first_env({"PULSELOCO_TLS_CERT"})) options.tcp.tls_files.cert = env->value;
  if (auto env = first_env({"PULSELOCO_TLS_KEY"})) options.tcp.tls_files.key = env->value;
  if (auto env = first_env({"PULSELOCO_TLS_CA"})) options.tcp.tls_files.ca = env->value;
  if (auto env = first_env({"PULSELOCO_MPI_PART_BYTES"}))
    options.mpi.part_bytes = parse_size(*env, 1, std::numeric_limits<int>::max());
  if (auto env = first_env({"PULSELOCO_CUDA_DEVICE"}))
    options.nccl.cuda_device = static_cast<int>(parse_integer(*env, 0, 1023));
  if (auto env = first_env({"PULSELOCO_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"}))
    options.nccl.local_rank = static_cast<int>(parse_integer(*env, 0, kMaxRanks - 1));
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

bool launched_by_mpi() noexcept {
  return first_env({"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}).has_value();
}

bool mpi_launcher_reports_one_host() noexcept {
  // OpenMPI, MPICH (Hydra) and PMIx launchers say how many ranks share this node.
  const auto local =
      first_env({"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE"});
  const auto world = first_env({"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"});
  return local && world && !local->value.empty() && local->value == world->value;
}

std::optional<transport::CorruptFrame> corrupt_frame_from_environment() {
  auto env = first_env({"PULSELOCO_TEST_CORRUPT_FRAME"});
  if (!env) return std::nullopt;
  transport::CorruptFrame hook;
  std::string_view text = env->value;
  if (text.ends_with(":header")) {
    hook.target = transport::FrameCorruption::header;
    text.remove_suffix(7);
  } else if (text.ends_with(":payload")) {
    text.remove_suffix(8);
  }
  hook.frame_index = static_cast<std::uint64_t>(parse_integer(
      EnvValue{env->name, std::string(text)}, 0, std::numeric_limits<long long>::max()));
  return hook;
}

}  // namespace pulseloco::group
