"""Stream every window's report to a metrics sink: TensorBoard when it is installed, else a CSV.

    .venv/bin/python -m pulseloco.launch --nproc-per-node 2 examples/python/metrics.py --out runs/a

The Synchronizer hands each WindowReport to on_report= as the window completes. Rank 0 writes
the scalars of report.to_dict() (the fields of docs/operations.md, "The per-window report")
to torch.utils.tensorboard's SummaryWriter under --out when tensorboard is installed, otherwise
one CSV row per window to --out/windows.csv, flushed as it is written. Every rank could write
its own (the reports differ in payload and timings); rank 0 keeps the example short.
"""

from __future__ import annotations

import argparse
import csv
import pathlib

import torch
from torch import nn

import pulseloco


def scalars(report: pulseloco.WindowReport) -> dict[str, int | float]:
    """The report's numbers, the phases' seconds as seconds/<phase>."""
    row = report.to_dict()
    out = {f"seconds/{phase}": value for phase, value in row.pop("seconds").items()}
    for name, value in row.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = value
    return out


class TensorBoardSink:
    def __init__(self, directory: pathlib.Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=str(directory))

    def __call__(self, report: pulseloco.WindowReport) -> None:
        for name, value in scalars(report).items():
            self.writer.add_scalar(name, value, report.window)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CsvSink:
    def __init__(self, directory: pathlib.Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / "windows.csv"
        self.file = open(self.path, "w", newline="")
        self.writer = None

    def __call__(self, report: pulseloco.WindowReport) -> None:
        row = {"window": report.window, "digest": report.digest, **scalars(report)}
        if self.writer is None:
            self.writer = csv.DictWriter(self.file, fieldnames=list(row))
            self.writer.writeheader()
        self.writer.writerow(row)
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def make_sink(directory: pathlib.Path):
    try:
        return TensorBoardSink(directory)
    except ImportError:
        return CsvSink(directory)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/pulseloco"))
    parser.add_argument("--mode", choices=["pulse", "diloco", "ddp"], default="pulse")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("-H", "--inner-steps", type=int, default=4)
    parser.add_argument("--csv", action="store_true", help="write the CSV even with tensorboard")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sink = None  # rank 0's, once the group has formed

    def deliver(report: pulseloco.WindowReport) -> None:
        if sink is not None:
            sink(report)

    sync = pulseloco.Synchronizer(model.named_parameters(), mode=args.mode,
                                  inner_steps=args.inner_steps, threads=1, on_report=deliver)
    if sync.rank == 0:
        sink = CsvSink(args.out) if args.csv else make_sink(args.out)
    generator = torch.Generator().manual_seed(sync.rank + 1)  # this worker's data
    for _ in range(args.windows * args.inner_steps):
        x = torch.randn(32, 16, generator=generator)
        loss = ((model(x) - x.sum(dim=1, keepdim=True).sin()) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        sync.before_optimizer_step()
        optimizer.step()
        sync.after_optimizer_step()  # every H-th step: a window, its report goes to the sink
    sync.complete_in_flight()  # overlapped windows: the last one's report too
    sync.close()
    if sink is not None:
        sink.close()
        print(f"{args.windows} windows written to {getattr(sink, 'path', args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
