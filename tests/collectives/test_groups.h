// Groups of in-process ranks for the collectives' tests, by backend name: "inproc" (threads
// exchanging through shared queues) and, when the TCP transport is built, "tcp" (threads
// connected over loopback sockets) and "tcp_tls" (the same over TLS keyed from a secret); and "ordered", the double with NCCL's matching semantics
// (transport/inproc/ordered.h), where payloads move through native collectives.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <pulseloco/transport/inproc/inproc.h>
#include <pulseloco/transport/transport.h>

namespace pulseloco::testing {

[[nodiscard]] std::vector<std::string> test_backends();
// test_backends() and "ordered": for the tests whose expectations hold on every backend.
[[nodiscard]] std::vector<std::string> test_backends_with_ordered();

// One transport per rank, rank i at index i.
[[nodiscard]] std::vector<std::unique_ptr<transport::Transport>> make_test_group(
    std::string_view backend, int world_size);

}  // namespace pulseloco::testing
