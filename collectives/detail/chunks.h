// Internal: cutting a message (bytes) or a vector segment (elements) into the pipeline's chunks,
// as both algorithms of the all-gather and of the all-reduce send them. Internal to collectives/.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pulseloco::collectives::detail {

// Calls `piece(begin, end)` for consecutive pieces of [begin, end), in order, each of `chunk`
// units except the last (chunk > 0). Nothing for an empty range.
template <class Piece>
void for_each_chunk(std::uint64_t begin, std::uint64_t end, std::uint64_t chunk,
                    const Piece& piece) {
  for (std::uint64_t at = begin; at < end; at += chunk)
    piece(at, std::min(end, at + chunk));
}

}  // namespace pulseloco::collectives::detail
