#include <pulseloco/engine/bucket_transport.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/base/log.h>
#include <pulseloco/io/s3_client.h>
#include <pulseloco/io/sealed_object.h>
#include <pulseloco/transport/native_collectives.h>

namespace pulseloco {
namespace {

using transport::Clock;
using transport::Deadline;

constexpr std::uint64_t kHelloBytes = 16;  // world size, format version

bool valid_job_id(std::string_view id) {
  return !id.empty() && id.size() <= 128 && std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_' || c == '.';
  });
}

class BucketTransport;

// Bounds a client's requests by a collective's deadline while it lives, so that retries of a
// failing bucket end when the collective does.
class ClientDeadline {
 public:
  ClientDeadline(io::S3Client& client, std::optional<Deadline> deadline) : client_(client) {
    client_.set_deadline(deadline);
  }
  ~ClientDeadline() { client_.set_deadline(std::nullopt); }
  ClientDeadline(const ClientDeadline&) = delete;
  ClientDeadline& operator=(const ClientDeadline&) = delete;

 private:
  io::S3Client& client_;
};

// A receive: one object, polled until it is there.
class BucketReceive final : public transport::Request {
 public:
  BucketReceive(BucketTransport& owner, std::string key, int peer, std::span<std::byte> data);
  [[nodiscard]] bool test() override { return poll(std::nullopt); }
  void wait(Deadline deadline) override;

 private:
  // One poll when it is due; the fetch's retries end at `deadline`.
  bool poll(std::optional<Deadline> deadline);

  BucketTransport& owner_;
  std::string key_;
  int peer_;
  std::span<std::byte> data_;
  bool done_ = false;
  Clock::time_point next_poll_{};
  std::chrono::milliseconds interval_;
};

class DoneRequest final : public transport::Request {
 public:
  [[nodiscard]] bool test() override { return true; }
  void wait(Deadline) override {}
};

class BucketTransport final : public transport::Transport, public transport::NativeCollectives {
 public:
  explicit BucketTransport(BucketGroupOptions options)
      : options_(std::move(options)),
        address_(io::parse_s3_address(options_.address)),
        client_(options_.settings ? *options_.settings : io::S3Settings::from_environment()),
        sent_(static_cast<std::size_t>(options_.world_size), 0),
        received_(static_cast<std::size_t>(options_.world_size), 0) {}

  [[nodiscard]] int rank() const noexcept override { return options_.rank; }
  [[nodiscard]] int size() const noexcept override { return options_.world_size; }
  [[nodiscard]] std::string_view backend() const noexcept override { return "bucket"; }
  [[nodiscard]] bool matches_by_order() const noexcept override { return true; }

  [[nodiscard]] std::unique_ptr<transport::Request> isend(
      int peer, transport::Tag, std::span<const std::byte> data) override {
    check_peer(peer);
    const auto index = static_cast<std::size_t>(peer);
    put(message_name(rank(), peer, sent_[index]++), data, std::nullopt);  // no deadline here
    return std::make_unique<DoneRequest>();
  }

  [[nodiscard]] std::unique_ptr<transport::Request> irecv(int peer, transport::Tag,
                                                          std::span<std::byte> data) override {
    check_peer(peer);
    const auto index = static_cast<std::size_t>(peer);
    return std::make_unique<BucketReceive>(*this, message_name(peer, rank(), received_[index]++),
                                           peer, data);
  }

  void abort(std::string_view reason) noexcept override {
    const std::lock_guard lock(abort_mutex_);
    if (!aborted_.exchange(true)) abort_reason_ = std::string(reason);
  }

  [[nodiscard]] transport::TransportStats stats() const override {
    const std::lock_guard lock(client_mutex_);
    return stats_;
  }

  // --- native collectives ---------------------------------------------------------------------
  bool allgatherv(std::span<const std::byte> mine, std::span<const std::uint64_t> counts,
                  std::span<std::byte> out, Deadline deadline) override {
    std::vector<std::span<std::byte>> slots;
    std::uint64_t offset = 0;
    for (const std::uint64_t count : counts) {
      slots.push_back(out.subspan(offset, count));
      offset += count;
    }
    gather(mine, slots, deadline);
    return true;
  }

  bool allgather_into(std::span<const std::byte> mine, std::span<const std::span<std::byte>> out,
                      Deadline deadline) override {
    gather(mine, out, deadline);
    return true;
  }

  // Every rank's input, summed in rank order: the same bytes on every rank.
  bool allreduce_sum(std::span<const float> input, std::span<float> output,
                     Deadline deadline) override {
    const std::size_t n = input.size();
    std::vector<float> all(n * static_cast<std::size_t>(size()));
    std::vector<std::span<std::byte>> slots;
    for (int r = 0; r < size(); ++r)
      slots.push_back(
          std::as_writable_bytes(std::span(all).subspan(static_cast<std::size_t>(r) * n, n)));
    gather(std::as_bytes(input), slots, deadline);
    for (std::size_t i = 0; i < n; ++i) {
      float sum = all[i];
      for (int r = 1; r < size(); ++r)
        sum += all[static_cast<std::size_t>(r) * n + i];
      output[i] = sum;
    }
    return true;
  }

  void broadcast(int root, std::span<std::byte> data, Deadline deadline) override {
    const std::string name = collective_name(root);
    ++collectives_;
    if (root == rank()) {
      put(name, data, deadline);
      return;
    }
    BucketReceive receive(*this, name, root, data);
    receive.wait(deadline);
  }

  void barrier(Deadline deadline) override { gather({}, {}, deadline); }

  // --- the group ------------------------------------------------------------------------------
  void form() {
    const std::string hello = hello_name(rank());
    if (client_.get_bytes(address_.bucket, address_.key(hello), kHelloBytes + io::kSealOverhead)) {
      throw InvalidArgument(
          fmt::format("job id '{}' was used before in {}: {} exists (use a new job id, "
                      "PULSELOCO_RUN_ID, for every job)",
                      options_.job_id, address_.url(), address_.url(hello)),
          {.rank = rank()});
    }
    std::vector<std::byte> mine(kHelloBytes);
    store_le<std::uint64_t>(mine.data(), static_cast<std::uint64_t>(size()));
    store_le<std::uint64_t>(mine.data() + 8, 1);
    const Deadline formed_by = transport::deadline_after(options_.form_timeout);
    put(hello, mine, formed_by);
    std::vector<std::vector<std::byte>> hellos(static_cast<std::size_t>(size()),
                                               std::vector<std::byte>(kHelloBytes));
    hellos[static_cast<std::size_t>(rank())] = mine;
    std::vector<std::span<std::byte>> slots(hellos.begin(), hellos.end());
    await_all([&](int r) { return hello_name(r); }, slots, formed_by, "hello");
    for (int r = 0; r < size(); ++r) {
      const auto world = load_le<std::uint64_t>(hellos[static_cast<std::size_t>(r)].data());
      if (world != static_cast<std::uint64_t>(size())) {
        throw InvalidArgument(fmt::format("rank {} joined {} with world size {}, this rank with {}",
                                          r, address_.url(options_.job_id), world, size()),
                              {.rank = rank(), .peer = r});
      }
    }
  }

  void label(std::uint64_t window) {
    window_ = window;
    std::vector<std::string> stale;
    for (auto it = written_.begin(); it != written_.end() && it->first + 2 <= window;) {
      stale.insert(stale.end(), it->second.begin(), it->second.end());
      it = written_.erase(it);
    }
    for (const std::string& name : stale) {
      const std::lock_guard lock(client_mutex_);
      client_.delete_object(address_.bucket, address_.key(name));
      ++requests_.deletes;
    }
  }

  // One attempt: true (and `data` filled) when the object is there and authentic; false when it
  // is not there yet, or when the request's retries reached `deadline` (the caller then names
  // the rank whose object is missing).
  bool fetch(const std::string& name, int peer, std::span<std::byte> data,
             std::optional<Deadline> deadline) {
    check_aborted();
    std::optional<std::vector<std::byte>> sealed;
    {
      const std::lock_guard lock(client_mutex_);
      const ClientDeadline bounded(client_, deadline);
      try {
        sealed =
            client_.get_bytes(address_.bucket, address_.key(name), data.size() + io::kSealOverhead);
      } catch (const TimeoutError& error) {
        logger().debug("bucket group {}: {}", address_.url(options_.job_id), error.what());
        return false;
      }
      ++(sealed ? requests_.gets : requests_.misses);
      if (sealed) {
        stats_.wire_bytes_received += sealed->size();
        stats_.payload_bytes_received += data.size();
        ++stats_.messages_received;
      }
    }
    if (!sealed) return false;
    const auto payload = io::open_sealed_object(options_.secret, address_.key(name), *sealed);
    if (!payload) {
      throw ProtocolError(
          fmt::format("object {} (from rank {}) is not authentic: its MAC does not match this "
                      "job's secret and its name (written without the secret, or copied from "
                      "another window, rank or job)",
                      address_.url(name), peer),
          {.rank = rank(), .peer = peer});
    }
    if (payload->size() != data.size()) {
      throw ProtocolError(fmt::format("object {} (from rank {}) holds {} bytes, {} expected",
                                      address_.url(name), peer, payload->size(), data.size()),
                          {.rank = rank(), .peer = peer});
    }
    if (!data.empty()) std::memcpy(data.data(), payload->data(), data.size());
    return true;
  }

  void check_aborted() const {
    if (aborted_) {
      const std::lock_guard lock(abort_mutex_);
      throw AbortedError(abort_reason_, {.rank = options_.rank});
    }
  }

  [[nodiscard]] const BucketGroupOptions& options() const noexcept { return options_; }
  [[nodiscard]] BucketRequests requests() const {
    const std::lock_guard lock(client_mutex_);
    return requests_;
  }
  [[nodiscard]] std::string url(const std::string& name) const { return address_.url(name); }

 private:
  void check_peer(int peer) const {
    if (peer < 0 || peer >= size() || peer == rank())
      throw InvalidArgument(fmt::format("bucket group: no peer {}", peer), {.rank = rank()});
  }

  [[nodiscard]] std::string hello_name(int r) const {
    return fmt::format("{}/hello/r{}", options_.job_id, r);
  }
  [[nodiscard]] std::string window_prefix() const {
    return fmt::format("{}/w{:010}", options_.job_id, window_);
  }
  [[nodiscard]] std::string collective_name(int r) const {
    return fmt::format("{}/c{}-r{}", window_prefix(), collectives_, r);
  }
  [[nodiscard]] std::string message_name(int from, int to, std::uint64_t k) const {
    return fmt::format("{}/p{}-r{}-r{}", window_prefix(), k, from, to);
  }

  // Writes this rank's object; its retries end at `deadline`.
  void put(const std::string& name, std::span<const std::byte> payload,
           std::optional<Deadline> deadline) {
    check_aborted();
    const std::string key = address_.key(name);
    const std::vector<std::byte> sealed = io::seal_object(options_.secret, key, payload);
    const std::lock_guard lock(client_mutex_);
    const ClientDeadline bounded(client_, deadline);
    try {
      client_.put_object(address_.bucket, key, sealed);
    } catch (const TimeoutError& error) {
      throw TimeoutError(
          fmt::format("bucket group {}: this rank's object {} was not written "
                      "before the deadline ({})",
                      address_.url(options_.job_id), address_.url(name), error.message()),
          {.rank = rank()});
    }
    stats_.wire_bytes_sent += sealed.size();
    stats_.payload_bytes_sent += payload.size();
    ++stats_.messages_sent;
    ++requests_.puts;
    if (name.rfind(options_.job_id + "/w", 0) == 0) written_[window_].push_back(name);
  }

  // This rank's contribution as one object, then every other rank's into slots[r] (this
  // rank's own slot gets a copy of `mine`). Empty `slots`: contributions of no bytes.
  void gather(std::span<const std::byte> mine, std::span<const std::span<std::byte>> slots,
              Deadline deadline) {
    const std::uint64_t call = collectives_;
    put(collective_name(rank()), mine, deadline);
    std::vector<std::span<std::byte>> empty_slots;
    if (slots.empty()) {
      empty_slots.resize(static_cast<std::size_t>(size()));
      slots = empty_slots;
    }
    const auto own = slots[static_cast<std::size_t>(rank())];
    if (!own.empty() && own.data() != mine.data())
      std::memmove(own.data(), mine.data(), own.size());
    await_all([&](int r) { return fmt::format("{}/c{}-r{}", window_prefix(), call, r); }, slots,
              deadline, "collective");
    ++collectives_;
  }

  // Polls for every other rank's object until all are there or `deadline` passes.
  template <typename Name>
  void await_all(Name&& name_of, std::span<const std::span<std::byte>> slots, Deadline deadline,
                 std::string_view what) {
    std::vector<int> missing;
    for (int r = 0; r < size(); ++r)
      if (r != rank()) missing.push_back(r);
    auto interval = options_.first_poll;
    for (;;) {
      std::erase_if(missing, [&](int r) {
        return fetch(name_of(r), r, slots[static_cast<std::size_t>(r)], deadline);
      });
      if (missing.empty()) return;
      if (Clock::now() >= deadline) {
        std::string ranks;
        for (const int r : missing)
          ranks += fmt::format("{}{}", ranks.empty() ? "" : ", ", r);
        throw TimeoutError(fmt::format("bucket group {}: no {} object from rank(s) {} (first "
                                       "missing: {}) before the deadline",
                                       address_.url(options_.job_id), what, ranks,
                                       address_.url(name_of(missing.front()))),
                           {.rank = rank(), .peer = missing.front(), .ranks = missing});
      }
      std::this_thread::sleep_until(std::min<Clock::time_point>(deadline, Clock::now() + interval));
      interval = std::min(options_.max_poll, interval * 2);
    }
  }

  BucketGroupOptions options_;
  io::S3Address address_;
  mutable std::mutex client_mutex_;
  io::S3Client client_;
  transport::TransportStats stats_;
  BucketRequests requests_;
  std::vector<std::uint64_t> sent_;
  std::vector<std::uint64_t> received_;
  std::uint64_t collectives_ = 0;
  std::uint64_t window_ = 0;
  std::map<std::uint64_t, std::vector<std::string>> written_;  // by window
  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mutex_;
  std::string abort_reason_;
};

BucketReceive::BucketReceive(BucketTransport& owner, std::string key, int peer,
                             std::span<std::byte> data)
    : owner_(owner),
      key_(std::move(key)),
      peer_(peer),
      data_(data),
      interval_(owner.options().first_poll) {}

bool BucketReceive::poll(std::optional<Deadline> deadline) {
  if (done_) return true;
  owner_.check_aborted();
  const auto now = Clock::now();
  if (now < next_poll_) return false;  // callers may test in a loop: poll at a modest rate
  done_ = owner_.fetch(key_, peer_, data_, deadline);
  if (!done_) {
    next_poll_ = now + interval_;
    interval_ = std::min(owner_.options().max_poll, interval_ * 2);
  }
  return done_;
}

void BucketReceive::wait(Deadline deadline) {
  for (;;) {
    if (poll(deadline)) return;
    if (Clock::now() >= deadline) {
      throw TimeoutError(
          fmt::format("no object {} from rank {} before the deadline", owner_.url(key_), peer_),
          {.rank = owner_.rank(), .peer = peer_});
    }
    std::this_thread::sleep_until(std::min(deadline, next_poll_));
  }
}

void validate(const BucketGroupOptions& options) {
  if (!io::is_s3_address(options.address)) {
    throw InvalidArgument(
        fmt::format("exchange bucket '{}' is not an s3://bucket/prefix address", options.address));
  }
  if (!valid_job_id(options.job_id)) {
    throw InvalidArgument(fmt::format(
        "a group through a bucket needs a job id (PULSELOCO_RUN_ID) of 1 to 128 letters, digits, "
        "'-', '_' or '.', not '{}'",
        options.job_id));
  }
  if (options.secret.empty()) {
    throw InvalidArgument(
        "a group through a bucket needs the job's secret (PULSELOCO_SECRET or "
        "PULSELOCO_SECRET_FILE): every object carries a MAC keyed with it");
  }
  if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
    throw InvalidArgument(fmt::format(
        "a group through a bucket needs rank and world size (RANK, WORLD_SIZE): rank {} of {}",
        options.rank, options.world_size));
  }
  if (options.first_poll.count() < 1 || options.max_poll < options.first_poll ||
      options.form_timeout.count() < 1) {
    throw InvalidArgument("bucket group: poll intervals and form timeout must be positive");
  }
}

}  // namespace

std::unique_ptr<transport::Transport> join_bucket_group(BucketGroupOptions options) {
  validate(options);
  auto group = std::make_unique<BucketTransport>(std::move(options));
  group->form();
  return group;
}

void label_bucket_window(transport::Transport& transport, std::uint64_t window) {
  if (auto* bucket = dynamic_cast<BucketTransport*>(&transport)) bucket->label(window);
}

BucketRequests bucket_requests(const transport::Transport& transport) {
  if (const auto* bucket = dynamic_cast<const BucketTransport*>(&transport))
    return bucket->requests();
  return {};
}

bool is_bucket_group(const transport::Transport& transport) noexcept {
  return dynamic_cast<const BucketTransport*>(&transport) != nullptr;
}

}  // namespace pulseloco
