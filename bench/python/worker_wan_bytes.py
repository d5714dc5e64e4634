"""One rank of scripts/bench_workers_netns: the bytes one window moves in and out of each node,
for a worker of G ranks (`--layout worker`: Synchronizer(worker=G)) or G ranks that are each a
worker (`--layout ranks`: one node-aware group of every rank).

Every rank runs in its node's network namespace; torch.distributed (gloo over eth0) spans every
rank and serves the barriers around the measured window and the gathering of the counts. The
model is one fp32 tensor of --parameters elements (the same on every rank); before the window
each worker moves a --density fraction of its elements by 5% (a worker's ranks move the same
ones, as DDP replicas would), so that the pulse gate fires about that fraction. The first local
rank of each node reads its eth0 byte counters before and after the window; global rank 0
prints one JSON record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import pulseloco


def counters() -> tuple[int, int]:
    base = "/sys/class/net/eth0/statistics/"
    with open(base + "tx_bytes") as tx, open(base + "rx_bytes") as rx:
        return int(tx.read()), int(rx.read())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=["worker", "ranks"], required=True)
    parser.add_argument("--ranks-per-node", type=int, required=True)
    parser.add_argument("--parameters", type=float, default=2e6)
    parser.add_argument("--density", type=float, default=0.014)
    parser.add_argument("--mode", choices=["pulse", "diloco"], default="pulse")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = args.ranks_per_node
    node, local = rank // per_node, rank % per_node
    weights = torch.randn(int(args.parameters), generator=torch.Generator().manual_seed(5)) * 0.02
    if args.layout == "worker":
        sync = pulseloco.Synchronizer({"w": weights}, mode=args.mode, inner_steps=1, timeout=120,
                                      worker=per_node)
        worker = node
    else:
        sync = pulseloco.Synchronizer({"w": weights}, mode=args.mode, inner_steps=1, timeout=120)
        worker = rank
    moved = torch.rand(weights.numel(), generator=torch.Generator().manual_seed(100 + worker))
    with torch.no_grad():
        weights[moved < args.density] *= 1.05

    dist.barrier()
    before = counters() if local == 0 else (0, 0)
    dist.barrier()
    report = sync.run_window()
    dist.barrier()
    after = counters() if local == 0 else (0, 0)
    mine = {"rank": rank, "node": node, "local": local, "payload_bytes": report.payload_bytes,
            "wire_bytes_sent": report.wire_bytes_sent,
            "tx": after[0] - before[0], "rx": after[1] - before[1], "digest": sync.digest}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        nodes = world // per_node
        node_tx = [sum(r["tx"] for r in everyone if r["node"] == n) for n in range(nodes)]
        node_rx = [sum(r["rx"] for r in everyone if r["node"] == n) for n in range(nodes)]
        # One worker's message: a worker's shares together, or one rank's message.
        if args.layout == "worker":
            messages = [sum(r["payload_bytes"] for r in everyone if r["node"] == n)
                        for n in range(nodes)]
        else:
            messages = [r["payload_bytes"] for r in everyone]
        print(json.dumps({
            "layout": args.layout, "mode": args.mode, "nodes": nodes, "ranks_per_node": per_node,
            "parameters": int(args.parameters), "density": args.density,
            "worker_message_bytes_mean": sum(messages) / len(messages),
            "node_tx_bytes": node_tx, "node_rx_bytes": node_rx,
            "digests_equal": len({r["digest"] for r in everyone}) == 1,
        }), flush=True)
    sync.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
