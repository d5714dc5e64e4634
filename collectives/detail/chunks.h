// Internal: cutting a message (bytes) or a vector segment (elements) into the pipeline's chunks,
// as every collective sends them. Internal to collectives/.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pulseloco::collectives::detail {

// Calls `piece(begin, end)` for consecutive pieces of [begin, end), in order, each of `chunk`
// units except the last (chunk > 0). Nothing for an empty range.
template <class Piece>
void for_each_chunk(std::uint64_t begin, std::uint64_t end, std::uint64_t chunk,
                    const Piece& piece) {
  for (std::uint64_t at = begin; at < end; at += chunk)
    piece(at, std::min(end, at + chunk));
}

// A piece of a message: `bytes` bytes from `offset`.
struct MessageChunk {
  std::size_t offset = 0;
  std::size_t bytes = 0;
  [[nodiscard]] bool last_of(std::uint64_t size) const { return offset + bytes == size; }
};

// The pieces of a message of `size` bytes, in order (for_each_chunk).
[[nodiscard]] inline std::vector<MessageChunk> message_chunks(std::uint64_t size,
                                                              std::size_t chunk) {
  std::vector<MessageChunk> pieces;
  for_each_chunk(0, size, chunk, [&](std::uint64_t begin, std::uint64_t end) {
    pieces.push_back({static_cast<std::size_t>(begin), static_cast<std::size_t>(end - begin)});
  });
  return pieces;
}

}  // namespace pulseloco::collectives::detail
