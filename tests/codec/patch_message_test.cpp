// The compact patch (codec/patch_message.h): round trips of realistic entries (values a few
// ulps from the ones they replace, signed zeros, sign changes, every index coding), every
// single-bit flip refused by the checksum, and a well-checksummed message whose fields lie
// refused before it allocates by them.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/digest.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/codec/patch_message.h>

namespace pulseloco::codec {
namespace {

struct Tensor {
  std::string name;
  std::vector<std::uint16_t> held;  // the receiver's bits before the patch
  std::vector<std::uint32_t> indices;
  std::vector<std::uint16_t> values;
};

// Every `stride`-th element moves by a few ulps; a few edge values among them.
Tensor make_tensor(std::string name, std::uint32_t numel, std::uint32_t stride,
                   std::uint64_t seed) {
  Tensor t{.name = std::move(name), .held = std::vector<std::uint16_t>(numel)};
  std::uint64_t state = seed;
  const auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<std::uint32_t>(state >> 33);
  };
  for (auto& bits : t.held)
    bits = static_cast<std::uint16_t>(0x3C00 + next() % 0x600) | ((next() & 1) << 15);
  for (std::uint32_t i = next() % stride; i < numel; i += 1 + next() % (2 * stride)) {
    t.indices.push_back(i);
    const auto step = static_cast<std::int16_t>(static_cast<int>(next() % 7) - 3);
    t.values.push_back(static_cast<std::uint16_t>(t.held[i] + (step == 0 ? 1 : step)));
  }
  if (t.indices.size() > 3) {
    t.held[t.indices[0]] = 0x0000, t.values[0] = 0x8000;  // +0 -> -0
    t.held[t.indices[1]] = 0x0001, t.values[1] = 0x8001;  // a sign change
    t.values[2] = 0x7F80;                                 // to +inf
  }
  return t;
}

std::vector<std::byte> encode(const std::vector<Tensor>& tensors) {
  std::vector<std::vector<std::uint16_t>> previous;
  std::vector<PatchTensorEntries> entries;
  for (const Tensor& t : tensors) {
    previous.emplace_back();
    for (const std::uint32_t i : t.indices)
      previous.back().push_back(t.held[i]);
  }
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    entries.push_back({.name = tensors[k].name,
                       .numel = tensors[k].held.size(),
                       .indices = tensors[k].indices,
                       .values = tensors[k].values,
                       .previous = previous[k]});
  }
  return encode_patch_message(
      {.version = 9, .parent_version = 8, .parent_digest = 0x1234, .digest = 0x5678}, entries);
}

TEST(PatchMessage, RoundTrips) {
  // Dense, medium and very sparse tensors choose different index codings.
  const std::vector<Tensor> tensors = {
      make_tensor("a", 100'000, 2, 1), make_tensor("b", 200'000, 60, 2),
      make_tensor("c", 1'000'000, 100'000, 3),
      Tensor{.name = "empty", .held = std::vector<std::uint16_t>(5)}};
  const std::vector<std::byte> bytes = encode(tensors);
  const PatchMessageView view = PatchMessageView::parse(bytes);
  EXPECT_EQ(view.header().version, 9u);
  EXPECT_EQ(view.header().parent_version, 8u);
  EXPECT_EQ(view.header().parent_digest, 0x1234u);
  EXPECT_EQ(view.header().digest, 0x5678u);
  ASSERT_EQ(view.tensors().size(), tensors.size());
  std::uint64_t entries = 0;
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    std::vector<std::uint32_t> indices;
    std::vector<std::uint16_t> values;
    view.decode(k, tensors[k].held, indices, values);
    EXPECT_EQ(view.tensors()[k].name, tensors[k].name);
    EXPECT_EQ(indices, tensors[k].indices) << k;
    EXPECT_EQ(values, tensors[k].values) << k;
    entries += indices.size();
  }
  // Values relative to the replaced ones and coded indices: far below TRL's 4 bytes per entry.
  EXPECT_LT(bytes.size(), entries * 4 / 2.5);
}

TEST(PatchMessage, EveryBitFlipIsRefused) {
  const std::vector<std::byte> clean = encode({make_tensor("w", 5'000, 10, 4)});
  for (std::size_t bit = 0; bit < clean.size() * 8; bit += 3) {
    std::vector<std::byte> bytes = clean;
    bytes[bit / 8] ^= std::byte{static_cast<std::uint8_t>(1u << (bit % 8))};
    EXPECT_THROW((void)PatchMessageView::parse(bytes), ProtocolError) << bit;
  }
  std::vector<std::byte> truncated(clean.begin(), clean.end() - 1);
  EXPECT_THROW((void)PatchMessageView::parse(truncated), ProtocolError);
}

// Rewrites the checksum after a change, as a forger would.
void reseal(std::vector<std::byte>& bytes) {
  const std::size_t body = bytes.size() - 8;
  store_le(bytes.data() + body, digest_bytes(std::span(bytes).first(body)));
}

TEST(PatchMessage, LyingFieldsAreRefusedAgainstTheHeldTensor) {
  const Tensor t = make_tensor("w", 5'000, 10, 5);
  const std::vector<std::byte> clean = encode({t});
  std::vector<std::uint32_t> indices;
  std::vector<std::uint16_t> values;
  // The receiver's tensor has another size.
  const PatchMessageView view = PatchMessageView::parse(clean);
  const std::vector<std::uint16_t> other(4'999);
  EXPECT_THROW(view.decode(0, other, indices, values), ProtocolError);

  // Record fields at their offsets: header 48, name length 2 + "w", numel, entries, coding...
  constexpr std::size_t kRecord = 48 + 2 + 1;
  {
    std::vector<std::byte> bytes = clean;  // more entries than elements
    store_le<std::uint64_t>(bytes.data() + kRecord + 8, 5'001);
    reseal(bytes);
    EXPECT_THROW((void)PatchMessageView::parse(bytes), ProtocolError);
  }
  {
    std::vector<std::byte> bytes = clean;  // an index stream larger than its entries allow
    store_le<std::uint64_t>(bytes.data() + kRecord + 20, std::uint64_t{1} << 40);
    reseal(bytes);
    const PatchMessageView lying = PatchMessageView::parse(bytes);
    EXPECT_THROW(lying.decode(0, t.held, indices, values), ProtocolError);
  }
  {
    std::vector<std::byte> bytes = clean;  // an unknown index coding
    bytes[kRecord + 16] = std::byte{7};
    reseal(bytes);
    EXPECT_THROW((void)PatchMessageView::parse(bytes), ProtocolError);
  }
  {
    // A tensor without entries whose (empty) streams claim to be zstd frames: one coding per
    // record, so flags 0.
    const Tensor empty{.name = "w", .held = std::vector<std::uint16_t>(5)};
    std::vector<std::byte> bytes = encode({empty});
    const PatchMessageView plain = PatchMessageView::parse(bytes);
    EXPECT_NO_THROW(plain.decode(0, empty.held, indices, values));
    bytes[kRecord + 17] = std::byte{1};  // flags
    reseal(bytes);
    const PatchMessageView flagged = PatchMessageView::parse(bytes);
    EXPECT_THROW(flagged.decode(0, empty.held, indices, values), ProtocolError);
  }
}

}  // namespace
}  // namespace pulseloco::codec
