#!/usr/bin/env python3
"""Density and loss of the two pseudo-gradient definitions for bf16 weights.

Post-trains the example model with its weights stored in bf16 (pulseloco_train --local-dtype
bf16), once with --bf16-delta exact and once with --bf16-delta authors, on the same seeds, data
and hyper-parameters, RANKS workers over TCP on loopback (--local-workers). The runs alternate
(exact, authors, exact, ... for --repeats > 1), so that a slow minute of a shared machine falls
on both; densities and losses do not depend on timing (the runs are deterministic), only
sync_seconds does. Appends one JSON line per run to OUT and prints a per-window table.

  bench/bf16_delta.py [--ranks 2] [--windows 5] [--lr 3e-6] [--repeats 1]
                      [--out bench/results/bf16-delta-loopback.jsonl]

Needs build/bin/pulseloco_train; the pretrained state is cached in build/cache (built on first
use, a few minutes).
"""

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cpu_model():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def git_commit():
    result = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return result.stdout.strip() or None


def run_once(args, delta, work):
    report = work / f"{delta}.json"
    command = [str(args.train), "--local-workers", str(args.ranks), "--mode", "pulse",
               "--local-dtype", "bf16", "--bf16-delta", delta, "--windows", str(args.windows),
               "-H", str(args.steps_per_window), "--lr", str(args.lr), "--threads", "1",
               "--json", str(report)]
    if args.cache_dir:
        command += ["--cache-dir", str(args.cache_dir)]
    print("+ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, timeout=args.timeout)
    return json.loads(report.read_text())


def record(args, delta, report):
    windows = report["windows"]
    return {
        "benchmark": "bf16_delta",
        "bf16_delta": delta,
        "local_dtype": report["local_dtype"],
        "ranks": report["world_size"],
        "params": report["params"],
        "H": report["H"],
        "lr": report["lr"],
        "seed": report["seed"],
        "initial_loss": report["initial_loss"],
        "final_loss": report["final_loss"],
        "mean_density": sum(w["density"] for w in windows) / max(1, len(windows)),
        "payload_bytes": sum(w["payload_bytes"] for w in windows),
        "replicas_identical": report["replicas_identical"],
        "windows": [{"window": w["window"], "density": w["density"], "entries": w["entries"],
                     "loss": w["loss"], "train_loss": w["train_loss"],
                     "payload_bytes": w["payload_bytes"], "sync_seconds": w["sync_seconds"]}
                    for w in windows],
        "machine": {"cpu": cpu_model(), "logical_cpus": os.cpu_count()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=pathlib.Path, default=ROOT / "build/bin/pulseloco_train")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--steps-per-window", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-6)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cache-dir", type=pathlib.Path)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", type=pathlib.Path,
                        default=ROOT / "bench/results/bf16-delta-loopback.jsonl")
    args = parser.parse_args()
    if args.ranks < 1 or args.windows < 1 or args.repeats < 1:
        parser.error("--ranks, --windows and --repeats must be at least 1")

    records = []
    with tempfile.TemporaryDirectory(prefix="pulseloco-bf16-delta-") as tmp:
        for repeat in range(args.repeats):
            order = ("exact", "authors") if repeat % 2 == 0 else ("authors", "exact")
            for delta in order:
                records.append(record(args, delta, run_once(args, delta, pathlib.Path(tmp))))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as out:
        for r in records:
            out.write(json.dumps(r) + "\n")

    print(f"\n{'delta':>8} {'window':>6} {'density':>9} {'entries':>9} {'loss':>9}")
    for r in records:
        for w in r["windows"]:
            print(f"{r['bf16_delta']:>8} {w['window']:>6} {100 * w['density']:>8.3f}% "
                  f"{w['entries']:>9} {w['loss']:>9.5f}")
    print(f"\n{'delta':>8} {'mean density':>13} {'final loss':>11} {'initial loss':>13}")
    for r in records:
        print(f"{r['bf16_delta']:>8} {100 * r['mean_density']:>12.3f}% {r['final_loss']:>11.5f} "
              f"{r['initial_loss']:>13.5f}")
    print(f"records appended to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
