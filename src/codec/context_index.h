// Internal: the `exponent_groups` index coding of a context frame (docs/wire-format.md, "Index
// coding: exponent_groups"). The chunk's elements are grouped by the 8-bit exponent field of
// their context value (θ_g; the field is the same in fp32 and bf16). Per group, in ascending
// exponent order and only for the groups the chunk has, the stream gives how many elements of the
// group fired and, where that is neither none nor all, one parameter byte; then, group by group,
// the Rice codes of the gaps between the group-local ranks of the coded elements (the fired ones,
// or where the parameter says so the ones that did not fire). The decoder holds the same context,
// so it knows each group's size and finds its members: a common exponent's with a pass over the
// chunk's exponents each, the rare ones' all in one pass (context_index.cpp, RareGroups).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace pulseloco::codec::detail {

// The parameter byte: the Rice parameter k in the low 5 bits, bit 7 set when the group codes the
// elements that did not fire; bits 5 and 6 are zero.
inline constexpr std::uint8_t kGroupComplement = 0x80;
inline constexpr std::uint8_t kGroupRiceMask = 0x1F;

// One group of a chunk with fired elements.
struct ExponentGroup {
  std::uint8_t exponent = 0;
  std::uint32_t fired = 0;
  std::uint64_t size = 0;  // elements of the chunk in the group
  std::uint8_t parameter = 0;
  std::size_t first = 0;  // its entries in GroupScratch::sorted
};

// Scratch of both directions, reused across frames.
struct GroupScratch {
  std::vector<std::uint8_t> exponents;      // one per chunk element
  std::vector<std::uint32_t> ranks;         // encoder: the fired offsets, ordered by group
  std::vector<std::uint32_t> sorted;        // ... and their group-local ranks
  std::vector<std::uint64_t> words;         // a common group's membership bitmap
  std::vector<std::uint32_t> prefix;        // ... and its members before each word
  std::vector<std::uint64_t> coded;         // decoder: a group's coded ranks, as a bitmap
  std::vector<std::uint64_t> fired;         // ... and the fired elements' bitmap
  std::unique_ptr<std::uint32_t[]> rare;    // the rare groups' members, ascending
  std::size_t rare_capacity = 0;            // ... room for so many
  std::vector<std::uint32_t> rare_members;  // ... sorted by group
  std::vector<ExponentGroup> group_list;
};

// Writes the coding of `offsets` (strictly ascending, below context.size()) to `out` (resized
// as needed) and returns its size, or 0 when it would exceed `max_bytes` (the caller then codes
// the indices otherwise).
[[nodiscard]] std::uint64_t encode_grouped_indices(std::span<const std::uint32_t> offsets,
                                                   std::span<const float> context,
                                                   std::uint64_t max_bytes, GroupScratch& scratch,
                                                   std::vector<std::byte>& out);

// Decodes n offsets from `raw` (followed by 16 readable zero bytes) against `context` into `out`
// (room for n). Checks every count against its group's size, the counts' sum against n, the
// parameter bytes, every rank against its group, that the stream is exactly consumed and its
// padding bits zero. Throws ProtocolError; offsets as in decode_indices.
void decode_grouped_indices(std::span<const std::byte> raw, std::uint64_t n,
                            std::span<const float> context, std::uint32_t* out,
                            GroupScratch& scratch, std::uint64_t stream_offset,
                            bool stream_was_compressed);

}  // namespace pulseloco::codec::detail
