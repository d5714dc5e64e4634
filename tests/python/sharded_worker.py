"""One rank of the tests of sharded workers (test_sharded_workers.py).

The model is two "units", each a flat vector of weights, sharded the way FSDP shards its flat
parameters: each unit is padded with zeros to a multiple of G elements and local rank j holds
the j-th of G equal pieces. The inner step is elementwise (theta -= lr * (theta - target), with
a target drawn from the worker and the step), so a shard's steps are the whole model's steps
restricted to the shard, bit for bit, and the padding stays zero.

Sharded mode (--shards G): torch.distributed over every rank (gloo), each rank passes its
shards to Synchronizer(worker={"ranks_per_worker": G, "sharded": True}).

Reference mode (--shards 0): one rank per worker holding the unpadded units, a plain
Synchronizer.

Prints one JSON line per event on stdout.
"""

import argparse
import json
import os
import sys

import torch

import pulseloco

UNITS = (("unit0.flat", 301), ("unit1.flat", 160))


def emit(**fields):
    print(json.dumps(fields), flush=True)


def initial_unit(index, numel):
    generator = torch.Generator().manual_seed(1000 + index)
    magnitude = torch.rand(numel, generator=generator) * 0.5 + 0.5
    sign = torch.randint(0, 2, (numel,), generator=generator) * 2 - 1
    return magnitude * sign


def target_unit(index, numel, worker, step):
    generator = torch.Generator().manual_seed(100000 * worker + 100 * step + index)
    return torch.randn(numel, generator=generator)


def shard_range(numel, shards, local_rank, extra=0):
    """[begin, end) of the padded unit that local rank holds (extra: elements this rank claims
    beyond its piece, to test a mismatched layout)."""
    piece = -(-numel // shards)
    return piece * local_rank, piece * (local_rank + 1) + extra


def padded(tensor, length):
    return torch.cat([tensor, torch.zeros(max(0, length - tensor.numel()))])[:length]


def hex_of(array):
    return array.tobytes().hex()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", default="pulse")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--shards", type=int, default=0)
    parser.add_argument("--extra", type=int, default=0,
                        help="elements this rank's shards claim beyond its piece")
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--save", help="checkpoint root: save after --save-after windows")
    parser.add_argument("--save-after", type=int, default=0)
    parser.add_argument("--resume", help="checkpoint root to load before training")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if args.shards:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        local, worker = dist.get_rank() % args.shards, dist.get_rank() // args.shards
        ranges = [shard_range(numel, args.shards, local, args.extra) for _, numel in UNITS]
        tensors = {name: padded(initial_unit(i, numel), end)[begin:].clone()
                   for i, ((name, numel), (begin, end)) in enumerate(zip(UNITS, ranges))}
        try:
            sync = pulseloco.Synchronizer(
                tensors, mode=args.mode, inner_steps=args.inner_steps, threads=1,
                timeout=args.timeout, worker={"ranks_per_worker": args.shards, "sharded": True})
        except pulseloco.Error as error:
            emit(event="error", type=type(error).__name__, message=str(error))
            # Without the interpreter's teardown: torch aborts it at random where the default
            # gloo group was not destroyed ("terminate called without an active exception").
            sys.stdout.flush()
            os._exit(3)
    else:
        ranges = [(0, numel) for _, numel in UNITS]
        tensors = {name: initial_unit(i, numel) for i, (name, numel) in enumerate(UNITS)}
        sync = pulseloco.Synchronizer(tensors, mode=args.mode, inner_steps=args.inner_steps,
                                      threads=1, timeout=args.timeout)
        local, worker = 0, sync.rank
    emit(event="ready", rank=sync.rank, worker=worker, local_rank=local,
         parameter_count=sync.parameter_count, digest=sync.digest)
    step = 0
    if args.resume:
        loaded = sync.load_checkpoint(args.resume)
        step = loaded.next_step
        emit(event="loaded", rank=sync.rank, window=loaded.window, digest=sync.digest)
    lr = 1e-2
    while sync.committed_windows < args.windows:
        with torch.no_grad():
            for i, ((name, numel), (begin, end)) in enumerate(zip(UNITS, ranges)):
                target = padded(target_unit(i, numel, worker, step), end)[begin:]
                theta = tensors[name]
                theta.sub_(lr * (theta - target))
        step += 1
        report = sync.after_optimizer_step()
        if report is not None:
            emit(event="window", rank=sync.rank, window=report.window, digest=sync.digest,
                 share_digest=report.digest, payload_bytes=report.payload_bytes,
                 entries_sent=report.entries_sent)
            if args.save and sync.committed_windows == args.save_after:
                sync.save_checkpoint(args.save)
    count = len(sync.tensor_table())
    emit(event="done", rank=sync.rank, worker=worker, local_rank=local, digest=sync.digest,
         global_weights=[hex_of(sync.global_weights(i)) for i in range(count)],
         momentum=[hex_of(sync.momentum(i)) for i in range(count)],
         local_weights=[hex_of(tensors[name].numpy()) for name, _ in UNITS])
    sync.close()
    if args.shards:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
