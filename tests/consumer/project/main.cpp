// Uses the installed public API beside headers of its own that have pulseloco-like names:
// compiles, links and gives the expected answers.
#include <pulseloco/pulseloco.h>

#include <cstdio>
#include <vector>

#include "base/errors.h"
#include "engine/engine.h"

static_assert(consumer::kOwnErrorsHeader == 1, "the consumer's base/errors.h");

int main() {
  const consumer::Engine own;
  const std::vector<float> weights{1.0f, 0.5f, -2.0f};
  std::vector<std::uint16_t> bf16(weights.size());
  pulseloco::float_to_bf16(weights, bf16);
  if (bf16[0] != 0x3F80 || bf16[2] != 0xC000 || own.cylinders != 8) return 1;
  const pulseloco::Digest digest = pulseloco::digest_of<float>(weights);
  try {
    throw pulseloco::InvalidArgument("checked");
  } catch (const pulseloco::Error& error) {
    if (error.kind() != pulseloco::ErrorKind::invalid_argument) return 1;
  }
#if PULSELOCO_HAS_CUDA
  // The cuda component registers the device state memory in every program that links it.
  if (!pulseloco::device_state_available()) return 4;
#endif
  std::printf("consumer ok: pulseloco %s, digest %s, device state %s\n", PULSELOCO_VERSION_STRING,
              pulseloco::digest_hex(digest).c_str(),
              pulseloco::device_state_available() ? "available" : "not built");
  return 0;
}
