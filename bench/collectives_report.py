#!/usr/bin/env python3
"""Tables of pulseloco_bench_collectives runs: one row per (operation, size), one column per
setup, each cell listing the runs of that setup.

    bench/collectives_report.py RECORDS.jsonl [RECORDS.jsonl ...]

Records are grouped by their `setup` (the benchmark's --label) with a trailing `-runN`
removed, so that the runs of one build or setting share a column. A setup that timed the same
point with more than one algorithm (bench_collectives_netns --algorithms ring,direct) gets one
column per algorithm, named `setup (algorithm)`. A cell lists each run's
ratio (ours / OpenMPI's time, median over the rounds; or our time / the link's bound for runs
over shaped links) and the range of our CPU time per call, and, against OpenMPI, of our CPU
per call / OpenMPI's. Prints GitHub markdown, the form docs/benchmarks.md uses.
"""
import collections
import json
import re
import sys


def load(paths):
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            records.extend(json.loads(line) for line in f if line.strip())
    return records


def group_of(setup):
    return re.sub(r"-run\d+$", "", setup or "")


def size_text(nbytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def main(paths):
    if not paths:
        sys.exit("usage: collectives_report.py RECORDS.jsonl [RECORDS.jsonl ...]")
    records = load(paths)
    # OpenMPI's record of the same round set, for the CPU ratio.
    theirs = {(r["setup"], r["operation"], r["bytes_per_rank"]): r
              for r in records if r["transport"] == "openmpi-tcp"}
    ours = [r for r in records if r["transport"] == "pulseloco-tcp"]
    if not ours:
        sys.exit("no records of pulseloco-tcp")
    # A setup splits by algorithm only where it timed one point with several (an `automatic`
    # run takes different algorithms at different sizes and stays one column).
    algorithms = collections.defaultdict(set)
    for r in ours:
        point = (r["operation"], r.get("link_mbit"), r["bytes_per_rank"])
        algorithms[(group_of(r["setup"]), point)].add(r.get("algorithm"))
    split = {group for (group, _), names in algorithms.items() if len(names) > 1}

    def column_of(r):
        group = group_of(r["setup"])
        return f"{group} ({r.get('algorithm')})" if group in split else group

    groups = list(dict.fromkeys(column_of(r) for r in ours))
    cells = collections.defaultdict(list)
    for r in ours:
        link = r.get("link_mbit")
        key = (r["operation"], link, r["bytes_per_rank"])
        cells[(key, column_of(r))].append(r)
    keys = sorted({key for key, _ in cells}, key=lambda k: (k[0], k[1] or 0, k[2]))
    print("| operation | link | bytes per rank | " + " | ".join(groups) + " |")
    print("|---|---|---|" + "---|" * len(groups))
    for key in keys:
        operation, link, nbytes = key
        row = []
        for group in groups:
            runs = cells.get((key, group), [])
            if not runs:
                row.append("")
                continue
            ratios = [r.get("ratio_to_openmpi", r.get("ratio_to_bound")) for r in runs]
            text = ", ".join("-" if x is None else f"{x:.2f}" for x in ratios)
            cpu = [r["cpu_seconds"] * 1e3 for r in runs]
            text += f" (cpu {min(cpu):.1f}-{max(cpu):.1f} ms"
            cpu_ratios = [r["cpu_seconds"] / t["cpu_seconds"] for r in runs
                          if (t := theirs.get((r["setup"], operation, nbytes)))
                          and t["cpu_seconds"] > 0]
            if cpu_ratios:
                text += f"; cpu ratio {min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}"
            row.append(text + ")")
        link_text = "loopback" if link is None else f"{link:g} Mbit/s"
        print(f"| {operation} | {link_text} | {size_text(nbytes)} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
