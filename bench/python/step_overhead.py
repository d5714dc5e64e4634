"""What the Python binding adds to a training step that runs no window.

    PYTHONPATH=build/python .venv/bin/python bench/python/step_overhead.py [--tensors 200]
        [--elements 4096] [--calls 20000] [--repeats 15] [--json FILE]

One rank (world size 1, TCP on loopback) whose Synchronizer holds --tensors torch.Tensor
parameters (fp32, --elements each) with H so large that no window runs. timeit times
after_optimizer_step() (the step counter only), before_optimizer_step() (pulse mode: nothing to
do) and, as the floor any Python call pays, a method of a plain Python object doing nothing:
--repeats runs of --calls calls each. Prints the median, minimum and maximum over the runs in
microseconds per call, and with --json writes them (and the machine) as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import timeit
from datetime import datetime, timezone

import torch


def one_rank_group() -> None:
    """World size 1 from the environment, unless the caller set one up."""
    if "WORLD_SIZE" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      PULSELOCO_LISTEN_ADDR="127.0.0.1")


class NoOp:
    def step(self) -> None:
        pass


def per_call_us(function, calls: int, repeats: int) -> dict[str, float]:
    runs = [seconds / calls * 1e6
            for seconds in timeit.repeat(function, number=calls, repeat=repeats)]
    return {"median_us": statistics.median(runs), "min_us": min(runs), "max_us": max(runs),
            "runs_us": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--elements", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    os.environ.setdefault("PULSELOCO_LOG_LEVEL", "warn")
    one_rank_group()
    import pulseloco

    torch.manual_seed(0)
    parameters = {f"layer{i}.weight": torch.randn(args.elements) for i in range(args.tensors)}
    # H beyond any step count the benchmark reaches: no call runs a window.
    steps = args.calls * args.repeats * 4 + 1
    with pulseloco.Synchronizer(parameters, mode="pulse", inner_steps=steps, threads=1) as sync:
        results = {
            "after_optimizer_step": per_call_us(sync.after_optimizer_step, args.calls,
                                                args.repeats),
            "before_optimizer_step": per_call_us(sync.before_optimizer_step, args.calls,
                                                 args.repeats),
            "python_noop_method": per_call_us(NoOp().step, args.calls, args.repeats),
        }
        assert sync.committed_windows == 0, "a window ran during the benchmark"

    for name, result in results.items():
        print(f"{name:24s} median {result['median_us']:.3f} us/call "
              f"(min {result['min_us']:.3f}, max {result['max_us']:.3f}; "
              f"{args.repeats} runs of {args.calls} calls)")
    if args.json:
        record = {
            "benchmark": "python_step_overhead",
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
            "machine": {"cpu": cpu_name(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                        "torch": torch.__version__, "platform": platform.platform()},
            "pulseloco": pulseloco.__version__,
            "tensors": args.tensors, "elements": args.elements, "calls": args.calls,
            "repeats": args.repeats, "results": results,
        }
        with open(args.json, "w") as out:
            json.dump(record, out, indent=2)
            out.write("\n")
    return 0


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
