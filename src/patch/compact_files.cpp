#include <pulseloco/patch/compact_files.h>

#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include <pulseloco/base/errors.h>
#include <pulseloco/codec/patch_message.h>

namespace pulseloco::patch {
namespace {

[[noreturn]] void bad_patch(std::string_view source, const Error& error) {
  throw ProtocolError(fmt::format("{} is not a valid compact patch: {}", source, error.message()),
                      error.context());
}

}  // namespace

// A compact patch of the held state stores at most 7 bytes per element (a 5-byte varint gap
// and a 2-byte value; a stream is stored raw when zstd would not shrink it) and a record of at
// most 64 KiB + 58 bytes per tensor.
std::uint64_t max_compact_bytes(const Bf16State& held) {
  return 7 * held.total_elements() + ((std::uint64_t{64} << 10) + 58) * held.tensors().size() + 56;
}

std::filesystem::path compact_file_name(std::uint64_t version) {
  return std::filesystem::path("compact") / fmt::format("step_{:06d}.plsp", version);
}

io::FileChecksum write_compact_file(const std::filesystem::path& path, const Delta& delta) {
  std::vector<codec::PatchTensorEntries> tensors;
  for (const TensorDelta& tensor : delta.tensors) {
    tensors.push_back({.name = tensor.name,
                       .numel = tensor.numel,
                       .indices = tensor.indices,
                       .values = tensor.values,
                       .previous = tensor.previous});
  }
  const std::vector<std::byte> bytes =
      codec::encode_patch_message({.version = delta.version,
                                   .parent_version = delta.parent_version,
                                   .parent_digest = delta.parent_digest,
                                   .digest = delta.digest},
                                  tensors);
  return io::FileChecksum{.size = bytes.size(), .digest = io::write_file_atomically(path, bytes)};
}

Delta read_compact_file(const std::filesystem::path& path, const Bf16State& held) {
  const std::vector<std::byte> bytes = io::read_file(path, max_compact_bytes(held));
  return read_compact_patch(bytes, held, fmt::format("'{}'", path.string()));
}

Delta read_compact_patch(std::span<const std::byte> bytes, const Bf16State& held,
                         std::string_view source) {
  try {
    const codec::PatchMessageView view = codec::PatchMessageView::parse(bytes);
    Delta delta{.version = view.header().version,
                .parent_version = view.header().parent_version,
                .parent_digest = view.header().parent_digest,
                .digest = view.header().digest,
                .total_elements = held.total_elements()};
    for (std::size_t i = 0; i < view.tensors().size(); ++i) {
      const std::string& name = view.tensors()[i].name;
      const Bf16Tensor* tensor = held.find(name);
      if (tensor == nullptr || (!delta.tensors.empty() && delta.tensors.back().name >= name)) {
        throw ProtocolError("a tensor the receiver does not hold, or out of name order",
                            ErrorContext{.tensor = name});
      }
      TensorDelta entries{.name = name, .numel = tensor->bits.size()};
      view.decode(i, tensor->bits, entries.indices, entries.values);
      const auto nan = std::find_if(entries.values.begin(), entries.values.end(),
                                    [](std::uint16_t bits) { return (bits & 0x7FFFu) > 0x7F80u; });
      if (nan != entries.values.end()) {
        throw ProtocolError(
            "a new value is NaN",
            ErrorContext{
                .tensor = name,
                .index = entries.indices[static_cast<std::size_t>(nan - entries.values.begin())]});
      }
      delta.tensors.push_back(std::move(entries));
    }
    return delta;
  } catch (const ProtocolError& error) {
    bad_patch(source, error);
  }
}

}  // namespace pulseloco::patch
