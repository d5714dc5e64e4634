// pulseloco_transport_test_worker: one rank of a transport test run as its own process (by the
// process tests, or by mpirun). The group comes from the environment (from_environment()); what
// the rank does comes from --scenario. Progress is reported one line at a time on --report-fd
// (or stdout), so that a test can act at the right moment without sleeping:
//   ready                       the group is connected
//   waiting                     a receive from the victim is posted and being waited for
//   received n=<k>              the k-th large message from the victim arrived
//   ok <details>                the scenario succeeded
//   error kind=<kind> peer=<p> elapsed_ms=<ms> what=<message>
// Scenarios:
//   exchange        every rank sends a distinct message to every other rank (0 bytes, 1 byte,
//                   odd sizes, a different size on every rank; --large adds 64 MiB), checks
//                   the bytes and the statistics; with MPI also the native collectives; then
//                   size mismatches and a timeout between ranks 0 and 1
//   victim-idle     connects, reports ready, then does nothing until killed
//   victim-stream   connects, then streams 64 MiB messages to every other rank forever
//   survivor-small  waits for a small message from --victim that never comes
//   survivor-large  receives 64 MiB messages from --victim until that fails
//   survivor-send   sends 64 MiB messages to --victim until that fails
//   join            only joins the group (the wrong-secret test's intruder uses it)
#include <fmt/format.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/group/make_transport.h>
#include <pulseloco/transport/native_collectives.h>

namespace {

using namespace pulseloco;
using namespace pulseloco::transport;

constexpr std::size_t kLargeBytes = std::size_t{64} << 20;

int g_report_fd = STDOUT_FILENO;

void report(const std::string& line) {
  const std::string text = line + "\n";
  std::size_t written = 0;
  while (written < text.size()) {
    const auto n = ::write(g_report_fd, text.data() + written, text.size() - written);
    if (n <= 0) return;
    written += static_cast<std::size_t>(n);
  }
}

std::string one_line(std::string text) {
  for (char& c : text)
    if (c == '\n') c = ' ';
  return text;
}

void report_error(const std::exception& error, std::chrono::steady_clock::time_point since) {
  const auto elapsed = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::steady_clock::now() - since)
                           .count();
  std::string kind = "other";
  std::string peer = "-";
  if (const auto* e = dynamic_cast<const Error*>(&error)) {
    kind = std::string(error_kind_name(e->kind()));
    for (char& c : kind)
      if (c == ' ') c = '_';
    if (e->context().peer) peer = std::to_string(*e->context().peer);
  }
  report(fmt::format("error kind={} peer={} elapsed_ms={} what={}", kind, peer, elapsed,
                     one_line(error.what())));
}

std::vector<std::byte> pattern(std::uint64_t seed, std::size_t bytes) {
  std::vector<std::byte> out(bytes);
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 7;
  for (std::size_t i = 0; i < bytes; i += 8) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    std::memcpy(out.data() + i, &state, std::min<std::size_t>(8, bytes - i));
  }
  return out;
}

std::size_t message_size(int src, int dst, int round, bool large) {
  if (large && round == 0) return kLargeBytes + static_cast<std::size_t>(src);
  static constexpr std::size_t kSizes[] = {0, 1, 13, 4099, 100'003, 2'000'001};
  return kSizes[static_cast<std::size_t>(src + 2 * dst + 3 * round) % std::size(kSizes)] +
         static_cast<std::size_t>(src);
}

std::uint64_t seed_of(int src, int dst, int round) {
  return static_cast<std::uint64_t>(src) << 40 | static_cast<std::uint64_t>(dst) << 20 |
         static_cast<std::uint64_t>(round);
}

void exchange(Transport& t, int rounds, bool large, std::chrono::milliseconds timeout) {
  const int n = t.size();
  const int me = t.rank();
  std::uint64_t sent = 0;
  std::uint64_t received = 0;
  const auto before = t.stats();
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(n));
    std::vector<std::vector<std::byte>> in(static_cast<std::size_t>(n));
    std::vector<std::unique_ptr<Request>> requests;
    for (int peer = 0; peer < n; ++peer) {
      if (peer == me) continue;
      const auto p = static_cast<std::size_t>(peer);
      in[p].resize(message_size(peer, me, round, large));
      requests.push_back(t.irecv(peer, static_cast<Tag>(round), in[p]));
      out[p] = pattern(seed_of(me, peer, round), message_size(me, peer, round, large));
      requests.push_back(t.isend(peer, static_cast<Tag>(round), out[p]));
      sent += out[p].size();
      received += in[p].size();
    }
    for (auto& request : requests)
      request->wait(deadline_after(timeout));
    for (int peer = 0; peer < n; ++peer) {
      if (peer == me) continue;
      if (in[static_cast<std::size_t>(peer)] !=
          pattern(seed_of(peer, me, round), message_size(peer, me, round, large)))
        throw ProtocolError(
            fmt::format("round {}: the message from rank {} has wrong bytes", round, peer),
            ErrorContext{.rank = me, .peer = peer});
    }
  }
  const auto after = t.stats();
  if (after.payload_bytes_sent - before.payload_bytes_sent != sent ||
      after.payload_bytes_received - before.payload_bytes_received != received)
    throw ProtocolError(
        fmt::format("statistics disagree: sent {} (counted {}), received {} "
                    "(counted {})",
                    sent, after.payload_bytes_sent - before.payload_bytes_sent, received,
                    after.payload_bytes_received - before.payload_bytes_received));
  if (after.wire_bytes_sent < after.payload_bytes_sent)
    throw ProtocolError("statistics: fewer wire bytes than payload bytes sent");
}

// MPI's allgatherv must deliver exactly what point-to-point exchanges deliver.
void check_native_collectives(Transport& t, std::chrono::milliseconds timeout) {
  auto* native = native_collectives(t);
  if (native == nullptr) return;
  const int n = t.size();
  std::vector<std::uint64_t> counts(static_cast<std::size_t>(n));
  std::uint64_t total = 0;
  for (int r = 0; r < n; ++r)
    total += counts[static_cast<std::size_t>(r)] = 1000 * r + 3;
  const auto mine = pattern(seed_of(t.rank(), 99, 0), counts[static_cast<std::size_t>(t.rank())]);
  std::vector<std::byte> gathered(total);
  if (!native->allgatherv(mine, counts, gathered, deadline_after(timeout)))
    throw ProtocolError("allgatherv refused small counts");
  std::uint64_t offset = 0;
  for (int r = 0; r < n; ++r) {
    const auto expected = pattern(seed_of(r, 99, 0), counts[static_cast<std::size_t>(r)]);
    if (!std::equal(expected.begin(), expected.end(),
                    gathered.begin() + static_cast<std::ptrdiff_t>(offset)))
      throw ProtocolError(fmt::format("allgatherv: rank {}'s part differs", r));
    offset += expected.size();
  }
  std::vector<std::byte> value = pattern(7, 12345);
  std::vector<std::byte> received = t.rank() == n - 1 ? value : std::vector<std::byte>(12345);
  native->broadcast(n - 1, received, deadline_after(timeout));
  if (received != value) throw ProtocolError("broadcast delivered wrong bytes");
  native->barrier(deadline_after(timeout));
}

// Rank 1 receives messages of the wrong size from rank 0 and one that never comes; each must
// fail with the right error naming rank 0, and the transport must keep working afterwards.
void check_errors(Transport& t, std::chrono::milliseconds timeout) {
  if (t.rank() > 1) return;
  const auto ten = pattern(10, 10);
  const auto eight = pattern(8, 8);
  if (t.rank() == 0) {
    t.send(1, 100, ten, deadline_after(timeout));
    t.send(1, 101, eight, deadline_after(timeout));
  } else {
    const auto expect = [&](auto&& action, ErrorKind kind, std::string_view what) {
      try {
        action();
      } catch (const Error& error) {
        if (error.kind() != kind || error.context().peer != 0)
          throw ProtocolError(fmt::format("{}: wrong error: {}", what, error.what()));
        return;
      }
      throw ProtocolError(fmt::format("{}: no error", what));
    };
    std::vector<std::byte> small(8);
    std::vector<std::byte> big(10);
    expect([&] { t.recv(0, 100, small, deadline_after(timeout)); }, ErrorKind::protocol,
           "10 bytes into 8");
    expect([&] { t.recv(0, 101, big, deadline_after(timeout)); }, ErrorKind::protocol,
           "8 bytes into 10");
    const auto start = std::chrono::steady_clock::now();
    expect([&] { t.recv(0, 102, small, deadline_after(std::chrono::milliseconds(300))); },
           ErrorKind::timeout, "a message that never comes");
    if (std::chrono::steady_clock::now() - start < std::chrono::milliseconds(300))
      throw ProtocolError("the receive timed out before its deadline");
  }
  // Still usable.
  const int peer = 1 - t.rank();
  std::vector<std::byte> got(ten.size());
  auto recv = t.irecv(peer, 103, got);
  t.send(peer, 103, ten, deadline_after(timeout));
  recv->wait(deadline_after(timeout));
  if (got != ten) throw ProtocolError("the message after the errors has wrong bytes");
}

// Blocks until stdin reaches its end (the test never writes to it; it kills this process).
void idle_until_killed() {
  char byte = 0;
  while (::read(STDIN_FILENO, &byte, 1) > 0) {
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::string scenario = "exchange";
  std::string backend;
  int rounds = 3;
  bool large = false;
  int victim = 1;
  long long timeout_ms = 60'000;
  CLI::App app{"pulseloco transport test worker: one rank of a multi-process transport test"};
  app.add_option("--scenario", scenario, "what this rank does")
      ->check(CLI::IsMember({"exchange", "victim-idle", "victim-stream", "survivor-small",
                             "survivor-large", "survivor-send", "join"}));
  app.add_option("--backend", backend, "tcp, mpi or nccl (default: PULSELOCO_TRANSPORT or tcp)");
  app.add_option("--rounds", rounds, "exchange rounds");
  app.add_flag("--large", large, "include 64 MiB messages");
  app.add_option("--victim", victim, "the rank that fails");
  app.add_option("--timeout-ms", timeout_ms, "deadline of every operation")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  app.add_option("--report-fd", g_report_fd, "file descriptor for progress lines");
  CLI11_PARSE(app, argc, argv);
  const auto timeout = std::chrono::milliseconds(timeout_ms);

  auto since = std::chrono::steady_clock::now();
  std::unique_ptr<Transport> transport;
  try {
    group::TransportOptions options = group::from_environment();
    if (!backend.empty()) options.backend = *parse_backend(backend);
    transport = group::make_transport(options);  // tags the log lines with the rank
    Transport& t = *transport;
    report(fmt::format("ready rank={} size={} backend={}", t.rank(), t.size(), t.backend()));
    if (scenario == "join") {
      report("ok joined");
    } else if (scenario == "exchange") {
      exchange(t, rounds, large, timeout);
      check_native_collectives(t, timeout);
      if (t.size() > 1) check_errors(t, timeout);
      const auto stats = t.stats();
      report(
          fmt::format("ok rank={} payload_sent={} payload_received={} wire_sent={} "
                      "wire_received={}",
                      t.rank(), stats.payload_bytes_sent, stats.payload_bytes_received,
                      stats.wire_bytes_sent, stats.wire_bytes_received));
    } else if (scenario == "victim-idle") {
      idle_until_killed();
    } else if (scenario == "victim-stream") {
      const auto message = pattern(1, kLargeBytes);
      for (Tag round = 0;; ++round) {
        std::vector<std::unique_ptr<Request>> sends;
        for (int peer = 0; peer < t.size(); ++peer)
          if (peer != t.rank()) sends.push_back(t.isend(peer, round, message));
        for (auto& send : sends)
          send->wait(deadline_after(timeout));
      }
    } else if (scenario == "survivor-small") {
      std::vector<std::byte> buffer(1024);
      auto request = t.irecv(victim, 0, buffer);
      since = std::chrono::steady_clock::now();
      report("waiting");
      request->wait(deadline_after(timeout));
      report("ok unexpectedly received");
    } else if (scenario == "survivor-send") {
      const auto message = pattern(2, kLargeBytes);
      for (Tag round = 0;; ++round) {
        auto request = t.isend(victim, round, message);
        since = std::chrono::steady_clock::now();
        request->wait(deadline_after(timeout));
        report(fmt::format("sent n={}", round + 1));
      }
    } else if (scenario == "survivor-large") {
      std::vector<std::byte> buffer(kLargeBytes);
      for (Tag round = 0;; ++round) {
        auto request = t.irecv(victim, round, buffer);
        since = std::chrono::steady_clock::now();
        request->wait(deadline_after(timeout));
        report(fmt::format("received n={}", round + 1));
      }
    }
    return 0;
  } catch (const std::exception& error) {
    // Reported while the transport still exists, then aborted, as a collective would do.
    report_error(error, since);
    if (transport) transport->abort(error.what());
    return 1;
  }
}
