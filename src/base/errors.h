// The one exception hierarchy of pulseloco.
//
// Every failure a caller can act on is a pulseloco::Error with a kind and a context naming what
// it concerns (rank, peer, tensor, element index, byte offset, diverging ranks). The message
// returned by what() already contains the context, so logging what() is always enough.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace pulseloco {

enum class ErrorKind : std::uint8_t {
  invalid_argument,  // a caller, a flag or a file asked for something impossible
  io,                // the operating system or a file failed
  timeout,           // a deadline passed
  peer_lost,         // a peer closed, crashed or became unreachable
  protocol,          // bytes from a peer or a file violate the wire/file format
  divergence,        // replicas that must be bit-identical are not
  non_finite,        // the training run produced NaN or infinity where the algorithm forbids it
  membership,        // this worker is not (or no longer) in the run's group, or the run stopped
  aborted,           // this rank gave up the group (abort(), an earlier failure): an
                     // AbortedError, which is also a PeerLostError
};
// The values travel in the collectives' failure notices: append new kinds, never renumber.

[[nodiscard]] std::string_view error_kind_name(ErrorKind kind) noexcept;

// What an error concerns. Unset fields are left out of the message.
struct ErrorContext {
  std::optional<int> rank;                   // the rank that raised the error
  std::optional<int> peer;                   // the remote rank concerned
  std::string tensor;                        // tensor name
  std::optional<std::uint64_t> index;        // element index within the tensor
  std::optional<std::uint64_t> byte_offset;  // offset in a message, frame or file
  std::vector<int> ranks;                    // several ranks (e.g. diverging replicas)
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string_view message, ErrorContext context = {});

  [[nodiscard]] ErrorKind kind() const noexcept { return kind_; }
  [[nodiscard]] const ErrorContext& context() const noexcept { return context_; }
  // The message without the kind prefix and the context suffix.
  [[nodiscard]] const std::string& message() const noexcept { return message_; }

 private:
  ErrorKind kind_;
  std::string message_;
  ErrorContext context_;
};

// Each class fixes its kind; a subclass of one (AbortedError) passes a finer kind up.
#define PULSELOCO_DEFINE_ERROR(Name, Kind)                                             \
  class Name : public Error {                                                          \
   public:                                                                             \
    explicit Name(std::string_view message, ErrorContext context = {})                 \
        : Error(ErrorKind::Kind, message, std::move(context)) {}                       \
                                                                                       \
   protected:                                                                          \
    Name(ErrorKind finer_kind, std::string_view message, ErrorContext context)         \
        : Error(finer_kind, message, std::move(context)) {}                            \
  }

PULSELOCO_DEFINE_ERROR(InvalidArgument, invalid_argument);
PULSELOCO_DEFINE_ERROR(IoError, io);
PULSELOCO_DEFINE_ERROR(TimeoutError, timeout);
PULSELOCO_DEFINE_ERROR(PeerLostError, peer_lost);
PULSELOCO_DEFINE_ERROR(ProtocolError, protocol);
PULSELOCO_DEFINE_ERROR(DivergenceError, divergence);
PULSELOCO_DEFINE_ERROR(NonFiniteError, non_finite);
PULSELOCO_DEFINE_ERROR(MembershipError, membership);

#undef PULSELOCO_DEFINE_ERROR

// An operation failed because this rank's transport was aborted (Transport::abort(), or a
// collective that failed before). The group is gone for this rank as if every peer were lost,
// so it is caught as a PeerLostError too; kind() tells the two apart. The message is the
// abort's reason.
class AbortedError : public PeerLostError {
 public:
  explicit AbortedError(std::string_view reason, ErrorContext context = {})
      : PeerLostError(ErrorKind::aborted, reason, std::move(context)) {}
};

// Formats "kind: message (raised on rank 1; peer 2; tensor 'w'; index 7; byte offset 9; ranks
// involved: 1, 3)".
[[nodiscard]] std::string format_error(ErrorKind kind, std::string_view message,
                                       const ErrorContext& context);

// Broken internal invariants are bugs, not recoverable errors: they abort with a message.
[[noreturn]] void invariant_failed(const char* condition, const char* file, int line,
                                   std::string_view detail);

}  // namespace pulseloco

#define PULSELOCO_CHECK(condition, detail)                                                   \
  do {                                                                                       \
    if (!(condition)) ::pulseloco::invariant_failed(#condition, __FILE__, __LINE__, detail); \
  } while (false)
