// Encoding window messages: encode_frame and encode_header (message.h). Parsing and decoding
// are in message.cpp.
#include <pulseloco/codec/message.h>

#include <xxhash.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include <pulseloco/base/errors.h>
#include <pulseloco/codec/context_coding.h>
#include <pulseloco/codec/context_index.h>
#include <pulseloco/codec/index_coding.h>
#include <pulseloco/codec/value_planes.h>
#include <pulseloco/codec/wire.h>
#include <pulseloco/codec/zstd_frames.h>

namespace pulseloco::codec {

using wire::fail;

// ---------------------------------------------------------------------------------------------
// Encoding

namespace {

// Per-thread encoder state: a zstd context and staging buffers, reused across frames.
struct EncodeState {
  detail::ZstdCCtxPtr cctx = detail::make_zstd_cctx();
  std::vector<std::uint32_t> gaps;
  std::vector<std::byte> index_raw;     // the index coding's bytes
  std::vector<std::byte> index_packed;  // ... and their zstd frame
  std::vector<std::byte> planes;        // 4 dense planes
  std::array<std::vector<std::byte>, 4> sparse;
  std::array<std::vector<std::byte>, 4> plane_packed;
  std::vector<std::uint8_t> symbols;     // context: context exponents, D bytes, U bytes
  std::vector<std::byte> raw_bits;       // context: the raw bit stream
  std::vector<std::byte> symbol_stream;  // context: the range-coded D and U
  std::vector<float> less_residue;       // context: the values less their context's residue
  std::vector<std::uint8_t> multiples;   // context: the residue multiple each value is coded less
  std::unique_ptr<detail::SymbolModels> symbol_models = std::make_unique<detail::SymbolModels>();
  detail::GroupScratch groups;  // context: the exponent_groups coding
  std::vector<std::byte> grouped_raw;
  std::vector<std::byte> grouped_packed;
};

EncodeState& encode_state() {
  thread_local EncodeState state;
  return state;
}

void validate_frame_entries(const FrameEntries& entries, const EncodeOptions& options) {
  const auto error = [&](const std::string& message, std::optional<std::uint64_t> index = {}) {
    throw InvalidArgument("encode_frame: " + message, ErrorContext{.index = index});
  };
  if (!valid_encoding(static_cast<std::uint8_t>(options.encoding))) error("unknown encoding");
  if (options.index_coding && *options.index_coding == IndexCoding::exponent_groups) {
    if (options.encoding != Encoding::context) error("exponent_groups needs the context encoding");
  } else if (options.index_coding &&
             !valid_index_coding(static_cast<std::uint8_t>(*options.index_coding))) {
    error("unknown index coding");
  }
  if (options.zstd_level < 0 || options.zstd_level > kMaxZstdLevel) {
    error("zstd level " + std::to_string(options.zstd_level) + " is not 0 (default) or 1.." +
          std::to_string(kMaxZstdLevel));
  }
  if (entries.offsets.size() != entries.values.size()) {
    error(std::to_string(entries.offsets.size()) + " offsets but " +
          std::to_string(entries.values.size()) + " values");
  }
  if (entries.length > kMaxFrameElements) {
    error("chunk length " + std::to_string(entries.length) + " exceeds " +
          std::to_string(kMaxFrameElements));
  }
  if (entries.begin > kMaxNumel || entries.length > kMaxNumel - entries.begin) {
    error("chunk [" + std::to_string(entries.begin) + ", +" + std::to_string(entries.length) +
          ") exceeds the largest tensor the format allows (2^63 - 1 elements)");
  }
  std::uint64_t next = 0;
  for (std::size_t i = 0; i < entries.offsets.size(); ++i) {
    const std::uint32_t offset = entries.offsets[i];
    if (offset < next || offset >= entries.length) {
      error("entry " + std::to_string(i) + ": offset " + std::to_string(offset) +
                (offset >= entries.length
                     ? " is not below the chunk length " + std::to_string(entries.length)
                     : " does not ascend"),
            entries.begin + offset);
    }
    next = std::uint64_t{offset} + 1;
  }
  if (!entries.residue_multiples.empty() &&
      entries.residue_multiples.size() != entries.offsets.size()) {
    error(std::to_string(entries.offsets.size()) + " entries but " +
          std::to_string(entries.residue_multiples.size()) + " residue multiples");
  }
  if (options.encoding == Encoding::context && entries.context.size() != entries.length) {
    error("the context encoding needs the chunk's " + std::to_string(entries.length) +
          " context values, " + std::to_string(entries.context.size()) + " given");
  }
  const std::size_t bad = detail::first_non_finite(entries.values);
  if (bad != entries.values.size()) {
    error("entry " + std::to_string(bad) + ": value is not finite",
          entries.begin + entries.offsets[bad]);
  }
}

void write_frame_prefix(std::byte* p, const FrameEntries& entries, Encoding encoding,
                        IndexCoding coding, std::uint8_t zstd_streams,
                        std::uint8_t plane_or_value_flags, std::uint64_t payload_bytes) {
  store_le<std::uint32_t>(p + kFrameTensorAt, entries.tensor);
  p[kFrameEncodingAt] = static_cast<std::byte>(encoding);
  p[kFrameIndexCodingAt] = static_cast<std::byte>(coding);
  p[kFrameZstdStreamsAt] = static_cast<std::byte>(zstd_streams);
  p[kFramePlaneOrValueFlagsAt] = static_cast<std::byte>(plane_or_value_flags);
  store_le<std::uint64_t>(p + kFrameBeginAt, entries.begin);
  store_le<std::uint32_t>(p + kFrameLengthAt, static_cast<std::uint32_t>(entries.length));
  store_le<std::uint32_t>(p + kFrameEntriesAt, static_cast<std::uint32_t>(entries.offsets.size()));
  store_le<std::uint64_t>(p + kFramePayloadBytesAt, payload_bytes);
}

void append_checksum(std::vector<std::byte>& frame) {
  const std::uint64_t checksum = XXH3_64bits(frame.data(), frame.size());
  append_le<std::uint64_t>(frame, checksum);
}

std::vector<std::byte> encode_plain(const FrameEntries& entries, Encoding encoding) {
  const std::size_t n = entries.offsets.size();
  const std::uint64_t index_bytes = plain_index_bytes(encoding);
  const std::uint64_t payload = n * (index_bytes + 4);
  std::vector<std::byte> frame(kFramePrefixBytes + payload);
  frame.reserve(frame.size() + kChecksumBytes);
  write_frame_prefix(frame.data(), entries, encoding, IndexCoding::varint, 0, 0, payload);
  std::byte* p = frame.data() + kFramePrefixBytes;
  if (encoding == Encoding::plain_i64_f32) {
    for (std::size_t i = 0; i < n; ++i) {
      store_le<std::int64_t>(p + 8 * i,
                             static_cast<std::int64_t>(entries.begin + entries.offsets[i]));
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      store_le<std::int32_t>(p + 4 * i, static_cast<std::int32_t>(entries.offsets[i]));
    }
  }
  if (n > 0) std::memcpy(p + n * index_bytes, entries.values.data(), n * 4);
  append_checksum(frame);
  return frame;
}

// A stream as it goes on the wire: its zstd frame when that is smaller, else the raw bytes.
struct StoredStream {
  std::span<const std::byte> bytes;
  bool compressed = false;
};

// True when an order-0 entropy coder could save at most about 6% of `bytes`: their Renyi-2
// entropy -log2(sum p_i^2), a lower bound of the Shannon entropy, is at least 7.5 bits per
// byte. Such streams (the random-looking mantissa planes) are stored without asking zstd, whose
// match finder would find nothing there (measured: docs/benchmarks.md, "Codec"). Deterministic:
// integer counts and one comparison.
bool looks_incompressible(std::span<const std::byte> bytes) {
  constexpr std::size_t kMinBytes = 256;
  constexpr double kTwoPow7_5 = 181.01933598375618;  // 2^7.5
  if (bytes.size() < kMinBytes) return false;
  // Four interleaved histograms break the store-to-load dependency on repeated symbols.
  std::array<std::array<std::uint32_t, 256>, 4> counts{};
  const auto* p = reinterpret_cast<const std::uint8_t*>(bytes.data());
  const std::size_t n = bytes.size();
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++counts[0][p[i]];
    ++counts[1][p[i + 1]];
    ++counts[2][p[i + 2]];
    ++counts[3][p[i + 3]];
  }
  for (; i < n; ++i)
    ++counts[0][p[i]];
  std::uint64_t sum_squares = 0;  // <= n^2 < 2^64
  for (std::size_t symbol = 0; symbol < 256; ++symbol) {
    const std::uint64_t c = std::uint64_t{counts[0][symbol]} + counts[1][symbol] +
                            counts[2][symbol] + counts[3][symbol];
    sum_squares += c * c;
  }
  const auto total = static_cast<double>(n);
  return static_cast<double>(sum_squares) * kTwoPow7_5 <= total * total;
}

StoredStream store_stream(ZSTD_CCtx* cctx, std::span<const std::byte> raw,
                          std::vector<std::byte>& packed, int level) {
  if (looks_incompressible(raw)) return {raw, false};
  const std::size_t bound = ZSTD_compressBound(raw.size());
  grow(packed, bound);
  const std::size_t size = detail::zstd_compress(cctx, raw, packed.data(), bound, level);
  if (size < raw.size()) return {std::span<const std::byte>(packed.data(), size), true};
  return {raw, false};
}

// A frame's index stream, coded and stored.
struct IndexStream {
  IndexCoding coding = IndexCoding::varint;
  std::uint64_t raw_bytes = 0;
  StoredStream stored;
};

IndexStream store_index_stream(EncodeState& state, const FrameEntries& entries,
                               const EncodeOptions& options, int level) {
  const std::size_t n = entries.offsets.size();
  // Indices. The varint gaps are compressed and compared with the raw sizes of bit-packing and
  // Elias-Fano, whose bits zstd rarely shrinks on real traces (so they are compressed only
  // once chosen); the fewest bytes win, ties going to the lower code. Deterministic, one zstd
  // call in the common case: compressing all three would cost encoder throughput for almost no
  // size.
  if (state.gaps.size() < n) state.gaps.resize(n);
  const std::span<const std::uint32_t> gaps(state.gaps.data(), n);
  detail::compute_gaps(entries.offsets, state.gaps.data());
  const detail::IndexCodingSizes sizes = detail::index_coding_sizes(gaps, entries.length);
  const auto encode_and_store = [&](IndexCoding candidate) {
    const std::uint64_t raw_bytes = sizes.of(candidate);
    grow(state.index_raw, raw_bytes);
    detail::encode_indices(candidate, entries.offsets, gaps, entries.length,
                           state.index_raw.data());
    return store_stream(state.cctx.get(), std::span(state.index_raw.data(), raw_bytes),
                        state.index_packed, level);
  };
  const bool forced = options.index_coding && *options.index_coding != IndexCoding::exponent_groups;
  IndexCoding coding = forced ? *options.index_coding : IndexCoding::varint;
  StoredStream stored = encode_and_store(coding);
  if (!forced) {
    IndexCoding best = IndexCoding::varint;
    std::uint64_t best_bytes = stored.bytes.size();
    for (const IndexCoding candidate : {IndexCoding::bitpack, IndexCoding::elias_fano}) {
      if (sizes.of(candidate) < best_bytes) {
        best = candidate;
        best_bytes = sizes.of(candidate);
      }
    }
    if (best != IndexCoding::varint) {
      coding = best;
      stored = encode_and_store(coding);
    }
  }
  return {.coding = coding, .raw_bytes = sizes.of(coding), .stored = stored};
}

// A frame's streams and stream directory, ready to be written: a pulse frame's (index, four
// value planes) or a context frame's (index, D, U, raw bits).
struct FrameStreams {
  Encoding encoding = Encoding::pulse;
  IndexCoding coding = IndexCoding::varint;
  std::uint8_t zstd_streams = 0;
  std::uint8_t plane_or_value_flags = 0;  // frame byte 7: pulse's sparse planes, context's flags
  std::array<std::byte, wire::kMaxVarint64Bytes*(1 + 4 + wire::kPulseStreams) + 8> directory{};
  std::size_t directory_bytes = 0;
  std::array<StoredStream, wire::kPulseStreams> stored{};
  std::size_t streams = 0;

  [[nodiscard]] std::uint64_t payload() const {
    std::uint64_t bytes = directory_bytes;
    for (std::size_t s = 0; s < streams; ++s)
      bytes += stored[s].bytes.size();
    return bytes;
  }
  void flag_compressed() {
    for (std::size_t s = 0; s < streams; ++s) {
      if (stored[s].compressed) zstd_streams |= static_cast<std::uint8_t>(1u << s);
    }
  }
};

FrameStreams pulse_streams(EncodeState& state, const FrameEntries& entries,
                           const IndexStream& index, int level) {
  const std::size_t n = entries.offsets.size();
  FrameStreams out;
  out.coding = index.coding;
  out.streams = wire::kPulseStreams;
  out.stored[wire::kIndexStream] = index.stored;
  // Values: four byte planes; a plane that is mostly zero bytes goes in its sparse form.
  grow(state.planes, 4 * n);
  detail::split_planes(entries.values, state.planes.data());
  std::array<std::uint64_t, 4> nonzero{};
  for (std::size_t k = 0; k < 4; ++k) {
    const std::byte* plane = state.planes.data() + k * n;
    const std::size_t zeros = detail::count_zero_bytes(plane, n);
    std::span<const std::byte> raw(plane, n);
    if (2 * zeros > n) {
      out.plane_or_value_flags |= static_cast<std::uint8_t>(1u << k);
      nonzero[k] = n - zeros;
      const std::size_t bytes = detail::sparse_plane_bytes(n, nonzero[k]);
      grow(state.sparse[k], bytes);
      detail::encode_sparse_plane(plane, n, state.sparse[k].data());
      raw = std::span<const std::byte>(state.sparse[k].data(), bytes);
    }
    out.stored[1 + k] = store_stream(state.cctx.get(), raw, state.plane_packed[k], level);
  }
  out.flag_compressed();
  std::byte* d = wire::put_varint(out.directory.data(), index.raw_bytes);
  for (std::size_t k = 0; k < 4; ++k) {
    if (((out.plane_or_value_flags >> k) & 1u) != 0) d = wire::put_varint(d, nonzero[k]);
  }
  for (const auto& stream : out.stored)
    d = wire::put_varint(d, stream.bytes.size());
  out.directory_bytes = static_cast<std::size_t>(d - out.directory.data());
  return out;
}

FrameStreams context_streams(EncodeState& state, const FrameEntries& entries,
                             const IndexStream& index, const std::uint8_t* exponents) {
  const std::size_t n = entries.offsets.size();
  FrameStreams out;
  out.encoding = Encoding::context;
  out.coding = index.coding;
  out.streams = detail::kContextStreams;
  out.stored[detail::kContextIndexStream] = index.stored;
  if (state.symbols.size() < 3 * n) state.symbols.resize(3 * n);
  std::uint8_t* const e = state.symbols.data();
  std::uint8_t* const delta = e + n;
  std::uint8_t* const zero_run = delta + n;
  // Values that carry their context's residue go less it (their multiple of it) when that pays,
  // an entry whose round trip is not exact as it is (multiple 0); multiples that are all 1 are
  // not coded.
  if (state.less_residue.size() < n) state.less_residue.resize(n);
  if (state.multiples.size() < n) state.multiples.resize(n);
  std::span<const float> values = entries.values;
  const std::uint8_t* multiples = nullptr;
  if (detail::remove_context_residue(entries.offsets, entries.values, entries.context,
                                     entries.residue_multiples, state.less_residue.data(),
                                     state.multiples.data())) {
    values = std::span<const float>(state.less_residue.data(), n);
    out.plane_or_value_flags = detail::kContextLessResidue;
    const std::span<const std::uint8_t> k(state.multiples.data(), n);
    if (std::any_of(k.begin(), k.end(), [](std::uint8_t m) { return m != 1; })) {
      multiples = k.data();
      out.plane_or_value_flags |= detail::kContextResidueMultiples;
    }
  }
  grow(state.raw_bits, detail::raw_bits_capacity(n));
  const std::uint64_t bits =
      detail::split_against_context(entries.offsets, values, entries.context, exponents, e, delta,
                                    zero_run, state.raw_bits.data());
  grow(state.symbol_stream, detail::symbol_stream_capacity(n, multiples != nullptr));
  const std::size_t symbol_bytes = detail::encode_symbols(
      e, delta, zero_run, multiples, n, *state.symbol_models, state.symbol_stream.data());
  out.stored[detail::kContextSymbolStream] = {std::span(state.symbol_stream.data(), symbol_bytes),
                                              false};
  out.stored[detail::kContextRawBitsStream] = {std::span(state.raw_bits.data(), (bits + 7) / 8),
                                               false};
  out.flag_compressed();
  std::byte* d = wire::put_varint(out.directory.data(), index.raw_bytes);
  for (std::size_t s = 0; s < out.streams; ++s)
    d = wire::put_varint(d, out.stored[s].bytes.size());
  store_le<std::uint64_t>(d, index.coding == IndexCoding::exponent_groups
                                 ? detail::entries_digest(entries.offsets, entries.values)
                                 : detail::values_digest(entries.values));
  out.directory_bytes = static_cast<std::size_t>(d + 8 - out.directory.data());
  return out;
}

std::vector<std::byte> write_frame(const FrameEntries& entries, const FrameStreams& streams) {
  const std::uint64_t payload = streams.payload();
  std::vector<std::byte> frame;
  frame.reserve(kFrameOverheadBytes + payload);
  frame.resize(kFramePrefixBytes);
  write_frame_prefix(frame.data(), entries, streams.encoding, streams.coding, streams.zstd_streams,
                     streams.plane_or_value_flags, payload);
  frame.insert(frame.end(), streams.directory.begin(),
               streams.directory.begin() + static_cast<std::ptrdiff_t>(streams.directory_bytes));
  for (std::size_t s = 0; s < streams.streams; ++s)
    frame.insert(frame.end(), streams.stored[s].bytes.begin(), streams.stored[s].bytes.end());
  append_checksum(frame);
  return frame;
}

std::vector<std::byte> empty_frame(const FrameEntries& entries) {
  std::vector<std::byte> frame(kFramePrefixBytes);
  frame.reserve(kFrameOverheadBytes);
  write_frame_prefix(frame.data(), entries, Encoding::pulse, IndexCoding::varint, 0, 0, 0);
  append_checksum(frame);
  return frame;
}

std::vector<std::byte> encode_pulse(const FrameEntries& entries, const EncodeOptions& options) {
  if (entries.offsets.empty()) return empty_frame(entries);
  EncodeState& state = encode_state();
  const int level = options.zstd_level == 0 ? kDefaultZstdLevel : options.zstd_level;
  const IndexStream index = store_index_stream(state, entries, options, level);
  return write_frame(entries, pulse_streams(state, entries, index, level));
}

// The exponent_groups coding of a context frame's indices when it is smaller than `pulse` (the
// pulse frame's index stream), or when forced; else `pulse`. Sets `exponents` to the chunk's
// exponent bytes where it computed them, else to null.
IndexStream context_index_stream(EncodeState& state, const FrameEntries& entries,
                                 const EncodeOptions& options, const IndexStream& pulse, int level,
                                 const std::uint8_t*& exponents) {
  const bool forced = options.index_coding == IndexCoding::exponent_groups;
  exponents = nullptr;
  if (options.index_coding && !forced) return pulse;
  const std::uint64_t n = entries.offsets.size();
  const std::uint64_t raw_bytes = detail::encode_grouped_indices(
      entries.offsets, entries.context, 5 * n, state.groups, state.grouped_raw);
  exponents = state.groups.exponents.data();
  if (raw_bytes == 0) return pulse;
  const StoredStream stored =
      store_stream(state.cctx.get(), std::span(state.grouped_raw.data(), raw_bytes),
                   state.grouped_packed, level);
  if (!forced && stored.bytes.size() >= pulse.stored.bytes.size()) return pulse;
  return {.coding = IndexCoding::exponent_groups, .raw_bytes = raw_bytes, .stored = stored};
}

// The context frame codes its indices as the pulse frame does or by exponent_groups, whichever
// is smaller; the chunk goes context-coded only when that is smaller than its pulse frame (the
// fallback), and an empty chunk is an empty pulse frame.
std::vector<std::byte> encode_context(const FrameEntries& entries, const EncodeOptions& options) {
  if (entries.offsets.empty()) return empty_frame(entries);
  EncodeState& state = encode_state();
  const int level = options.zstd_level == 0 ? kDefaultZstdLevel : options.zstd_level;
  const IndexStream index = store_index_stream(state, entries, options, level);
  const std::uint8_t* exponents = nullptr;
  const IndexStream context_index =
      context_index_stream(state, entries, options, index, level, exponents);
  const FrameStreams context = context_streams(state, entries, context_index, exponents);
  const FrameStreams pulse = pulse_streams(state, entries, index, level);
  return write_frame(entries, context.payload() < pulse.payload() ? context : pulse);
}

}  // namespace

std::vector<std::byte> encode_frame(const FrameEntries& entries, const EncodeOptions& options) {
  validate_frame_entries(entries, options);
  if (options.encoding == Encoding::pulse) return encode_pulse(entries, options);
  if (options.encoding == Encoding::context) return encode_context(entries, options);
  return encode_plain(entries, options.encoding);
}

std::uint64_t max_encoded_frame_bytes(std::uint64_t length) noexcept {
  // Plain frames take 12 (or 8) bytes per entry. A pulse frame stores each stream raw or
  // compressed only when smaller (store_stream), so its payload is at most the raw sizes: an
  // index stream of at most 5 bytes per entry + 2 (every index coding), four planes of at most
  // one byte per entry (a plane goes sparse only when most of its bytes are zero, and is then
  // smaller), and a directory of at most ten varints.
  constexpr std::uint64_t kDirectoryBytes = wire::kMaxVarint64Bytes * (1 + 4 + wire::kPulseStreams);
  return kFrameOverheadBytes + kDirectoryBytes + 2 + 12 * length;
}

std::uint64_t max_encoded_header_bytes(std::uint64_t tensors) noexcept {
  return kHeaderPrefixBytes + 8 * tensors + kChecksumBytes;
}

std::vector<std::byte> encode_header(const MessageHeader& header, std::uint32_t frame_count) {
  if (!valid_encoding(static_cast<std::uint8_t>(header.encoding))) {
    throw InvalidArgument("encode_header: unknown encoding");
  }
  if (header.tensor_numels.size() > std::numeric_limits<std::uint32_t>::max()) {
    throw InvalidArgument("encode_header: more than 2^32 - 1 tensors");
  }
  for (std::size_t t = 0; t < header.tensor_numels.size(); ++t) {
    if (header.tensor_numels[t] > kMaxNumel) {
      throw InvalidArgument("encode_header: tensor " + std::to_string(t) + " has " +
                            std::to_string(header.tensor_numels[t]) +
                            " elements, more than 2^63 - 1");
    }
  }
  std::vector<std::byte> out(kHeaderPrefixBytes);
  out.reserve(kHeaderPrefixBytes + 8 * header.tensor_numels.size() + kChecksumBytes);
  std::byte* p = out.data();
  std::memcpy(p, wire::kMagic, sizeof wire::kMagic);
  store_le<std::uint16_t>(p + kHeaderVersionAt, format_version_of(header.encoding));
  p[kHeaderEncodingAt] = static_cast<std::byte>(header.encoding);
  p[kHeaderFlagsAt] = std::byte{0};
  store_le<std::uint64_t>(p + kHeaderWindowAt, header.window);
  store_le<std::uint32_t>(p + kHeaderRankAt, header.sender_rank);
  store_le<std::uint32_t>(p + kHeaderTensorCountAt,
                          static_cast<std::uint32_t>(header.tensor_numels.size()));
  store_le<std::uint32_t>(p + kHeaderFrameCountAt, frame_count);
  store_le<std::uint32_t>(p + kHeaderReservedAt, 0);
  for (const std::uint64_t numel : header.tensor_numels)
    append_le<std::uint64_t>(out, numel);
  append_checksum(out);
  return out;
}

}  // namespace pulseloco::codec
