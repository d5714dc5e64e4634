#include <pulseloco/codec/zstd_frames.h>

#include <zstd_errors.h>

#include <new>
#include <string>

#include <pulseloco/base/byte_io.h>
#include <pulseloco/base/errors.h>
#include <pulseloco/codec/wire.h>

namespace pulseloco::codec::detail {

ZstdCCtxPtr make_zstd_cctx() {
  ZstdCCtxPtr context(ZSTD_createCCtx());
  if (!context) throw std::bad_alloc();
  return context;
}

ZstdDCtxPtr make_zstd_dctx() {
  ZstdDCtxPtr context(ZSTD_createDCtx());
  if (!context) throw std::bad_alloc();
  return context;
}

std::size_t zstd_compress(ZSTD_CCtx* context, std::span<const std::byte> src, std::byte* dst,
                          std::size_t capacity, int level) {
  ZSTD_CCtx_reset(context, ZSTD_reset_session_and_parameters);
  ZSTD_CCtx_setParameter(context, ZSTD_c_compressionLevel, level);
  // Our streams are byte planes and gap codes with short, random-looking symbols: matches of
  // fewer than 7 bytes are mostly chance and cost more than the literals they replace
  // (measured: docs/benchmarks.md, "Codec").
  ZSTD_CCtx_setParameter(context, ZSTD_c_minMatch, kZstdMinMatch);
  const std::size_t result = ZSTD_compress2(context, dst, capacity, src.data(), src.size());
  if (ZSTD_isError(result)) {
    // With a capacity of ZSTD_compressBound() only an allocation can fail; anything else is a
    // bug in how we call zstd.
    if (ZSTD_getErrorCode(result) == ZSTD_error_memory_allocation) throw std::bad_alloc();
    PULSELOCO_CHECK(false, ZSTD_getErrorName(result));
  }
  return result;
}

void check_zstd_frame(std::span<const std::byte> frame, std::uint64_t expected,
                      std::uint64_t byte_offset, std::string_view what) {
  const auto fail = [&](const std::string& reason) {
    wire::fail(std::string(what) + ": " + reason, byte_offset);
  };
  // libzstd may also read the legacy formats (v0.5-v0.7) and skippable frames; the format allows
  // one RFC 8878 frame only, whatever the platform's libzstd was built with.
  if (frame.size() < 4 || load_le<std::uint32_t>(frame.data()) != ZSTD_MAGICNUMBER)
    fail("not a zstd frame (RFC 8878 magic 28 B5 2F FD)");
  const unsigned long long declared = ZSTD_getFrameContentSize(frame.data(), frame.size());
  if (declared == ZSTD_CONTENTSIZE_ERROR) fail("not a zstd frame");
  if (declared == ZSTD_CONTENTSIZE_UNKNOWN) fail("zstd frame does not declare its content size");
  if (declared != expected) {
    fail("zstd frame declares " + std::to_string(declared) + " bytes, expected " +
         std::to_string(expected));
  }
  if (expected / kZstdMaxExpansion >= frame.size()) {
    fail("a zstd frame of " + std::to_string(frame.size()) + " bytes cannot hold " +
         std::to_string(expected) + " bytes");
  }
  const std::size_t frame_size = ZSTD_findFrameCompressedSize(frame.data(), frame.size());
  if (ZSTD_isError(frame_size)) {
    fail(std::string("malformed zstd frame: ") + ZSTD_getErrorName(frame_size));
  }
  if (frame_size != frame.size()) {
    fail("zstd frame is " + std::to_string(frame_size) + " bytes, the stream " +
         std::to_string(frame.size()));
  }
}

void zstd_decompress_exact(ZSTD_DCtx* context, std::span<const std::byte> frame,
                           std::span<std::byte> dst, std::uint64_t byte_offset,
                           std::string_view what) {
  const auto fail = [&](const std::string& reason) {
    wire::fail(std::string(what) + ": " + reason, byte_offset);
  };
  check_zstd_frame(frame, dst.size(), byte_offset, what);
  const std::size_t produced =
      ZSTD_decompressDCtx(context, dst.data(), dst.size(), frame.data(), frame.size());
  if (ZSTD_isError(produced)) {
    fail(std::string("zstd decompression failed: ") + ZSTD_getErrorName(produced));
  }
  if (produced != dst.size()) {
    fail("zstd produced " + std::to_string(produced) + " bytes, expected " +
         std::to_string(dst.size()));
  }
}

}  // namespace pulseloco::codec::detail
