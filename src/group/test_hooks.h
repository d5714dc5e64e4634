// Internal: the test hooks of group formation (DEVELOPERS.md, "Test hooks"); production runs never
// set them.
#pragma once

#include <optional>

#include <pulseloco/transport/tcp/test_hooks.h>

namespace pulseloco::group {

// PULSELOCO_TEST_CORRUPT_FRAME=N, N:payload or N:header: every TCP transport make_transport()
// forms then corrupts its N-th data frame (TcpTransport::corrupt_outgoing_frame). Throws
// InvalidArgument naming the variable when the value does not parse.
[[nodiscard]] std::optional<transport::CorruptFrame> corrupt_frame_from_environment();

}  // namespace pulseloco::group
