"""Train train.py's model on workers of several ranks: DDP inside each worker, pulseloco between
workers, each local rank carrying its share of the window.

    .venv/bin/python -m pulseloco.launch --nproc-per-node 4 --ranks-per-worker 2 \\
        examples/python/train_ddp_worker.py --mode pulse
    (on each of W nodes, a worker of G GPUs per node)
    python -m pulseloco.launch --nnodes W --node-rank K --nproc-per-node G --ranks-per-worker G \\
        --master-addr HOST --master-port P examples/python/train_ddp_worker.py --mode pulse

torch.distributed spans every rank (NCCL when CUDA is available, else gloo; MASTER_ADDR and
MASTER_PORT from the launcher). Each worker's G ranks train one replica with DDP over the
worker's torch group (sync.process_group), each rank on micro-batches of its own. Every H steps
local rank j runs the window over its 1/G of the model with local rank j of the other workers,
and the worker's ranks then bring each other up to date. Rank 0 prints a line per window and a
summary: the worker's digest (the same on every rank of every worker), and the payload each
worker sent (its local ranks' shares together: one worker's message). The exit status is 3 when
a window's replicas were not identical.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PULSELOCO_LOG_LEVEL", "warn")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import pulseloco  # noqa: E402
from train import ModularAdder, batch, evaluate, every_fact, human_bytes, pretrain  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["pulse", "diloco"], default="pulse")
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("-H", "--inner-steps", type=int, default=8, help="steps per window")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="pairs per step and rank")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ranks-per-worker", type=int, default=None,
                        help="G (default: the launcher's --ranks-per-worker)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(args.seed)
    model = ModularAdder()
    pretrain(model, args.pretrain_steps, args.seed, args.batch)
    model.to(device)
    # Collective over every rank: checks the layout, forms the local ranks' groups and leaves
    # every rank of every worker with worker 0's weights.
    sync = pulseloco.Synchronizer(model.named_parameters(), mode=args.mode,
                                  inner_steps=args.inner_steps, threads=1,
                                  worker=args.ranks_per_worker)
    layout = sync.worker
    trained = torch.nn.parallel.DistributedDataParallel(
        model, process_group=sync.process_group, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + sync.rank + 1)
    facts = tuple(t.to(device) for t in every_fact())
    if sync.rank == 0:
        print(f"{args.mode}: {layout.workers} workers x {layout.ranks_per_worker} ranks, "
              f"{sum(p.numel() for p in model.parameters())} parameters, H={args.inner_steps}",
              flush=True)

    payload = 0
    identical = True
    for _ in range(args.windows):
        report = None
        for _ in range(args.inner_steps):
            pairs, answers = (t.to(device) for t in batch(generator, args.batch))
            loss = F.cross_entropy(trained(pairs), answers)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients inside the worker
            optimizer.step()
            report = sync.after_optimizer_step()
        assert report is not None, "a window runs every H steps"
        payload += report.payload_bytes  # this local rank's share of the worker's message
        identical = identical and report.replicas_identical
        if sync.rank == 0:
            held_out, accuracy = evaluate(model, *facts)
            print(f"window {report.window}: loss {loss.item():.4f}, held-out loss "
                  f"{held_out:.4f}, accuracy {accuracy:.1%}, worker digest {sync.digest}",
                  flush=True)

    # The worker's message: its local ranks' shares together.
    worker_payload = torch.tensor([payload], dtype=torch.int64, device=device)
    dist.all_reduce(worker_payload, group=sync.process_group)
    if sync.rank == 0:
        print(f"summary: {args.windows} windows, payload per worker "
              f"{human_bytes(int(worker_payload.item()))} in total, replicas "
              f"{'bit-identical every window' if identical else 'DIFFERED'}", flush=True)
    sync.close()
    dist.destroy_process_group()
    return 0 if identical else 3


if __name__ == "__main__":
    raise SystemExit(main())
