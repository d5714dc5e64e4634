// Test hook of the TCP transport: corrupt one outgoing data frame, to prove that the receiver
// detects it (TcpTransport::corrupt_outgoing_frame). Tests set it through the transport, or, for
// a whole process, with PULSELOCO_TEST_CORRUPT_FRAME (DEVELOPERS.md, "Test hooks"); production
// code never does.
#pragma once

#include <cstdint>

namespace pulseloco::transport {

// Which data-plane bytes the hook flips.
enum class FrameCorruption : std::uint8_t { payload, header };

// Flip one bit in one outgoing frame.
struct CorruptFrame {
  std::uint64_t frame_index = 0;  // 0-based index among the data frames sent from now on
  FrameCorruption target = FrameCorruption::payload;
};

}  // namespace pulseloco::transport
