#!/usr/bin/python3
"""The table (Markdown, on stdout) of the overlapped-windows benchmark from the JSON records of
pulseloco_bench_sync --compute-ratios (scripts/bench_sync_netns ... --json >
bench/results/overlap-netns.jsonl; docs/benchmarks.md, "Overlapped windows").

    bench/overlap_report.py [RECORDS.jsonl]

Per link, compute ratio and overlap, over the repeats: the median window time (and the range),
the compute the inner steps took, the boundary's own work (gate + apply + verify; "apply" in the
target) and how long the boundary waited for the exchange. The last column is the target's
ratio: for an overlapped run (window - boundary work) / max(compute, exchange), with the exchange
of the blocking run of the same round; for a blocking run window / (compute + exchange + boundary
work), which is 1 when nothing overlaps. "vs in flight" is the overlapped runs' ratio against their own
exchange as it ran in the background (the engine's exchange_in_flight: the wire time without
the decoding that the blocking exchange phase includes).
"""
import json
import statistics
import sys


def boundary_work(r):
    p = r["phase_seconds_max"]
    return p["gate"] + p["apply"] + p["verify"]


def spread(values):
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:.3f}"
    return f"{med:.3f} ({min(values):.3f}-{max(values):.3f})"


def main(argv):
    path = argv[0] if argv else "bench/results/overlap-netns.jsonl"
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip().startswith("{")]
    records = [r for r in records if r.get("benchmark") == "sync-overlap"]
    calibrations = [r for r in records if r["role"] == "calibration"]
    runs = [r for r in records if r["role"] == "measurement"]
    blocking = {(r["link_mbit"], r["compute_ratio"], r["repeat"]): r for r in runs
                if r["overlap"] == "blocking"}

    for c in calibrations:
        print(f"- {c['link_mbit']:g} Mbit/s: blocking exchange without compute "
              f"{c['exchange_seconds']:.3f} s (density {100 * c['density']:.2f}%, "
              f"{c['parameters']:.3g} parameters, {c['ranks']} ranks, H = {c['H']}, "
              f"{c['windows']} timed windows per run)")
    print()
    print("| link | compute / exchange | overlap | window (s) | compute (s) | boundary work (s) "
          "| waited for exchange (s) | exchange (s) | target ratio | in flight (s) | vs in flight |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    order = {"blocking": 0, "delayed": 1, "eager": 2}
    keys = sorted({(r["link_mbit"], r["compute_ratio"], r["overlap"]) for r in runs},
                  key=lambda k: (k[0], k[1], order[k[2]]))
    for link, ratio, overlap in keys:
        group = [r for r in runs if (r["link_mbit"], r["compute_ratio"], r["overlap"]) ==
                 (link, ratio, overlap)]
        targets = []
        exchanges = []
        in_flight = [r["phase_seconds_max"]["exchange_in_flight"] for r in group]
        own = [(r["window_seconds"] - boundary_work(r)) /
               max(r["compute_seconds"], r["phase_seconds_max"]["exchange_in_flight"])
               for r in group if overlap != "blocking"]
        for r in group:
            b = blocking.get((link, ratio, r["repeat"]))
            if b is None:
                continue
            exchange = b["exchange_seconds"]
            exchanges.append(exchange)
            work = boundary_work(r)
            if overlap == "blocking":
                targets.append(r["window_seconds"] / (r["compute_seconds"] + exchange + work))
            else:
                targets.append((r["window_seconds"] - work) / max(r["compute_seconds"], exchange))
        print(f"| {link:g} Mbit/s | {ratio:g} | {overlap} "
              f"| {spread([r['window_seconds'] for r in group])} "
              f"| {spread([r['compute_seconds'] for r in group])} "
              f"| {spread([boundary_work(r) for r in group])} "
              f"| {spread([r['phase_seconds_max']['exchange'] for r in group])} "
              f"| {spread(exchanges) if exchanges else '-'} "
              f"| {spread(targets) if targets else '-'} "
              f"| {spread(in_flight) if overlap != 'blocking' else '-'} "
              f"| {spread(own) if own else '-'} |")


if __name__ == "__main__":
    main(sys.argv[1:])
