#include <pulseloco/codec/patch_message.h>

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/codec/index_coding.h>
#include <pulseloco/codec/zstd_frames.h>

namespace pulseloco::codec {
namespace {

constexpr std::byte kPatchMagic[4] = {std::byte{'P'}, std::byte{'L'}, std::byte{'S'},
                                      std::byte{'P'}};
constexpr std::uint16_t kPatchFormatVersion = 1;
constexpr std::size_t kPatchHeaderBytes = 48;  // magic .. reserved after the tensor count
constexpr std::uint8_t kIndexCompressed = 1;
constexpr std::uint8_t kValuesCompressed = 2;
constexpr std::uint64_t kMaxTensorNumel = std::uint64_t{1} << 31;

// The value of a new bf16 pattern relative to the one it replaces: the zigzag of their
// difference as a 16-bit signed number (small steps of a few ulps become small numbers).
std::uint16_t relative_value(std::uint16_t value, std::uint16_t previous) {
  const auto d = static_cast<std::int16_t>(static_cast<std::uint16_t>(value - previous));
  return static_cast<std::uint16_t>((static_cast<std::uint16_t>(d) << 1) ^
                                    static_cast<std::uint16_t>(d >> 15));
}

std::uint16_t absolute_value(std::uint16_t relative, std::uint16_t previous) {
  const auto d = static_cast<std::uint16_t>((relative >> 1) ^ (0u - (relative & 1u)));
  return static_cast<std::uint16_t>(previous + d);
}

// Appends `raw` compressed when that is smaller; returns whether it was.
bool append_stream(std::vector<std::byte>& out, std::span<const std::byte> raw, ZSTD_CCtx* context,
                   int level, std::uint64_t& stored) {
  std::vector<std::byte> packed(ZSTD_compressBound(raw.size()));
  const std::size_t size =
      raw.empty() ? 0 : detail::zstd_compress(context, raw, packed.data(), packed.size(), level);
  const bool compressed = !raw.empty() && size < raw.size();
  const std::span<const std::byte> chosen =
      compressed ? std::span<const std::byte>(packed.data(), size) : raw;
  out.insert(out.end(), chosen.begin(), chosen.end());
  stored = chosen.size();
  return compressed;
}

}  // namespace

std::vector<std::byte> encode_patch_message(const PatchMessageHeader& header,
                                            std::span<const PatchTensorEntries> tensors,
                                            int zstd_level) {
  if (zstd_level < 1 || zstd_level > kMaxZstdLevel)
    throw InvalidArgument(fmt::format("zstd level {} is not in 1..{}", zstd_level, kMaxZstdLevel));
  std::vector<std::byte> out(kPatchHeaderBytes);
  ByteWriter(out)
      .put_bytes(kPatchMagic)
      .put(kPatchFormatVersion)
      .zeros(2)
      .put(header.version)
      .put(header.parent_version)
      .put(header.parent_digest)
      .put(header.digest)
      .put(static_cast<std::uint32_t>(tensors.size()))
      .zeros(4);
  const detail::ZstdCCtxPtr context = detail::make_zstd_cctx();
  for (const PatchTensorEntries& tensor : tensors) {
    const std::size_t n = tensor.indices.size();
    if (tensor.values.size() != n || tensor.previous.size() != n ||
        tensor.numel > kMaxTensorNumel || tensor.name.empty() || tensor.name.size() > 0xFFFF ||
        (n > 0 && tensor.indices.back() >= tensor.numel)) {
      throw InvalidArgument("inconsistent patch entries",
                            ErrorContext{.tensor = std::string(tensor.name)});
    }
    std::vector<std::uint32_t> gaps(n);
    detail::compute_gaps(tensor.indices, gaps.data());
    const detail::IndexCodingSizes sizes = detail::index_coding_sizes(gaps, tensor.numel);
    IndexCoding coding = IndexCoding::varint;
    for (const IndexCoding other : {IndexCoding::bitpack, IndexCoding::elias_fano}) {
      if (sizes.of(other) < sizes.of(coding)) coding = other;
    }
    std::vector<std::byte> index_raw(n == 0 ? 0 : sizes.of(coding));
    if (n > 0) {
      detail::encode_indices(coding, tensor.indices, gaps, tensor.numel, index_raw.data());
    }
    std::vector<std::byte> planes(2 * n);
    for (std::size_t k = 0; k < n; ++k) {
      const std::uint16_t relative = relative_value(tensor.values[k], tensor.previous[k]);
      planes[k] = static_cast<std::byte>(relative & 0xFF);
      planes[n + k] = static_cast<std::byte>(relative >> 8);
    }

    const std::size_t record = out.size();
    out.resize(record + 2 + tensor.name.size() + 44);  // the record before its streams
    ByteWriter writer{std::span<std::byte>(out).subspan(record)};
    writer.put(static_cast<std::uint16_t>(tensor.name.size()))
        .put_bytes(std::as_bytes(std::span(tensor.name.data(), tensor.name.size())))
        .put(tensor.numel)
        .put(static_cast<std::uint64_t>(n))
        .put(static_cast<std::uint8_t>(coding));
    const std::size_t flags_at = record + writer.position();
    writer.zeros(3).put(static_cast<std::uint64_t>(index_raw.size()));
    const std::size_t stored_at = record + writer.position();
    std::uint64_t index_stored = 0;
    std::uint64_t values_stored = 0;
    std::uint8_t flags = 0;
    if (append_stream(out, index_raw, context.get(), zstd_level, index_stored))
      flags |= kIndexCompressed;
    if (append_stream(out, planes, context.get(), zstd_level, values_stored))
      flags |= kValuesCompressed;
    store_le(out.data() + flags_at, flags);
    store_le(out.data() + stored_at, index_stored);
    store_le(out.data() + stored_at + 8, values_stored);
  }
  append_le<std::uint64_t>(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

PatchMessageView PatchMessageView::parse(std::span<const std::byte> bytes) {
  ByteReader reader(bytes);
  if (bytes.size() < kPatchHeaderBytes + kChecksumBytes)
    reader.fail("truncated: a compact patch has at least 56 bytes");
  const std::span<const std::byte> body = bytes.first(bytes.size() - kChecksumBytes);
  if (XXH3_64bits(body.data(), body.size()) != load_le<std::uint64_t>(bytes.data() + body.size()))
    reader.fail_at("checksum mismatch: the patch is corrupted", body.size());
  const auto magic = reader.take(4, "magic");
  if (!std::equal(magic.begin(), magic.end(), std::begin(kPatchMagic)))
    reader.fail_at("not a compact patch (bad magic)", 0);
  if (reader.get<std::uint16_t>("format version") != kPatchFormatVersion)
    reader.fail_at("unknown format version", 4);
  if (reader.get<std::uint16_t>("reserved") != 0) reader.fail_at("reserved bytes are not zero", 6);
  PatchMessageView view;
  view.header_.version = reader.get<std::uint64_t>("version");
  view.header_.parent_version = reader.get<std::uint64_t>("parent version");
  view.header_.parent_digest = reader.get<Digest>("parent digest");
  view.header_.digest = reader.get<Digest>("digest");
  const auto count = reader.get<std::uint32_t>("tensor count");
  if (reader.get<std::uint32_t>("reserved") != 0) reader.fail_at("reserved bytes are not zero", 44);

  ByteReader records(body.subspan(kPatchHeaderBytes), {}, kPatchHeaderBytes);
  for (std::uint32_t t = 0; t < count; ++t) {
    PatchTensorRecord record{.byte_offset = records.offset()};
    const auto name_size = records.get<std::uint16_t>("name length");
    const auto name = records.take(name_size, "name");
    record.name.assign(reinterpret_cast<const char*>(name.data()), name.size());
    record.numel = records.get<std::uint64_t>("numel");
    record.entries = records.get<std::uint64_t>("entries");
    const auto coding = records.get<std::uint8_t>("index coding");
    Streams streams{.flags = records.get<std::uint8_t>("flags")};
    if (records.get<std::uint16_t>("reserved") != 0 || coding > 2 ||
        (streams.flags & ~(kIndexCompressed | kValuesCompressed)) != 0 || name_size == 0 ||
        record.numel > kMaxTensorNumel || record.entries > record.numel) {
      records.fail_at("invalid tensor record", record.byte_offset);
    }
    record.index_coding = static_cast<IndexCoding>(coding);
    streams.index_raw_bytes = records.get<std::uint64_t>("index raw bytes");
    const auto index_stored = records.get<std::uint64_t>("index bytes");
    const auto values_stored = records.get<std::uint64_t>("value bytes");
    streams.index_offset = records.offset();
    streams.index = records.take(index_stored, "index stream");
    streams.values_offset = records.offset();
    streams.values = records.take(values_stored, "value stream");
    record.byte_size = records.offset() - record.byte_offset;
    view.records_.push_back(std::move(record));
    view.streams_.push_back(streams);
  }
  if (records.remaining() != 0) records.fail("bytes after the last tensor record");
  return view;
}

void PatchMessageView::decode(std::size_t i, std::span<const std::uint16_t> held,
                              std::vector<std::uint32_t>& indices,
                              std::vector<std::uint16_t>& values) const {
  const PatchTensorRecord& record = records_.at(i);
  const Streams& streams = streams_[i];
  const auto fail = [&](std::string_view reason, std::uint64_t at) {
    throw ProtocolError(reason, ErrorContext{.tensor = record.name, .byte_offset = at});
  };
  if (record.numel != held.size()) {
    fail(fmt::format("the patch is for {} elements, the receiver's tensor has {}", record.numel,
                     held.size()),
         record.byte_offset);
  }
  const std::uint64_t n = record.entries;
  indices.assign(n, 0);
  values.assign(n, 0);
  if (n == 0) {
    if (!streams.index.empty() || !streams.values.empty() || streams.index_raw_bytes != 0)
      fail("streams of a tensor without entries", streams.index_offset);
    if (streams.flags != 0)
      fail("compressed streams of a tensor without entries", streams.index_offset);
    return;
  }
  const detail::SizeRange range =
      detail::index_raw_size_range(record.index_coding, n, record.numel);
  if (streams.index_raw_bytes < range.min || streams.index_raw_bytes > range.max)
    fail("index stream size impossible for its entries", streams.index_offset);
  const detail::ZstdDCtxPtr context_d = detail::make_zstd_dctx();
  // Fills `raw` from a stream stored compressed or not.
  const auto expand = [&](std::span<const std::byte> stored, bool compressed,
                          std::span<std::byte> raw, std::uint64_t at, std::string_view what) {
    if (compressed) {
      detail::check_zstd_frame(stored, raw.size(), at, what);
      detail::zstd_decompress_exact(context_d.get(), stored, raw, at, what);
    } else if (stored.size() != raw.size()) {
      fail(fmt::format("{} has {} bytes, not {}", what, stored.size(), raw.size()), at);
    } else {
      std::copy(stored.begin(), stored.end(), raw.begin());
    }
  };
  std::vector<std::byte> index_raw(streams.index_raw_bytes + detail::kIndexPadding);
  const bool index_compressed = (streams.flags & kIndexCompressed) != 0;
  expand(streams.index, index_compressed, std::span(index_raw).first(streams.index_raw_bytes),
         streams.index_offset, "index stream");
  try {
    detail::decode_indices(record.index_coding,
                           std::span<const std::byte>(index_raw).first(streams.index_raw_bytes), n,
                           record.numel, indices.data(), streams.index_offset, index_compressed);
  } catch (const ProtocolError& error) {
    throw ProtocolError(error.message(), ErrorContext{.tensor = record.name,
                                                      .byte_offset = error.context().byte_offset});
  }
  std::vector<std::byte> planes(2 * n);
  expand(streams.values, (streams.flags & kValuesCompressed) != 0, planes, streams.values_offset,
         "value stream");
  for (std::uint64_t k = 0; k < n; ++k) {
    const auto relative = static_cast<std::uint16_t>(static_cast<unsigned>(planes[k]) |
                                                     (static_cast<unsigned>(planes[n + k]) << 8));
    values[k] = absolute_value(relative, held[indices[k]]);
  }
}

}  // namespace pulseloco::codec
