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

// Decompresses `frame`, which must be one zstd frame of exactly frame.size() bytes declaring
// content size dst.size(), into dst. Throws ProtocolError at `byte_offset` naming `what`.
void zstd_decompress_exact(ZSTD_DCtx* context, std::span<const std::byte> frame,
                           std::span<std::byte> dst, std::uint64_t byte_offset,
                           std::string_view what);

}  // namespace pulseloco::codec::detail
