"""Train a small torch model on several workers, synchronised by pulseloco.

    .venv/bin/python -m pulseloco.launch --nproc-per-node 4 examples/python/train.py --mode pulse
    torchrun --nproc-per-node 4 examples/python/train.py --mode pulse
    mpirun -np 4 .venv/bin/python examples/python/train.py --mode pulse

The task: modular addition, (a, b) -> (a + b) mod 23, learnt by an MLP over embeddings of a and
b. Every worker first pretrains the model alone on the facts with b < 16 (the same steps on
every worker); then post-training, synchronised, extends it to all 529 facts: every worker
trains on batches of its own with AdamW, and every H inner steps pulseloco runs a window
(PULSELoCo, DiLoCo or DDP, --mode) that leaves every worker with the same weights. Rank 0
prints a line per window (training loss, the loss and accuracy on all 529 facts, the window's
payload) and a final line comparing the payload with what DiLoCo and DDP would send, and
whether the replicas stayed identical. The exit status is 3 when they did not. With --overlap
delayed or eager (mode pulse), each window's exchange runs during the next window's inner steps
and its outer step is applied one boundary later; the last window is applied after the loop
(complete_in_flight) before the final line.
"""

from __future__ import annotations

import argparse
import os

# The engine's own per-rank report lines would interleave with rank 0's table; warnings and
# errors still show (PULSELOCO_LOG_LEVEL overrides).
os.environ.setdefault("PULSELOCO_LOG_LEVEL", "warn")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pulseloco  # noqa: E402

MODULUS = 23
PRETRAIN_MAX_B = 16  # pretraining sees the facts with b < 16; post-training all of them


class ModularAdder(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 256):
        super().__init__()
        self.embed = nn.Embedding(MODULUS, width)
        self.mlp = nn.Sequential(nn.Linear(2 * width, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, MODULUS))

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.embed(pairs).flatten(1))


def batch(generator: torch.Generator, size: int,
          max_b: int = MODULUS) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` facts (a, b) with b < max_b, and their answers."""
    a = torch.randint(0, MODULUS, (size,), generator=generator)
    b = torch.randint(0, max_b, (size,), generator=generator)
    pairs = torch.stack([a, b], dim=1)
    return pairs, pairs.sum(dim=1) % MODULUS


def pretrain(model: nn.Module, steps: int, seed: int, size: int) -> None:
    """Learns the facts with b < PRETRAIN_MAX_B (the same on every worker)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        pairs, answers = batch(generator, size, PRETRAIN_MAX_B)
        optimizer.zero_grad()
        F.cross_entropy(model(pairs), answers).backward()
        optimizer.step()


def every_fact() -> tuple[torch.Tensor, torch.Tensor]:
    a, b = torch.meshgrid(torch.arange(MODULUS), torch.arange(MODULUS), indexing="ij")
    pairs = torch.stack([a.flatten(), b.flatten()], dim=1)
    return pairs, pairs.sum(dim=1) % MODULUS


@torch.no_grad()
def evaluate(model: nn.Module, pairs: torch.Tensor, answers: torch.Tensor) -> tuple[float, float]:
    logits = model(pairs)
    accuracy = (logits.argmax(dim=1) == answers).float().mean().item()
    return F.cross_entropy(logits, answers).item(), accuracy


def human_bytes(count: float) -> str:
    """Decimal units, as the engine's own summary line writes them."""
    if count < 1e3:
        return f"{count:.0f} B"
    if count < 1e6:
        return f"{count / 1e3:.1f} kB"
    if count < 1e9:
        return f"{count / 1e6:.2f} MB"
    return f"{count / 1e9:.2f} GB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["pulse", "diloco", "ddp"], default="pulse")
    parser.add_argument("--overlap", choices=["blocking", "delayed", "eager"], default="blocking",
                        help="overlapped windows (mode pulse): the exchange runs during the next "
                             "window's inner steps")
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("-H", "--inner-steps", type=int, default=8, help="steps per window")
    parser.add_argument("--lr", type=float, default=3e-4,
                        help="AdamW's learning rate in post-training")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=64, help="pairs per step and worker")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # the same initial weights everywhere (rank 0's win anyway)
    model = ModularAdder()
    pretrain(model, args.pretrain_steps, args.seed, args.batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # The group forms from the environment (the launcher's, torchrun's or mpirun's). The
    # engine's views are the parameters' own memory: a window writes the new weights into them.
    sync = pulseloco.Synchronizer(model.named_parameters(), mode=args.mode,
                                  inner_steps=args.inner_steps, outer_lr=args.outer_lr,
                                  outer_momentum=args.outer_momentum, overlap=args.overlap,
                                  threads=1)
    rank = sync.rank
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + rank + 1)  # this worker's
    facts = every_fact()
    if rank == 0:
        loss, accuracy = evaluate(model, *facts)
        print(f"{args.mode}: {sync.world_size} workers, {sync.parameter_count} parameters, "
              f"H={args.inner_steps}; held-out loss {loss:.4f}, accuracy {accuracy:.1%}",
              flush=True)

    payload = diloco = ddp = 0
    identical = True
    for window in range(args.windows):
        train_loss = 0.0
        report = None
        for _ in range(args.inner_steps):
            pairs, answers = batch(generator, args.batch)
            loss = F.cross_entropy(model(pairs), answers)
            optimizer.zero_grad()
            loss.backward()
            sync.before_optimizer_step()  # ddp: averages the gradients
            optimizer.step()
            report = sync.after_optimizer_step()  # a window every H steps
            train_loss += loss.item() / args.inner_steps
        assert report is not None, "a window runs every H steps"
        payload += report.payload_bytes
        diloco += report.diloco_bytes
        ddp += report.ddp_bytes
        identical = identical and report.replicas_identical
        if rank == 0:
            loss, accuracy = evaluate(model, *facts)
            applied = "" if args.overlap == "blocking" else (
                f", applied window {report.applied_window}"
                if report.applied_window is not None else ", nothing applied yet")
            print(f"window {report.window}: train loss {train_loss:.4f}, held-out loss "
                  f"{loss:.4f}, accuracy {accuracy:.1%}, density {report.density:.2%}, payload "
                  f"{human_bytes(report.payload_bytes)} (DiLoCo "
                  f"{human_bytes(report.diloco_bytes)}), {report.seconds.total:.3f} s{applied}",
                  flush=True)

    # Overlapped windows: the last window is still in flight; apply it (None when blocking).
    last = sync.complete_in_flight()
    if last is not None:
        identical = identical and last.replicas_identical
        if rank == 0:
            print(f"applied window {last.window} after the last step", flush=True)

    if rank == 0:
        loss, accuracy = evaluate(model, *facts)
        print(f"summary: {args.windows} windows, final held-out loss {loss:.4f} (accuracy "
              f"{accuracy:.1%}), payload per worker {human_bytes(payload)} in total (DiLoCo "
              f"would send {human_bytes(diloco)} = {diloco / max(payload, 1):.1f}x, DDP "
              f"{human_bytes(ddp)} = {ddp / max(payload, 1):.1f}x), replicas "
              f"{'bit-identical every window' if identical else 'DIFFERED'}", flush=True)
    sync.close()
    return 0 if identical else 3


if __name__ == "__main__":
    raise SystemExit(main())
