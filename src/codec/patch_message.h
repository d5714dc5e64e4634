// The compact bf16 weight patch (docs/wire-format.md, "Compact patches"): one version's changed
// elements for a receiver that holds the parent version. Per tensor, the indices in the
// smallest of the window frames' index codings (index_coding.h) and each new value as the
// zigzag of its bf16 bit pattern minus the bits it replaces (mod 2^16), the low bytes then the
// high bytes, each stream zstd-compressed when that is smaller. The header names the version,
// its parent and the digests of the parent and of the result; an xxh3-64 of every byte before it
// ends the message.
//
// Decoding treats the bytes as hostile (the "Decoding limits" of docs/wire-format.md): parse()
// checks the layout and the checksum against the bytes present before anything is sized by
// them; decode() checks a tensor against the tensor the receiver holds (element count), so
// what it allocates is bounded by that tensor.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/base/digest.h>
#include <pulseloco/codec/message.h>

namespace pulseloco::codec {

struct PatchMessageHeader {
  std::uint64_t version = 0;
  std::uint64_t parent_version = 0;
  Digest parent_digest = 0;
  Digest digest = 0;
};

// One changed tensor: indices strictly ascending below numel (at most 2^31), the new bf16 bits
// and the bits they replace.
struct PatchTensorEntries {
  std::string_view name;
  std::uint64_t numel = 0;
  std::span<const std::uint32_t> indices;
  std::span<const std::uint16_t> values;
  std::span<const std::uint16_t> previous;
};

// Throws InvalidArgument for inconsistent entries or a zstd level outside 1..kMaxZstdLevel.
[[nodiscard]] std::vector<std::byte> encode_patch_message(
    const PatchMessageHeader& header, std::span<const PatchTensorEntries> tensors,
    int zstd_level = kDefaultZstdLevel);

struct PatchTensorRecord {
  std::string name;
  std::uint64_t numel = 0;
  std::uint64_t entries = 0;
  IndexCoding index_coding = IndexCoding::varint;
  std::uint64_t byte_offset = 0;  // of the record in the message
  std::uint64_t byte_size = 0;    // the record with its streams
};

class PatchMessageView {
 public:
  // Checks the magic, format version, reserved fields, checksum and every record's layout.
  // Throws ProtocolError naming the byte offset. `bytes` must outlive the view.
  [[nodiscard]] static PatchMessageView parse(std::span<const std::byte> bytes);

  [[nodiscard]] const PatchMessageHeader& header() const noexcept { return header_; }
  [[nodiscard]] const std::vector<PatchTensorRecord>& tensors() const noexcept { return records_; }

  // Decodes tensor `i` for a receiver whose tensor of that name holds `held` (its current bf16
  // bits): checks the element count, the streams, the indices (canonical, strictly ascending,
  // below numel); writes the indices and the new values. Throws ProtocolError naming the tensor.
  void decode(std::size_t i, std::span<const std::uint16_t> held,
              std::vector<std::uint32_t>& indices, std::vector<std::uint16_t>& values) const;

 private:
  struct Streams {
    std::uint8_t flags = 0;
    std::uint64_t index_raw_bytes = 0;
    std::span<const std::byte> index;
    std::span<const std::byte> values;
    std::uint64_t index_offset = 0;
    std::uint64_t values_offset = 0;
  };
  PatchMessageHeader header_;
  std::vector<PatchTensorRecord> records_;
  std::vector<Streams> streams_;
};

}  // namespace pulseloco::codec
