// Publishes the deterministic run of tests/patch/patch_run.h for the Python TRL-receiver test:
//   pulseloco_test_publish_run DIR ENCODING VERSIONS ANCHOR_EVERY
// writes DIR/anchors, DIR/deltas, DIR/manifest.json and, for the test to compare with,
// DIR/expected/step_NNNNNN.safetensors (every version's bf16 state, cast independently).
// DIR may be an s3://bucket/prefix address: the run is published there, without the expected
// states (the same seed gives the same states in a directory).
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>

#include <pulseloco/io/s3_settings.h>
#include <pulseloco/patch/trl_files.h>
#include "patch/patch_run.h"

int main(int argc, char** argv) {
  using namespace pulseloco;
  if (argc != 5) {
    std::cerr << "usage: pulseloco_test_publish_run DIR raw|gap_delta VERSIONS ANCHOR_EVERY\n";
    return 2;
  }
  try {
    const std::filesystem::path directory = argv[1];
    patch::PublisherOptions options{.anchor_every = std::stoull(argv[4]),
                                    .encoding = patch::parse_index_encoding(argv[2]),
                                    .chunk_elements = 4096,
                                    .threads = 2};
    const auto expected = testing::publish_run(directory, std::stoull(argv[3]), 7, options);
    if (io::is_s3_address(directory.native())) return 0;
    std::filesystem::create_directories(directory / "expected");
    for (std::size_t i = 0; i < expected.size(); ++i) {
      const std::uint64_t version = i + 1;
      (void)patch::write_anchor_file(
          directory / "expected" / patch::anchor_file_name(version).filename(), expected[i],
          version, expected[i].digest(), options.encoding);
    }
  } catch (const std::exception& error) {
    std::cerr << error.what() << "\n";
    return 1;
  }
  return 0;
}
