// Uses the installed public API: compiles, links and gives the expected answers.
#include <pulseloco/pulseloco.h>

#include <cstdio>
#include <vector>

int main() {
  const std::vector<float> weights{1.0f, 0.5f, -2.0f};
  std::vector<std::uint16_t> bf16(weights.size());
  pulseloco::float_to_bf16(weights, bf16);
  if (bf16[0] != 0x3F80 || bf16[2] != 0xC000) return 1;
  const pulseloco::Digest digest = pulseloco::digest_of<float>(weights);
  std::printf("consumer ok: pulseloco %s, digest %s\n", PULSELOCO_VERSION_STRING,
              pulseloco::digest_hex(digest).c_str());
  return 0;
}
