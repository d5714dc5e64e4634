// `pulseloco patch apply DIR --out FILE [--from FILE] [--to VERSION] [--json]`: brings a bf16
// state (none, or the one a previous apply wrote) to a published version by the shortest path
// and writes it as an anchor file. `pulseloco patch inspect DIR [--json]`: the versions of a
// publishing directory, their sizes and densities, every listed file checked against the
// manifest. Both exit non-zero naming the version and the file when something is wrong; apply
// then leaves --out as it was (docs/patches.md).
// `pulseloco patch serve DIR --listen HOST:PORT` serves a publishing directory to subscribers
// over TCP; `pulseloco patch subscribe HOST:PORT --out FILE [--until VERSION]` receives each
// version and writes it atomically to FILE (resuming from FILE when it exists). Both take the
// shared secret, run id and link security from the training group's variables
// (PULSELOCO_SECRET / PULSELOCO_SECRET_FILE, PULSELOCO_RUN_ID, PULSELOCO_LINK_SECURITY), and
// subscribe its connect timeout (PULSELOCO_CONNECT_TIMEOUT_MS).
// DIR of apply and inspect, and SERVER of subscribe, may be a bucket, s3://bucket/prefix
// (credentials and endpoint from the AWS variables, io/s3_settings.h): subscribe then reads the
// manifest every --poll-ms and brings its state to each newer version.
#include <fmt/format.h>

#include <charconv>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/cli/commands.h>
#include <pulseloco/cli/flag_checks.h>
#include <pulseloco/group/options.h>
#include <pulseloco/io/s3_client.h>
#include <pulseloco/io/s3_settings.h>
#include <pulseloco/patch/bucket.h>
#include <pulseloco/patch/manifest.h>
#include <pulseloco/patch/push_server.h>
#include <pulseloco/patch/receiver.h>
#include <pulseloco/patch/subscriber.h>
#include <pulseloco/patch/trl_files.h>
#include <pulseloco/transport/tcp/group_table.h>

namespace pulseloco::cli {
namespace {

struct ApplyOptions {
  std::string directory;
  std::string out;
  std::string from;
  std::optional<std::uint64_t> to;
  bool json = false;
};

void apply(const ApplyOptions& options) {
  patch::Receiver receiver;
  if (!options.from.empty()) {
    patch::Anchor held = patch::read_anchor_file(options.from);
    receiver = patch::Receiver(std::move(held.state), held.version);
  }
  const patch::UpdateReport report = receiver.update(options.directory, options.to);
  (void)patch::write_anchor_file(options.out, receiver.state(), report.to,
                                 receiver.state().digest(), patch::IndexEncoding::gap_delta);
  if (options.json) {
    nlohmann::json steps = nlohmann::json::array();
    for (const patch::UpdateStep& step : report.steps) {
      steps.push_back({{"version", step.version},
                       {"kind", patch::step_kind_name(step.kind)},
                       {"bytes", step.bytes}});
    }
    const nlohmann::json out{
        {"from", report.from ? nlohmann::json(*report.from) : nlohmann::json()},
        {"to", report.to},
        {"digest", digest_hex(receiver.state().digest())},
        {"steps", steps},
        {"bytes", report.bytes()}};
    fmt::print("{}\n", out.dump(1));
    return;
  }
  fmt::print("{} -> version {} ({} bytes read)\n",
             report.from ? fmt::format("version {}", *report.from) : std::string("no state"),
             report.to, report.bytes());
  for (const patch::UpdateStep& step : report.steps) {
    fmt::print("  {:<7} {:>8} {:>14} bytes\n", patch::step_kind_name(step.kind), step.version,
               step.bytes);
  }
  fmt::print("wrote {} (digest {})\n", options.out, digest_hex(receiver.state().digest()));
}

struct InspectPatchesOptions {
  std::string directory;
  bool json = false;
};

// The check of one listed file (of a directory, or an object of a bucket, read and hashed):
// "ok" or the error, the first of which `first_error` keeps (with its kind: a missing file or
// refused credentials are no damage).
std::string check_file(const std::string& directory, const patch::ManifestFile& file,
                       std::exception_ptr& first_error, io::S3Client* client) {
  try {
    if (client != nullptr) {
      patch::fetch_listed_object(*client, io::parse_s3_address(directory), file, std::nullopt);
    } else {
      patch::check_listed_file(directory, file);
    }
    return "ok";
  } catch (const Error& error) {
    if (!first_error) first_error = std::current_exception();
    return error.what();
  }
}

void inspect_patches(const InspectPatchesOptions& options) {
  std::unique_ptr<io::S3Client> client;
  patch::Manifest manifest;
  if (io::is_s3_address(options.directory)) {
    client = std::make_unique<io::S3Client>(io::S3Settings::from_environment());
    const io::S3Address address = io::parse_s3_address(options.directory);
    std::optional<patch::Manifest> found = patch::read_bucket_manifest(*client, address);
    if (!found) {
      throw IoError(fmt::format("'{}' is missing ({})", address.url(patch::kManifestName),
                                client->where(address.bucket)));
    }
    manifest = std::move(*found);
  } else {
    manifest = patch::read_manifest(options.directory);
  }
  std::exception_ptr first_error;
  nlohmann::json versions = nlohmann::json::array();
  for (const patch::ManifestVersion& entry : manifest.versions) {
    const double density =
        manifest.total_elements == 0
            ? 0.0
            : static_cast<double>(entry.changed) / static_cast<double>(manifest.total_elements);
    nlohmann::json row{{"version", entry.version},
                       {"digest", digest_hex(entry.digest)},
                       {"changed", entry.changed},
                       {"density", density}};
    for (const auto& [key, file] :
         {std::pair{"delta", entry.delta}, {"compact", entry.compact}, {"anchor", entry.anchor}}) {
      if (!file) continue;
      row[key] = {{"path", file->path},
                  {"bytes", file->bytes},
                  {"status", check_file(options.directory, *file, first_error, client.get())}};
    }
    versions.push_back(std::move(row));
  }
  if (options.json) {
    fmt::print(
        "{}\n",
        nlohmann::json{{"total_elements", manifest.total_elements}, {"versions", versions}}.dump(
            1));
  } else {
    fmt::print("{}: {} versions of {} elements\n", options.directory, manifest.versions.size(),
               manifest.total_elements);
    fmt::print("  {:>8} {:>12} {:>9} {:>14} {:>14} {:>14}  {}\n", "version", "changed", "density",
               "delta bytes", "compact bytes", "anchor bytes", "files");
    for (const nlohmann::json& row : versions) {
      const auto bytes = [&](const char* key) {
        return row.contains(key) ? std::to_string(row[key]["bytes"].get<std::uint64_t>())
                                 : std::string("-");
      };
      std::string status = "ok";
      for (const char* key : {"delta", "compact", "anchor"}) {
        if (row.contains(key) && row[key]["status"] != "ok")
          status = row[key]["status"].get<std::string>();
      }
      fmt::print("  {:>8} {:>12} {:>8.4f}% {:>14} {:>14} {:>14}  {}\n",
                 row["version"].get<std::uint64_t>(), row["changed"].get<std::uint64_t>(),
                 100.0 * row["density"].get<double>(), bytes("delta"), bytes("compact"),
                 bytes("anchor"), status);
    }
  }
  if (first_error) {
    // A damaged file is named as such; other kinds (a missing file, an unreachable bucket,
    // refused credentials) go up as they are.
    try {
      std::rethrow_exception(first_error);
    } catch (const ProtocolError& damaged) {
      throw ProtocolError(fmt::format("{}: a listed file is damaged; the first: {}",
                                      options.directory, damaged.what()));
    }
  }
}

}  // namespace

struct ServeOptions {
  std::string directory;
  std::string listen;
  bool insecure = false;
  std::int64_t poll_ms = 500;
  std::uint64_t min_rate = patch::PushServerOptions{}.min_bytes_per_second;
};

// HOST:PORT where PORT may be 0 (any free port), which parse_peer_address refuses.
transport::PeerAddress listen_address(const std::string& text) {
  const std::size_t colon = text.rfind(':');
  unsigned port = 0;
  const char* end = text.data() + text.size();
  if (colon == std::string::npos || colon == 0 ||
      std::from_chars(text.data() + colon + 1, end, port).ptr != end || colon + 1 == text.size() ||
      port > 65535)
    throw InvalidArgument(
        fmt::format("--listen: '{}' is not HOST:PORT with a port in 0..65535", text));
  return {text.substr(0, colon), static_cast<std::uint16_t>(port)};
}

void serve(const ServeOptions& options) {
  const transport::PeerAddress address = listen_address(options.listen);
  const group::TransportOptions environment = group::from_environment();
  // Blocked before the server's thread starts, so that it inherits the mask and this thread
  // takes them in sigwait.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  patch::PushServer server(options.directory,
                           {.host = address.host,
                            .port = address.port,
                            .secret = environment.tcp.secret,
                            .run_id = environment.run_id,
                            .allow_insecure = options.insecure || environment.tcp.allow_insecure,
                            .link_security = environment.tcp.link_security,
                            .tls_files = environment.tcp.tls_files,
                            .poll_interval = std::chrono::milliseconds(options.poll_ms),
                            .min_bytes_per_second = options.min_rate});
  // Scripts and tests wait for this line before subscribing.
  fmt::print("serving {} on {}:{}\n", options.directory, address.host, server.port());
  std::fflush(stdout);
  int signal = 0;
  (void)sigwait(&stop_signals, &signal);  // the server's thread serves until SIGINT or SIGTERM
}

struct SubscribeOptions {
  std::string server;  // HOST:PORT, or an s3://bucket/prefix address
  std::string out;
  std::optional<std::uint64_t> until;
  std::uint64_t poll_ms = 2000;  // a bucket's manifest is read this often
};

// Writes the held state to `out` atomically as an anchor file and prints its line.
void write_held(const std::string& out, const patch::Bf16State& state, std::uint64_t version,
                std::string_view kind, std::uint64_t bytes) {
  const Digest digest = state.digest();
  (void)patch::write_anchor_file(out, state, version, digest, patch::IndexEncoding::gap_delta);
  fmt::print("version {} ({} of {} bytes), digest {}\n", version, kind, bytes, digest_hex(digest));
  std::fflush(stdout);
}

// A poll interval's bound: clock arithmetic on larger ones overflows.
constexpr std::int64_t kMaxPollMs = 86'400'000;

// Whether --out already holds a state to resume from; IoError naming it when that cannot be
// told (a name too long, a directory that cannot be searched).
bool out_exists(const std::filesystem::path& out) {
  std::error_code error;
  const bool exists = std::filesystem::exists(out, error);
  if (error) throw IoError(fmt::format("--out {}: {}", out.string(), error.message()));
  return exists;
}

// Follows a bucket: reads its manifest every poll interval and, when it lists a newer version,
// brings the state there with Receiver's checks. A bucket that cannot be reached (after the
// client's retries) is tried again at the next poll; a damaged or foreign version ends it.
void subscribe_bucket(const SubscribeOptions& options) {
  io::S3Client client(io::S3Settings::from_environment());
  const io::S3Address address = io::parse_s3_address(options.server);
  patch::Receiver receiver;
  if (out_exists(options.out)) {
    patch::Anchor held = patch::read_anchor_file(options.out);
    receiver = patch::Receiver(std::move(held.state), held.version);
  }
  const auto done = [&] {
    return options.until && receiver.version() && *receiver.version() >= *options.until;
  };
  while (!done()) {
    try {
      const std::optional<patch::Manifest> manifest = patch::read_bucket_manifest(client, address);
      if (manifest && !manifest->versions.empty() &&
          receiver.version() != manifest->versions.back().version) {
        const patch::UpdateReport report =
            patch::update_from_bucket(receiver, client, address, std::nullopt);
        write_held(options.out, receiver.state(), report.to,
                   report.steps.empty() ? "none" : patch::step_kind_name(report.steps.back().kind),
                   report.bytes());
        continue;
      }
    } catch (const IoError& error) {
      logger().warn("{}: {}; trying again in {} ms", options.server, error.what(), options.poll_ms);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(options.poll_ms));
  }
}

void subscribe(const SubscribeOptions& options) {
  if (io::is_s3_address(options.server)) {
    subscribe_bucket(options);
    return;
  }
  const group::TransportOptions environment = group::from_environment();
  const patch::SubscriberOptions connection{.server = options.server,
                                            .secret = environment.tcp.secret,
                                            .run_id = environment.run_id,
                                            .link_security = environment.tcp.link_security,
                                            .tls_files = environment.tcp.tls_files,
                                            .connect_timeout = environment.connect_timeout};
  std::unique_ptr<patch::Subscriber> subscriber;
  if (out_exists(options.out)) {
    patch::Anchor held = patch::read_anchor_file(options.out);
    subscriber =
        std::make_unique<patch::Subscriber>(connection, std::move(held.state), held.version);
  } else {
    subscriber = std::make_unique<patch::Subscriber>(connection);
  }
  while (!options.until || !subscriber->version() || *subscriber->version() < *options.until) {
    const patch::ReceivedVersion received =
        subscriber->receive(transport::Clock::now() + std::chrono::hours(24 * 365));
    write_held(options.out, subscriber->state(), received.version,
               patch::push_type_name(received.type), received.bytes);
  }
}

void add_patch_command(CLI::App& app) {
  auto* command = app.add_subcommand(
      "patch", "Receive and inspect published bf16 weight patches (docs/patches.md)");
  command->require_subcommand(1);

  auto apply_options = std::make_shared<ApplyOptions>();
  auto* apply_command = command->add_subcommand(
      "apply", "Bring a bf16 state to a published version and write it as an anchor file");
  apply_command
      ->add_option("DIR", apply_options->directory,
                   "A publishing directory or bucket (s3://bucket/prefix)")
      ->required();
  apply_command->add_option("--out", apply_options->out, "The state to write")->required();
  apply_command->add_option("--from", apply_options->from,
                            "A state a previous apply wrote (default: none, start from an anchor)");
  apply_command->add_option("--to", apply_options->to, "The version (default: the newest)")
      ->check(flags::at_least(1));
  apply_command->add_flag("--json", apply_options->json, "Print machine-readable JSON");
  apply_command->callback([apply_options] { apply(*apply_options); });

  auto inspect_options = std::make_shared<InspectPatchesOptions>();
  auto* inspect_command = command->add_subcommand(
      "inspect", "List a publishing directory's versions and check every listed file");
  inspect_command
      ->add_option("DIR", inspect_options->directory,
                   "A publishing directory or bucket (s3://bucket/prefix)")
      ->required();
  inspect_command->add_flag("--json", inspect_options->json, "Print machine-readable JSON");
  inspect_command->callback([inspect_options] { inspect_patches(*inspect_options); });

  auto serve_options = std::make_shared<ServeOptions>();
  auto* serve_command = command->add_subcommand(
      "serve", "Push a publishing directory's versions to subscribers over TCP");
  serve_command->add_option("DIR", serve_options->directory, "A publishing directory")->required();
  serve_command->add_option("--listen", serve_options->listen, "HOST:PORT (port 0: any free port)")
      ->required();
  serve_command
      ->add_option("--poll-ms", serve_options->poll_ms,
                   "How often the manifest is read for new versions, in milliseconds (at most "
                   "a day)")
      ->capture_default_str()
      ->check(flags::between(std::int64_t{1}, kMaxPollMs));
  serve_command
      ->add_option("--min-rate", serve_options->min_rate,
                   "Drop a subscriber that takes fewer bytes per second than this, averaged over "
                   "a minute, while a message is on its way (0: only one that takes nothing for "
                   "a minute)")
      ->capture_default_str()
      ->check(flags::at_least(0));
  serve_command->add_flag("--insecure", serve_options->insecure,
                          "Listen beyond loopback without a shared secret (a trusted network "
                          "only); also PULSELOCO_ALLOW_INSECURE=1");
  serve_command->callback([serve_options] { serve(*serve_options); });

  auto subscribe_options = std::make_shared<SubscribeOptions>();
  auto* subscribe_command = command->add_subcommand(
      "subscribe", "Receive versions from a patch push server, writing each as an anchor file");
  subscribe_command
      ->add_option("SERVER", subscribe_options->server,
                   "HOST:PORT of a push server, or a bucket: s3://bucket/prefix")
      ->required();
  subscribe_command
      ->add_option("--poll-ms", subscribe_options->poll_ms,
                   "How often a bucket's manifest is read, in milliseconds (at most a day)")
      ->check(flags::between(std::uint64_t{1}, static_cast<std::uint64_t>(kMaxPollMs)));
  subscribe_command
      ->add_option("--out", subscribe_options->out,
                   "The state to write (read first, when it exists, to resume)")
      ->required();
  subscribe_command
      ->add_option("--until", subscribe_options->until,
                   "Stop once this version or a newer one is held")
      ->check(flags::at_least(1));
  subscribe_command->callback([subscribe_options] { subscribe(*subscribe_options); });
}

}  // namespace pulseloco::cli
