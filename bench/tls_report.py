#!/usr/bin/env python3
"""TLS against plaintext in pulseloco_bench_transport records (--link-security hmac,tls).

    bench/tls_report.py RECORDS.jsonl [RECORDS.jsonl ...]

One row per (link, pattern, size): the time with TLS (and with TLS and same-host links
plaintext, when measured) / the time with plaintext (hmac) links of each repeat, paired by the
`repeat` field and the run (they were measured one after the other), as the median of the repeats and their
range; the median times; and the median CPU times per operation (the benchmark's
`cpu_seconds`: this process's, so both ranks' when they run as threads, rank 0's when they run
as processes). The link is `link_mbit` Mbit/s when the record has it
(scripts/bench_transport_netns), else loopback. A `setup` (--label) other than the first one
seen gets rows of its own; setups that differ only in a trailing -runN are runs of one. Prints GitHub markdown, the form docs/benchmarks.md uses.
"""
import collections
import json
import re
import statistics
import sys


def load(paths):
    records = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            records.extend(json.loads(line) for line in f if line.strip())
    return records


def size_text(nbytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def time_text(seconds):
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.3f} s"


def link_text(record):
    mbit = record.get("link_mbit")
    if mbit is None:
        return "loopback"
    return f"{mbit // 1000} Gbit/s" if mbit % 1000 == 0 else f"{mbit} Mbit/s"


def main(paths):
    # (setup, link, pattern, bytes) -> repeat -> security -> record
    points = collections.defaultdict(lambda: collections.defaultdict(dict))
    for r in load(paths):
        if r.get("benchmark") != "transport_p2p" or "link_security" not in r:
            continue
        setup = r.get("setup", "")
        key = (re.sub(r"-run\d+$", "", setup), link_text(r), r["pattern"], r["bytes"])
        points[key][(setup, r.get("repeat", 1))][r["link_security"]] = r
    others = [s for s in ("tls", "tls-same-host-plaintext")
              if any(s in p for point in points.values() for p in point.values())]
    names = {"tls": "TLS", "tls-same-host-plaintext": "TLS, same-host plaintext"}
    header = ["link", "pattern", "size"]
    header += [f"{names[s]} / plaintext" for s in others]
    header += ["plaintext"] + [names[s] for s in others]
    header += ["CPU, plaintext"] + [f"CPU, {names[s]}" for s in others]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key in sorted(points, key=lambda k: (k[0], k[1] != "loopback", k[1], k[2], k[3])):
        setup, link, pattern, nbytes = key
        runs = [p for p in points[key].values() if "hmac" in p]
        if not runs:
            continue
        cells = [f"{link} ({setup})" if setup else link, pattern, size_text(nbytes)]
        for s in others:
            ratios = [p[s]["seconds"] / p["hmac"]["seconds"] for p in runs if s in p]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                         if ratios else "")
        for field in ("seconds", "cpu_seconds"):
            for s in ["hmac"] + others:
                values = [p[s][field] for p in runs if s in p]
                cells.append(time_text(statistics.median(values)) if values else "")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
