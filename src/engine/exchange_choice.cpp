#include <pulseloco/engine/exchange_choice.h>

#include <algorithm>

#include <pulseloco/base/errors.h>

namespace pulseloco::engine_detail {

Exchange choose_exchange(const ExchangeInputs& inputs) {
  if (inputs.option == Exchange::reduction && inputs.ordered_transport) {
    throw InvalidArgument(
        "exchange=reduction needs a transport that matches messages by tag (TCP, MPI, "
        "in-process); this one matches them by order (NCCL)");
  }
  if (inputs.option != Exchange::automatic) return inputs.option;
  if (inputs.world < 3 || inputs.ordered_transport || !inputs.last) return Exchange::allgather;
  const ExchangeRecord& last = *inputs.last;
  if (last.generation != inputs.generation || last.world != inputs.world ||
      last.window + 1 != inputs.window || last.group_entries == 0) {
    return Exchange::allgather;
  }
  const double world = inputs.world;
  const double ratio =
      static_cast<double>(last.union_entries) / static_cast<double>(last.group_entries);
  return (1.0 + world * ratio) / world < kReductionAdvantage ? Exchange::reduction
                                                             : Exchange::allgather;
}

std::vector<std::size_t> owner_bounds(std::span<const ChunkRef> chunks, int world) {
  std::uint64_t total = 0;
  for (const ChunkRef& chunk : chunks)
    total += chunk.length;
  const auto owners = static_cast<std::uint64_t>(std::max(world, 1));
  std::vector<std::size_t> bounds{0};
  // Owner o's range ends before the first chunk whose middle lies at or past (o + 1)/R of the
  // elements.
  std::size_t c = 0;
  std::uint64_t before = 0;  // elements of chunks [0, c)
  for (std::uint64_t o = 1; o < owners; ++o) {
    const std::uint64_t target = total * o / owners;
    while (c < chunks.size() && before + chunks[c].length / 2 < target) {
      before += chunks[c].length;
      ++c;
    }
    bounds.push_back(c);
  }
  bounds.push_back(chunks.size());
  return bounds;
}

}  // namespace pulseloco::engine_detail
