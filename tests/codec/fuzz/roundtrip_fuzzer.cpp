// libFuzzer target: the encoder and decoder on arbitrary entries. The input describes a chunk
// (length, gaps, value bits) and the encode options; the decoded frame must equal it bit for
// bit in every encoding (the context encoding against fuzz_context, each entry's residue
// multiple 1 + its gap byte's top two bits).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_common.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace pulseloco::codec;
  if (size < 6) return 0;
  // Byte 0: options; bytes 1..4: chunk length; then per entry: a gap byte (0xFF: the next
  // four bytes are a 32-bit gap) and four value bytes.
  const std::uint8_t options_byte = data[0];
  std::uint32_t length_bits;
  std::memcpy(&length_bits, data + 1, 4);
  // Options byte % 4 == 3: the context encoding, over chunks of at most kMaxFuzzContext.
  const bool context = options_byte % 4 == 3;
  const std::uint64_t length =
      1 + length_bits % (context ? fuzz::kMaxFuzzContext : (std::uint64_t{1} << 31));
  std::vector<std::uint32_t> offsets;
  std::vector<float> values;
  std::vector<std::uint8_t> multiples;  // the context encoding's residue multiples
  std::uint64_t next = 0;
  std::size_t at = 5;
  while (at < size) {
    const std::uint8_t gap_byte = data[at];
    std::uint64_t gap = data[at++];
    if (gap == 0xFF && size - at >= 4) {
      std::uint32_t wide;
      std::memcpy(&wide, data + at, 4);
      at += 4;
      gap = wide;
    }
    if (size - at < 4) break;
    std::uint32_t bits;
    std::memcpy(&bits, data + at, 4);
    at += 4;
    if ((bits & 0x7F800000u) == 0x7F800000u) bits &= 0xFF7FFFFFu;  // keep it finite
    if (next + gap >= length) break;
    offsets.push_back(static_cast<std::uint32_t>(next + gap));
    values.push_back(std::bit_cast<float>(bits));
    multiples.push_back(static_cast<std::uint8_t>(1 + (gap_byte >> 6)));
    next = next + gap + 1;
  }
  const std::uint64_t begin = (options_byte & 0x80) != 0 ? (std::uint64_t{3} << 31) : 0;
  const MessageHeader header{.window = options_byte, .tensor_numels = {begin + length}};
  fuzz::DecodedFrame frame;
  frame.info.tensor = 0;
  frame.info.begin = begin;
  frame.info.length = length;
  frame.info.entries = offsets.size();
  frame.offsets = offsets;
  frame.values = values;
  if (context) frame.residue_multiples = multiples;
  const std::vector<fuzz::DecodedFrame> frames = {frame};
  EncodeOptions options;
  options.encoding = static_cast<Encoding>(options_byte % 4);
  if ((options.encoding == Encoding::pulse || context) && (options_byte & 0x0C) != 0) {
    options.index_coding = static_cast<IndexCoding>(((options_byte >> 2) & 3) - 1);
  }
  if (context && (options_byte & 0x40) != 0) options.index_coding = IndexCoding::exponent_groups;
  options.zstd_level = 1 + ((options_byte >> 4) & 3);
  fuzz::check_round_trip(header, frames, options);
  return 0;
}
