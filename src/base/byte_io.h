// Fixed-layout little-endian messages: the one writer and the one reader behind every header,
// handshake, notice and status that pulseloco puts on the wire or on disk (codec headers, the
// TCP handshake, the rendezvous, the collectives' headers and notices, the engine's member
// status).
//
//   std::array<std::byte, 16> out;
//   ByteWriter(out).put<std::uint32_t>(kMagic).put<std::uint8_t>(version).zeros(3).put(size);
//
//   ByteReader in(bytes, {.rank = rank, .peer = peer});
//   const auto magic = in.get<std::uint32_t>("magic");   // ProtocolError when truncated
//
// A writer overrunning its buffer is a bug (PULSELOCO_CHECK); a reader running out of bytes is
// the peer's or the file's fault (ProtocolError naming the field and its byte offset).
#pragma once

#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <pulseloco/base/errors.h>

namespace pulseloco {

static_assert(std::endian::native == std::endian::little,
              "pulseloco reads and writes its little-endian fields with memcpy");

// A field of a fixed-layout message: an integer, a float or an enum of either.
template <typename T>
concept WireField = std::is_arithmetic_v<T> || std::is_enum_v<T>;

// The value of the field at `p` (unaligned).
template <WireField T>
[[nodiscard]] inline T load_le(const std::byte* p) noexcept {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

// Writes `value` at `p` (unaligned).
template <WireField T>
inline void store_le(std::byte* p, T value) noexcept {
  std::memcpy(p, &value, sizeof(T));
}

// Appends `value` to a growing message.
template <WireField T>
inline void append_le(std::vector<std::byte>& out, T value) {
  const std::size_t at = out.size();
  out.resize(at + sizeof(T));
  store_le(out.data() + at, value);
}

// Writes fields one after another into a buffer of known size.
class ByteWriter {
 public:
  explicit ByteWriter(std::span<std::byte> out) noexcept : out_(out) {}

  template <WireField T>
  ByteWriter& put(T value) {
    store_le(claim(sizeof(T)), value);
    return *this;
  }
  ByteWriter& put_bytes(std::span<const std::byte> bytes) {
    if (!bytes.empty()) std::memcpy(claim(bytes.size()), bytes.data(), bytes.size());
    return *this;
  }
  ByteWriter& put_bytes(std::span<const std::uint8_t> bytes) {
    return put_bytes(std::as_bytes(bytes));
  }
  // Reserved or padding bytes.
  ByteWriter& zeros(std::size_t n) {
    if (n > 0) std::memset(claim(n), 0, n);
    return *this;
  }

  [[nodiscard]] std::size_t position() const noexcept { return pos_; }
  [[nodiscard]] std::size_t remaining() const noexcept { return out_.size() - pos_; }

 private:
  std::byte* claim(std::size_t n) {
    PULSELOCO_CHECK(n <= remaining(), "a fixed-layout message overran its buffer");
    std::byte* at = out_.data() + pos_;
    pos_ += n;
    return at;
  }

  std::span<std::byte> out_;
  std::size_t pos_ = 0;
};

// Reads fields one after another from untrusted bytes. Every failure is a ProtocolError that
// carries `context` plus the byte offset concerned (`base_offset` + the position in `bytes`).
class ByteReader {
 public:
  explicit ByteReader(std::span<const std::byte> bytes, ErrorContext context = {},
                      std::uint64_t base_offset = 0)
      : bytes_(bytes), context_(std::move(context)), base_(base_offset) {}
  explicit ByteReader(std::span<const std::uint8_t> bytes, ErrorContext context = {},
                      std::uint64_t base_offset = 0)
      : ByteReader(std::as_bytes(bytes), std::move(context), base_offset) {}

  template <WireField T>
  [[nodiscard]] T get(std::string_view field) {
    need(sizeof(T), field);
    const T value = load_le<T>(bytes_.data() + pos_);
    pos_ += sizeof(T);
    return value;
  }
  // The next `n` bytes, without a copy.
  [[nodiscard]] std::span<const std::byte> take(std::uint64_t n, std::string_view field) {
    need(n, field);
    const auto out = bytes_.subspan(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return out;
  }
  // Copies the next out.size() bytes into `out`.
  void get_bytes(std::span<std::byte> out, std::string_view field) {
    const auto in = take(out.size(), field);
    if (!in.empty()) std::memcpy(out.data(), in.data(), in.size());
  }
  void get_bytes(std::span<std::uint8_t> out, std::string_view field) {
    get_bytes(std::as_writable_bytes(out), field);
  }
  void skip(std::uint64_t n, std::string_view field) { (void)take(n, field); }

  // Offset of the next byte in the whole message or file.
  [[nodiscard]] std::uint64_t offset() const noexcept { return base_ + pos_; }
  [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size() - pos_; }
  [[nodiscard]] const ErrorContext& context() const noexcept { return context_; }

  // ProtocolError(reason) at the current offset, or at `byte_offset`.
  [[noreturn]] void fail(std::string_view reason) const { fail_at(reason, offset()); }
  [[noreturn]] void fail_at(std::string_view reason, std::uint64_t byte_offset) const {
    ErrorContext context = context_;
    context.byte_offset = byte_offset;
    throw ProtocolError(reason, std::move(context));
  }

 protected:
  void need(std::uint64_t n, std::string_view field) const {
    if (n > remaining()) {
      fail("truncated: " + std::string(field) + " needs " + std::to_string(n) + " bytes, " +
           std::to_string(remaining()) + " left");
    }
  }
  [[nodiscard]] std::byte next_byte() noexcept { return bytes_[pos_++]; }

 private:
  std::span<const std::byte> bytes_;
  ErrorContext context_;
  std::uint64_t base_;
  std::size_t pos_ = 0;
};

}  // namespace pulseloco
