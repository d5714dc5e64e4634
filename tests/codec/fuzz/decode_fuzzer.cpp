// libFuzzer target: the message decoder on hostile bytes.
//
// Each input is tried twice: as received (most mutations fail a checksum, which is the point
// of checksums) and with every checksum recomputed (so mutations reach the structural and
// content validation behind them, as from a hostile sender). Whatever decodes must satisfy the
// decoder's promises and re-encode losslessly in every encoding, and the frame-by-frame reader
// must accept exactly what the view accepts, with the same entries. Any exception other than
// ProtocolError, any sanitizer report and any broken invariant is a finding.
//   build: tests/codec/sanitized (clang-14, -fsanitize=fuzzer,address,undefined)
//   run:   see docs/wire-format.md, "Fuzzing"
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "fuzz_common.h"

namespace {

using namespace pulseloco::codec;

void run(std::span<const std::byte> bytes) {
  std::vector<fuzz::DecodedFrame> frames;
  MessageHeader header;
  const bool decoded = fuzz::decode_all(bytes, frames, header);
  fuzz::check_reader_agrees(bytes, decoded, frames, header);
  // The streaming parser on every shorter prefix length class must not misbehave either.
  if (bytes.size() > kHeaderPrefixBytes) {
    try {
      const auto view = MessageView::parse_prefix(
          bytes.first(bytes.size() / 2 + 16 > bytes.size() ? bytes.size() : bytes.size() / 2 + 16),
          fuzz::fuzz_limits());
      if (view.frame_count() > view.announced_frame_count()) fuzz::violated("prefix frames");
    } catch (const pulseloco::ProtocolError&) {
    }
  }
  if (!decoded) return;
  for (const Encoding encoding :
       {Encoding::pulse, Encoding::plain_i64_f32, Encoding::plain_i32_f32}) {
    fuzz::check_round_trip(header, frames, {.encoding = encoding});
  }
  if (std::all_of(frames.begin(), frames.end(), [](const fuzz::DecodedFrame& f) {
        return f.info.length <= fuzz::kMaxFuzzContext;
      })) {
    fuzz::check_round_trip(header, frames, {.encoding = Encoding::context});
    fuzz::check_round_trip(
        header, frames,
        {.encoding = Encoding::context, .index_coding = IndexCoding::exponent_groups});
  }
  fuzz::check_round_trip(header, frames,
                         {.encoding = Encoding::pulse, .index_coding = IndexCoding::elias_fano});
  fuzz::check_round_trip(header, frames,
                         {.encoding = Encoding::pulse, .index_coding = IndexCoding::bitpack});
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  run(bytes);
  std::vector<std::byte> fixed(bytes.begin(), bytes.end());
  testing::refresh_checksums(fixed);
  run(fixed);
  return 0;
}
