// An in-process transport with NCCL's matching semantics, the CPU stand-in for the NCCL backend
// in the collectives' tests (NCCL cannot put two ranks of one communicator on one GPU, so
// multi-rank logic over NCCL is proved here):
//
// - Tags are ignored: the k-th message one rank sends to another matches the k-th receive that
//   other rank posts from it. The k-th send and the k-th receive must have the same size; when
//   they differ both operations fail with ProtocolError (real NCCL would hang or corrupt).
// - isend/irecv only queue. The first test() or wait() on any of a rank's requests (or a native
//   collective) launches everything queued as one group on the rank's single stream, as the NCCL
//   transport does. Groups run one after the other: a group's operations are visible to the
//   peers only once every earlier group of that rank has completed, and a group completes as a
//   whole. A send therefore progresses only when its receive is posted and launched (NCCL's
//   rendezvous), and posting order mistakes hang (then time out) as they would on a GPU.
// - Zero-byte operations complete at once and take no place in the order (as in the NCCL
//   transport).
// - It offers the native collectives of transport/native_collectives.h, queued on the same
//   stream as the point-to-point groups: the k-th native collective of every rank must be the
//   same one with the same sizes (else ProtocolError). Its float all-reduce adds the ranks in
//   plain rank order, x_0 + x_1 + ... (deliberately not the point-to-point algorithms' order, so
//   tests see which one ran); every rank gets the same bytes.
// - A rank that is aborted or destroyed leaves its peers' operations with it pending (NCCL
//   tells a peer nothing): they end by their deadlines.
#pragma once

#include <memory>
#include <vector>

#include <pulseloco/transport/transport.h>

namespace pulseloco::transport::inproc {

// One transport per rank (element i has rank i) of a new order-matching group.
[[nodiscard]] std::vector<std::unique_ptr<Transport>> make_ordered_group(int world_size);

}  // namespace pulseloco::transport::inproc
