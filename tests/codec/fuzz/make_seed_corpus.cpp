// Writes the libFuzzer seed corpus: small valid messages covering every encoding, index coding,
// raw and compressed streams, sparse and dense planes, empty frames and tensors, and 64-bit
// tensor indices. Usage: codec_fuzz_seeds DIRECTORY
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <pulseloco/codec/context_coding.h>
#include <pulseloco/codec/message.h>
#include "codec/codec_test_util.h"
#include "codec/fuzz/fuzz_common.h"

namespace {

using namespace pulseloco::codec;
using testing::Bytes;
using testing::Chunk;

Chunk chunk_of(std::mt19937_64& rng, std::uint32_t tensor, std::uint64_t begin,
               std::uint64_t length, double density, bool grid_values) {
  Chunk chunk{.tensor = tensor,
              .begin = begin,
              .length = length,
              .offsets = testing::random_offsets(rng, length, density)};
  for (std::size_t i = 0; i < chunk.offsets.size(); ++i) {
    float v = testing::random_value(rng);
    if (grid_values) v = std::bit_cast<float>(std::bit_cast<std::uint32_t>(v) & 0xFFFFF000u);
    chunk.values.push_back(v);
  }
  return chunk;
}

// `multiples`: every chunk's residue multiples (FrameEntries::residue_multiples).
Bytes message_of(const MessageHeader& header, const std::vector<Chunk>& chunks,
                 const EncodeOptions& options, std::span<const std::uint8_t> multiples = {}) {
  MessageHeader h = header;
  h.encoding = options.encoding;
  Bytes out = encode_header(h, static_cast<std::uint32_t>(chunks.size()));
  for (const Chunk& c : chunks) {
    FrameEntries entries = c.entries();
    const std::vector<float> context = options.encoding == Encoding::context
                                           ? fuzz::fuzz_context(c.begin, c.length)
                                           : std::vector<float>{};
    entries.context = context;
    entries.residue_multiples = multiples;
    testing::append(out, encode_frame(entries, options));
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIRECTORY\n", argv[0]);
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::filesystem::create_directories(dir);
  std::mt19937_64 rng(2024);
  int written = 0;
  const auto write = [&](const Bytes& bytes) {
    std::ofstream file(dir / ("seed-" + std::to_string(written++)), std::ios::binary);
    file.write(reinterpret_cast<const char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()));
  };
  std::vector<EncodeOptions> options = {{.encoding = Encoding::pulse},
                                        {.encoding = Encoding::plain_i64_f32},
                                        {.encoding = Encoding::plain_i32_f32}};
  for (const auto coding : {IndexCoding::varint, IndexCoding::bitpack, IndexCoding::elias_fano}) {
    options.push_back({.encoding = Encoding::pulse, .index_coding = coding});
    options.push_back({.encoding = Encoding::context, .index_coding = coding});
  }
  options.push_back({.encoding = Encoding::context, .index_coding = IndexCoding::exponent_groups});
  for (const EncodeOptions& o : options) {
    // Tiny: one entry; empty chunks; a zero-element tensor.
    write(message_of(MessageHeader{.tensor_numels = {8, 0}}, {chunk_of(rng, 0, 0, 8, 0.2, false)},
                     o));
    write(message_of(MessageHeader{.window = 3, .tensor_numels = {100, 30}},
                     {chunk_of(rng, 0, 0, 50, 0.0, false), chunk_of(rng, 0, 50, 50, 0.3, true),
                      chunk_of(rng, 1, 0, 30, 1.0, false)},
                     o));
    // Compressed streams and sparse planes: a few hundred entries of grid values.
    write(message_of(MessageHeader{.tensor_numels = {3000}},
                     {chunk_of(rng, 0, 0, 3000, 0.15, true)}, o));
    // A chunk beyond 2^32 in a large tensor.
    write(message_of(MessageHeader{.tensor_numels = {std::uint64_t{5} << 30}},
                     {Chunk{.tensor = 0,
                            .begin = std::uint64_t{4} << 30,
                            .length = 1u << 20,
                            .offsets = {0, 7, (1u << 20) - 1},
                            .values = {1.0f, -0.0f, 3e-40f}}},
                     o));
  }
  // Context frames proper: values near half an ulp of bf16(θ_g) on θ_g's fp32 grid, so that
  // coding them against fuzz_context pays (random values fall back to pulse frames).
  for (const auto coding : {IndexCoding::varint, IndexCoding::bitpack, IndexCoding::elias_fano,
                            IndexCoding::exponent_groups}) {
    Chunk chunk = chunk_of(rng, 0, 0, 3000, 0.1, false);
    const std::vector<float> context = fuzz::fuzz_context(0, 3000);
    for (std::size_t i = 0; i < chunk.offsets.size(); ++i) {
      const auto c = std::bit_cast<std::uint32_t>(context[chunk.offsets[i]]);
      const std::uint32_t exponent = (c >> 23) & 0xFFu;
      const std::uint32_t v = std::bit_cast<std::uint32_t>(chunk.values[i]);
      chunk.values[i] = exponent > 16 && exponent < 255
                            ? std::bit_cast<float>((v & 0x807FFF00u) | ((exponent - 8) << 23))
                            : 0.5f;
    }
    write(message_of(MessageHeader{.tensor_numels = {3000}}, {chunk},
                     {.encoding = Encoding::context, .index_coding = coding}));
  }
  // Context frames whose values go less their context's bf16 cast residue: each value the
  // residue plus a bf16 ulp of θ_g, at the elements whose context is finite; or, as an owner's
  // sums, k times the residue plus such ulps, with residue multiples k of 1 to 4.
  for (const bool summed : {false, true}) {
    for (const auto coding : {IndexCoding::varint, IndexCoding::exponent_groups}) {
      const Chunk fired = chunk_of(rng, 0, 0, 3000, 0.1, false);
      const std::vector<float> context = fuzz::fuzz_context(0, 3000);
      Chunk chunk = fired;
      chunk.offsets.clear();
      chunk.values.clear();
      std::vector<std::uint8_t> multiples;
      for (const std::uint32_t offset : fired.offsets) {
        const float c = context[offset];
        if (!std::isfinite(c) || c == 0.0f) continue;
        const auto k = static_cast<std::uint8_t>(summed ? 1 + offset % 4 : 1);
        chunk.offsets.push_back(offset);
        chunk.values.push_back(detail::residue_times(c, k) +
                               std::ldexp(1.0f, std::ilogb(c) - 7) * (offset % 2 ? 1.0f : -2.0f));
        multiples.push_back(k);
      }
      const Bytes message =
          message_of(MessageHeader{.tensor_numels = {3000}}, {chunk},
                     {.encoding = Encoding::context, .index_coding = coding}, multiples);
      const std::size_t frame_at = MessageView::parse(message).frame(0).byte_offset;
      const std::uint8_t expected =
          summed ? detail::kContextLessResidue | detail::kContextResidueMultiples
                 : detail::kContextLessResidue;
      if (std::to_integer<std::uint8_t>(message[frame_at + 7]) != expected) {
        std::fprintf(stderr, "a residue seed's frame does not code its values less the residue%s\n",
                     summed ? " multiples" : "");
        return 1;
      }
      write(message);
    }
  }
  std::printf("wrote %d seeds to %s\n", written, dir.c_str());
  return 0;
}
