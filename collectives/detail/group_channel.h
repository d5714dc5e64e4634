// The group-wide channel of a collective made of collectives over views of the group
// (sparse_allgather_nodes): one 16-byte notice from every rank to every rank, `done` in the
// completion round, or `failure` naming the rank the sender blames, sent before it aborts (a
// view's collective tells only the view's members). Internal to collectives/.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/transport/subgroup.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::collectives::detail {

// Posts the receive of every peer's notice when built; the buffers must outlive the
// transport's abort when the call fails.
class GroupChannel {
 public:
  enum class Type : std::uint8_t { done = 1, failure = 2 };
  struct Notice {
    Type type = Type::done;
    ErrorKind kind = ErrorKind::peer_lost;
    int culprit = -1;
  };
  static constexpr std::size_t kBytes = 16;
  static constexpr std::uint32_t kMagic = 0x4E444E50;  // "PNDN"

  // `what` names the collective in error messages.
  GroupChannel(transport::Transport& transport, transport::Tag tag,
               std::chrono::milliseconds timeout, std::string_view what)
      : transport_(transport),
        what_(what),
        tag_(tag),
        timeout_(timeout),
        slice_(
            std::clamp(timeout / 16, std::chrono::milliseconds{1}, std::chrono::milliseconds{25})),
        in_(static_cast<std::size_t>(transport.size())),
        receives_(static_cast<std::size_t>(transport.size())),
        notices_(static_cast<std::size_t>(transport.size())),
        broken_(static_cast<std::size_t>(transport.size()), false) {
    for (int peer = 0; peer < transport_.size(); ++peer) {
      if (peer == transport_.rank()) continue;
      const auto index = static_cast<std::size_t>(peer);
      receives_[index] = transport_.irecv(peer, tag_, in_[index]);
    }
  }

  // Sends this rank's notice to every peer, once per call (best effort).
  void tell(Type type, ErrorKind kind, int culprit) {
    if (told_) return;
    told_ = true;
    ByteWriter(out_)
        .put(kMagic)
        .put(static_cast<std::uint8_t>(type))
        .put(static_cast<std::uint8_t>(kind))
        .zeros(2)
        .put(static_cast<std::int32_t>(culprit))
        .zeros(4);
    for (int peer = 0; peer < transport_.size(); ++peer) {
      if (peer == transport_.rank()) continue;
      try {
        sends_.push_back(transport_.isend(peer, tag_, out_));
      } catch (const Error&) {
        // The failure path learns nothing more from a broken link.
      }
    }
  }
  // Before an abort: lets the failure notices leave, for at most the settle time.
  void flush_failure() {
    const auto until = transport::Clock::now() + settle();
    for (auto& send : sends_) {
      try {
        send->wait(until);
      } catch (const Error&) {
      }
    }
  }

  // Follows the failure notices from `culprit`: a rank that says another rank failed passes
  // the blame on. Waits at most the settle time for a notice that has not come.
  [[nodiscard]] std::pair<int, ErrorKind> resolve(int culprit, ErrorKind kind) {
    const auto until = transport::Clock::now() + settle();
    std::vector<bool> seen(static_cast<std::size_t>(transport_.size()), false);
    while (culprit >= 0 && culprit < transport_.size() && culprit != transport_.rank() &&
           !seen[static_cast<std::size_t>(culprit)]) {
      seen[static_cast<std::size_t>(culprit)] = true;
      const std::optional<Notice> said = await(culprit, until);
      if (!said || said->type != Type::failure || said->culprit < 0 || said->culprit == culprit) {
        break;
      }
      kind = said->kind;
      culprit = said->culprit;
    }
    return {culprit, kind};
  }

  // The completion round: says `done` and waits for every peer's notice, each for at most
  // options.timeout after the last one came. Throws, naming the culprit, if one reports a
  // failure, its link breaks or it says nothing in time.
  void complete() {
    tell(Type::done, ErrorKind::peer_lost, -1);
    auto until = transport::Clock::now() + timeout_;
    for (;;) {
      int pending = -1;
      bool progressed = false;
      for (int peer = 0; peer < transport_.size(); ++peer) {
        if (peer == transport_.rank()) continue;
        const bool had = notices_[static_cast<std::size_t>(peer)].has_value();
        poll(peer);
        const auto& said = notices_[static_cast<std::size_t>(peer)];
        if (said && said->type == Type::failure) {
          fail_naming(said->culprit >= 0 ? said->culprit : peer, said->kind,
                      fmt::format("rank {} reports that the call failed", peer));
        }
        if (broken_[static_cast<std::size_t>(peer)])
          fail_naming(peer, ErrorKind::peer_lost, "its link broke in the completion round");
        if (!said && pending < 0) pending = peer;
        if (said && !had) progressed = true;
      }
      if (pending < 0) break;
      if (progressed) until = transport::Clock::now() + timeout_;
      if (transport::Clock::now() >= until) {
        fail_naming(pending, ErrorKind::timeout,
                    fmt::format("no completion notice within {} ms", timeout_.count()));
      }
      try {
        receives_[static_cast<std::size_t>(pending)]->wait(
            std::min(until, transport::Clock::now() + slice_));
      } catch (const TimeoutError&) {
      } catch (const Error&) {
        // poll() records it.
      }
    }
    for (std::size_t i = 0; i < sends_.size(); ++i) {
      try {
        sends_[i]->wait(transport::Clock::now() + timeout_);
      } catch (const Error& error) {
        const int peer = error.context().peer.value_or(-1);
        fail_naming(peer, error.kind(), error.message());
      }
    }
    transport_.retire_tag(tag_);
  }

 private:
  [[nodiscard]] std::chrono::milliseconds settle() const {
    return std::min(timeout_ / 4, std::chrono::milliseconds{250});
  }
  void poll(int peer) {
    const auto index = static_cast<std::size_t>(peer);
    if (peer == transport_.rank() || notices_[index] || broken_[index]) return;
    try {
      if (!receives_[index]->test()) return;
    } catch (const Error&) {
      broken_[index] = true;
      return;
    }
    ByteReader in(in_[index], {.rank = transport_.rank(), .peer = peer});
    const auto magic = in.get<std::uint32_t>("magic");
    const auto type = in.get<std::uint8_t>("type");
    const auto kind = in.get<std::uint8_t>("kind");
    (void)in.get<std::uint16_t>("padding");
    const auto culprit = in.get<std::int32_t>("culprit");
    if (magic != kMagic || (type != 1 && type != 2) ||
        kind > static_cast<std::uint8_t>(ErrorKind::aborted) || culprit < -1 ||
        culprit >= transport_.size()) {
      notices_[index] = Notice{.type = Type::failure, .kind = ErrorKind::protocol, .culprit = peer};
      return;
    }
    notices_[index] = Notice{
        .type = static_cast<Type>(type), .kind = static_cast<ErrorKind>(kind), .culprit = culprit};
  }
  [[nodiscard]] std::optional<Notice> await(int peer, transport::Clock::time_point until) {
    const auto index = static_cast<std::size_t>(peer);
    while (!notices_[index] && !broken_[index] && transport::Clock::now() < until) {
      try {
        receives_[index]->wait(std::min(until, transport::Clock::now() + slice_));
      } catch (const Error&) {
      }
      poll(peer);
      if (!notices_[index] && !broken_[index]) {
        try {
          if (receives_[index]->test()) poll(peer);
        } catch (const Error&) {
          broken_[index] = true;
        }
      }
    }
    return notices_[index];
  }
  [[noreturn]] void fail_naming(int culprit, ErrorKind kind, std::string_view detail) {
    const auto [blamed, blamed_kind] = resolve(culprit, kind);
    transport::throw_error_of_kind(
        blamed_kind == ErrorKind::aborted ? ErrorKind::peer_lost : blamed_kind,
        fmt::format("{} failed: rank {} failed ({})", what_, blamed, detail),
        {.rank = transport_.rank(), .peer = blamed});
  }

  transport::Transport& transport_;
  std::string what_;
  transport::Tag tag_;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds slice_;
  std::vector<std::array<std::byte, kBytes>> in_;
  std::vector<std::unique_ptr<transport::Request>> receives_;
  std::vector<std::optional<Notice>> notices_;
  std::vector<bool> broken_;
  std::array<std::byte, kBytes> out_{};
  bool told_ = false;
  std::vector<std::unique_ptr<transport::Request>> sends_;
};

}  // namespace pulseloco::collectives::detail
