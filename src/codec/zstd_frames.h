// Internal: one-shot zstd frames with RAII contexts. Compression writes standard frames
// (RFC 8878) that record their content size; decompression accepts exactly one such frame
// whose content size is the one the caller expects, so zstd never sizes our buffers.
#pragma once

#include <zstd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

namespace pulseloco::codec::detail {

struct ZstdCCtxDeleter {
  void operator()(ZSTD_CCtx* context) const noexcept { ZSTD_freeCCtx(context); }
};
struct ZstdDCtxDeleter {
  void operator()(ZSTD_DCtx* context) const noexcept { ZSTD_freeDCtx(context); }
};
using ZstdCCtxPtr = std::unique_ptr<ZSTD_CCtx, ZstdCCtxDeleter>;
using ZstdDCtxPtr = std::unique_ptr<ZSTD_DCtx, ZstdDCtxDeleter>;

inline constexpr int kZstdMinMatch = 7;

[[nodiscard]] ZstdCCtxPtr make_zstd_cctx();
[[nodiscard]] ZstdDCtxPtr make_zstd_dctx();

// Compresses `src` into `dst` (capacity ZSTD_compressBound(src.size())); returns the frame size.
[[nodiscard]] std::size_t zstd_compress(ZSTD_CCtx* context, std::span<const std::byte> src,
                                        std::byte* dst, std::size_t capacity, int level);

// A zstd block holds at most 128 KiB of content and takes at least 4 bytes (its 3-byte header
// and one byte of an RLE block), so no frame, valid or not, decodes to more than this many
// bytes per byte it stores (RFC 8878, "Blocks").
inline constexpr std::uint64_t kZstdMaxExpansion = (std::uint64_t{128} << 10) / 4;

// Checks what can be checked of `frame` without decoding it, before anything is allocated for
// its content: one zstd frame of exactly frame.size() bytes that declares content size
// `expected`, no more than kZstdMaxExpansion times its size. Throws ProtocolError at
// `byte_offset` naming `what`.
void check_zstd_frame(std::span<const std::byte> frame, std::uint64_t expected,
                      std::uint64_t byte_offset, std::string_view what);

// Decompresses `frame`, which must pass check_zstd_frame with content size dst.size(), into
// dst. Throws ProtocolError at `byte_offset` naming `what`.
void zstd_decompress_exact(ZSTD_DCtx* context, std::span<const std::byte> frame,
                           std::span<std::byte> dst, std::uint64_t byte_offset,
                           std::string_view what);

}  // namespace pulseloco::codec::detail
