#!/usr/bin/env python3
"""The tables of bench/exchange_scaling.sh's records, one per local weight dtype and encoding: per
worker count and window, the union ratio, the kind the automatic choice ran, the bytes rank 0 received
under each kind and their ratios, and whether every kind ended on the same digest.

    python3 bench/exchange_report.py bench/results/exchange-scaling-example.jsonl [MORE.jsonl]
"""
import json
import sys


def main(paths):
    records = [json.loads(line) for path in paths for line in open(path) if line.strip()]
    setting = lambda r: (r.get("local_dtype", "bf16"), r.get("encoding", "pulse"))
    for dtype, encoding in sorted({setting(r) for r in records}):
        print(f"local weights: {dtype}, encoding: {encoding}")
        table([r for r in records if setting(r) == (dtype, encoding)])


def table(records):
    cells = {}
    for r in records:
        cells[(r["ranks"], r["window"], r["option"])] = r
    print(f"{'R':>3} {'window':>6} {'union':>6} {'auto ran':>9} {'allgather':>11} "
          f"{'reduction':>11} {'auto':>11} {'auto/ag':>8} {'same bits':>9}")
    by_r = {}
    for (ranks, window) in sorted({(k[0], k[1]) for k in cells}):
        row = {o: cells.get((ranks, window, o)) for o in ("allgather", "reduction", "auto")}
        if None in row.values():
            continue
        received = {o: row[o]["received_bytes"] for o in row}
        same = len({row[o]["digest"] for o in row}) == 1
        print(f"{ranks:>3} {window:>6} {row['allgather']['union_ratio']:>6.3f} "
              f"{row['auto']['exchange']:>9} "
              + " ".join(f"{received[o] / 1e6:>8.3f} MB" for o in ("allgather", "reduction", "auto"))
              + f" {received['auto'] / received['allgather']:>8.3f} {str(same):>9}")
        by_r.setdefault(ranks, []).append(received)
    if 4 in by_r and 16 in by_r:
        for kind in ("allgather", "auto"):
            a = sum(x[kind] for x in by_r[4])
            b = sum(x[kind] for x in by_r[16])
            print(f"{kind}: bytes received at R = 16 over R = 4: {b / a:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
